"""Continuous batching over a static KV cache.

The cache has `slots` rows of `max_len` positions per layer. Every sample of a request gets a row
while it is being generated and gives it back when it finishes; a new sample takes the lowest free
row at the next scheduler iteration (its prompt is prefilled into the row, once per request for all
its n samples), so short responses come back at once and their rows go to waiting requests.

A decode step runs rows [0, B) of the cache over positions [0, L), with B and L rounded up to
buckets, so a step has few distinct shapes; on a GPU each shape is captured once as a CUDA graph
(optionally compiled first) and replayed. The step keeps its state on the device (the next input
token, its position, its step index), so the host never has to feed it: while the GPU runs step
k, the host reads the tokens of step k-1, finishes samples and prepares admissions. A row that
finished in step k-1 is computed once more in step k and the result is dropped.

The generator's parts, each in its own file: the decode step and its graphs (decode.py), the
prefill (prefill.py), the prefix cache of kept rows (prefix_cache.py) and the shared-prompt groups
of the decode attention (groups.py); the requests and samples it serves are in sequence.py.

Prefix reuse (opt-in: `prefix_rows` > 0, the worker's --prefix-cache). A finished sample's row is
kept instead of freed (prefix_cache.py). `_place` is the one place that decides reuse: a new
request's prompt is compared with every kept row; the longest common prefix (at least prefix_min
tokens, at most the prompt's length - 1) wins, and the request's first sample takes that row (or,
when an earlier request of the same admission took it, gets a copy of the prefix in a row of its
own); its other samples get copies of the prompt after the prefill. A kept row is evicted (least
recently used, sparing rows that waiting prompts would reuse) only when a sample needs a row and
no row is free. A prompt with a cached prefix is prefilled eagerly from its first new token, never
by the bucketed CUDA-graph path of a lone prompt; prompts without one are prefilled exactly as
with reuse off. The engine drops every kept row when the weights change (a training step, a load,
an adapter change): `forget_prefixes`.
Reuse relaxes batch invariance: a suffix prefill is a different computation from a full one, so a
completion's floating-point values can depend on whether an earlier turn was still cached.
"""

from __future__ import annotations

import collections
import logging

import torch

from . import batch_invariant as bi
from . import kernels, lora, sampling
from .decode import Decode
from .groups import SharedPrompts
from .model import Transformer
from .prefill import Prefill
from .prefix_cache import PrefixCache
from .sequence import Placed, Request, Sequence, prompt_key
from .types import Completion

__all__ = ["Generator", "Placed", "Request", "Sequence"]

log = logging.getLogger("slimen_torch")


def _bucket(n: int, cap: int, sizes) -> int:
    for s in sizes:
        if s >= n:
            return min(s, cap)
    return cap


class Generator(Decode, Prefill):
    """Owns the KV cache and schedules samples into its rows; driven by one thread
    (engine.Worker). Its parts: the decode step (the Decode methods), the prefill (the Prefill
    methods), the prefix cache (`prefix`) and the shared-prompt groups (`groups`)."""

    def __init__(self, model: Transformer, tokenizer, eos: list[int], *, slots: int, max_len: int,
                 cuda_graphs: bool, compile_layers: bool, prefill_tokens: int,
                 compile_prefill: bool = False,
                 length_bucket: int = 64, triton: bool = False, fused_b1: bool = False,
                 prefill_graph_max: int = 0, prefix_rows: int = 0, prefix_min: int = 16,
                 kv_dtype: torch.dtype | None = None, shared_prompts: bool = False):
        self.model = model
        self.tokenizer = tokenizer
        self.eos = set(eos)
        self.S, self.L = slots, max_len
        self.device = model.embed.device
        self.cuda = self.device.type == "cuda"
        self.prefill_tokens = prefill_tokens  # prompt tokens an admission prefills, at most
        self.length_bucket = length_bucket
        # The worker's LoRA adapters (lora.Bank), set by the engine. While it holds any, the
        # decode step applies each row's adapter through the bank's table (lora.Slots: inside
        # the CUDA graphs, compiled layers and Triton-split layers; decode.py), and the prefill
        # runs the prefill layer (compiled on a GPU, lora.PREFILL_COMPILED) with the same table
        # (_prefill_lora).
        self.bank = None
        # The cache's storage dtype: the model's, or float8_e4m3fn (engine.Options.kv_cache_dtype
        # "fp8"): every write casts with saturation (model.kv_store), every read converts back
        # to the model's dtype (model.kv_read; the Triton kernel converts to fp16, exactly).
        self.kv_dtype = kv_dtype or model.embed.dtype
        self.k = self.v = None  # per layer [slots, kv_heads, max_len, head_dim], on first use
        self._init_decode(cuda_graphs, compile_layers, triton, fused_b1)
        self._init_rows()
        self._init_prefill(compile_prefill=compile_prefill, prefill_graph_max=prefill_graph_max)
        self.prefix = PrefixCache(prefix_rows, prefix_min, slots=slots, max_len=max_len,
                                  device=self.device)
        self.groups = SharedPrompts(shared_prompts and self.triton, slots=slots,
                                    device=self.device)

    def _init_rows(self) -> None:
        """The rows' samples, the waiting queue and the device-side step state, one entry per
        cache row (see the module comment)."""
        long = dict(dtype=torch.long, device=self.device)
        f32 = dict(dtype=torch.float32, device=self.device)
        S = self.S
        self.tok, self.pos, self.step_idx, self.key = (torch.zeros(S, **long) for _ in range(4))
        self.temp, self.top_p = torch.zeros(S, **f32), torch.ones(S, **f32)
        self.active = torch.zeros(S, dtype=torch.bool, device=self.device)
        # Each row's slot in the LoRA table (0: the base), and its copy on the host (_lora_step).
        self.lora_idx = torch.zeros(S, **long)
        self.lora_host = [0] * S
        # Counts the changes of which samples the rows run (admitted, stopped, freed): what
        # _lora_step's cache of the rows' adapters follows.
        self.row_changes = 0
        # A step's sampled tokens (int64) and log-probs (fp32) side by side in one buffer of
        # 32-bit words, so that one copy a step brings both to the host.
        self.out = torch.zeros(3 * S, dtype=torch.int32, device=self.device)
        self.out_tok, self.out_lp = self._split_out(self.out, S)
        self.masked = None  # the constrained rows of the step being run (_masks)
        self.host = [torch.zeros(3 * S, dtype=torch.int32, pin_memory=self.cuda)
                     for _ in range(2)]
        self.slots: list[Sequence | None] = [None] * S
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.inflight = None
        self.launches = 0  # steps launched: the host buffer a step's output goes to alternates
        # Whether a sampled token outside the vocabulary was logged (_append: once).
        self.bad_token = False
        self.batch_sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]  # a step's row buckets

    @staticmethod
    def _split_out(buf: torch.Tensor, S: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [S] int64, log-probs [S] fp32): views of a step's output words."""
        return buf[:2 * S].view(torch.int64), buf[2 * S:].view(torch.float32)

    def _lora(self) -> bool:
        return self.bank is not None and bool(self.bank.adapters)

    def _rows(self, adapters) -> "lora.Rows":
        return self.bank.rows(adapters, self.device)

    def _prefill_lora(self, adapters):
        """The selection a prefill of rows using adapters (None: the base) runs under: lora.Slots
        over the bank's table, the decode step's arithmetic, where the table takes them with the
        running rows' adapters (none of those is evicted); else lora.Rows (decode.py's
        _lora_step says when)."""
        if self.lora_table and not bi.enabled():
            t = self._table()
            running = [s.req.adapter for s in self.slots if s is not None and not s.done]
            if t.place(a for a in adapters + running if a is not None) and t.cap:
                # (from pinned memory: the copy does not make the host wait for the GPU)
                idx = torch.tensor([t.slot_of(a) for a in adapters], dtype=torch.long,
                                   pin_memory=self.cuda)
                return lora.Slots(t, idx.to(self.device, non_blocking=True))
        return self._rows(adapters)

    def fail_adapter(self, adapter, message: str) -> None:
        """Ends the requests generated by adapter (being removed) with an error."""
        reqs = {id(s.req): s.req for s in list(self.waiting) + self.slots
                if s is not None and s.req.adapter is adapter}
        for r in reqs.values():
            self.cancel(r.id)
            if r.on_error is not None:
                r.on_error("FAILED_PRECONDITION", message)

    # ---- requests ----

    def add(self, req: Request) -> None:
        s = req.sampling
        room = self.L - len(req.prompt)
        for i in range(req.n):
            self.waiting.append(Sequence(req, i, max(1, min(s.max_tokens, room))))

    def busy(self) -> bool:
        return bool(self.waiting) or self.inflight is not None or any(
            s is not None for s in self.slots)

    def cancel(self, rid: str) -> None:
        """Drops the samples of request rid, waiting or running; nothing more is emitted."""
        for s in list(self.waiting):
            if s.req.id == rid:
                s.req.cancelled = True
        self.waiting = collections.deque(s for s in self.waiting if not s.req.cancelled)
        freed = []
        for slot, s in enumerate(self.slots):
            if s is not None and s.req.id == rid:
                s.req.cancelled = True
                s.done = True
                freed.append(slot)
        self._free(freed)

    def fail_all(self, message: str) -> None:
        """Ends every waiting and running request with an error and empties the cache rows."""
        reqs = {id(s.req): s.req for s in self.waiting}
        reqs.update({id(s.req): s.req for s in self.slots if s is not None})
        self.waiting.clear()
        self.inflight = None
        for s in self.slots:
            if s is not None:
                s.done = True
        # The callers first: freeing the rows runs on the device, which may be what failed.
        for r in reqs.values():
            if not r.cancelled and r.on_error is not None:
                r.cancelled = True
                r.on_error("INTERNAL", message)
        self._free([i for i, s in enumerate(self.slots) if s is not None])
        self.forget_prefixes()

    # ---- the prefix cache (prefix_cache.py) and the shared-prompt groups (groups.py), under
    # the names the engine, the tests and bench.py use ----

    def forget_prefixes(self) -> int:
        """Drops every kept row (the weights changed: their keys and values are stale); returns
        how many there were."""
        return self.prefix.forget()

    def take_prefix_stats(self) -> dict:
        """The prefix-reuse counters since the last call, and zeroes them."""
        return self.prefix.take_stats()

    @property
    def prefix_rows(self) -> int:
        """The rows the prefix cache keeps at most; 0: prefix reuse is off."""
        return self.prefix.rows

    @property
    def kept(self) -> collections.OrderedDict:
        """The prefix cache's kept rows, least recently used first."""
        return self.prefix.kept

    def _group(self, keyed: list[tuple[Sequence, tuple]]) -> None:
        """Groups samples just admitted whose rows hold copies of one prompt (the same key)."""
        self.groups.form(keyed)

    def _ungroup(self, rows: list[int]) -> None:
        """Takes rows that finish, stop or go idle out of their groups."""
        self.groups.leave(rows)

    @property
    def share(self) -> bool:
        """Whether the samples of a prompt are grouped for the shared-prompt attention."""
        return self.groups.enabled

    @share.setter
    def share(self, on: bool) -> None:
        self.groups.enabled = on

    @property
    def n_grouped(self) -> int:
        return self.groups.n_grouped

    @property
    def lead(self) -> list[int]:
        return self.groups.lead

    @property
    def grp(self) -> torch.Tensor:
        return self.groups.grp

    @property
    def plen(self) -> torch.Tensor:
        return self.groups.plen

    # ---- the scheduler iteration ----

    def step(self) -> None:
        """Admits waiting samples, launches one decode step, processes the previous one."""
        self._admit()
        if self.inflight is not None and any(s is not None and s.cst is not None for s in self.slots):
            # A constrained row's mask needs its last token: no step in flight while one runs.
            self._process(self.inflight)
            self.inflight = None
        launched = self._launch()
        if self.inflight is not None:
            self._process(self.inflight)
        self.inflight = launched

    def flush(self) -> None:
        """Processes the step in flight (before anything else touches the model)."""
        if self.inflight is not None:
            self._process(self.inflight)
            self.inflight = None

    # ---- cache ----

    def _ensure_cache(self) -> None:
        if self.k is not None:
            return
        cfg = self.model.cfg
        shape = (self.S, cfg.kv_heads, self.L, cfg.head_dim)
        dt = self.kv_dtype
        # One tensor per layer: the compiled layer function sees the same kind of input each time.
        self.k = [torch.zeros(shape, dtype=dt, device=self.device) for _ in range(cfg.layers)]
        self.v = [torch.zeros(shape, dtype=dt, device=self.device) for _ in range(cfg.layers)]

    def _free(self, slots: list[int]) -> None:
        if not slots:
            return
        self.row_changes += 1
        self._ungroup(slots)
        for slot in slots:
            self.slots[slot] = None
        idx = torch.tensor(slots, device=self.device)
        self.active[idx] = False
        if self.prefix.rows:
            self.prefix.save_pos0(self.k, self.v, slots)
        self.pos[idx] = 0  # an idle row keeps writing at position 0, inside every length bucket

    # ---- admission ----

    @torch.no_grad()
    def _admit(self) -> None:
        """Places waiting samples into rows (_place), prefills their prompts and samples their
        first tokens into the step state."""
        if not self.waiting:
            return
        placed = self._place()
        if not placed:
            return
        picked = [p.seq for p in placed]
        self._ensure_cache()
        self.row_changes += 1
        for s in picked:
            self.slots[s.slot] = s
        # The samples' rows, prompt lengths and keys, and their sampling settings: one copy each.
        meta = torch.tensor([[s.slot for s in picked], [len(s.req.prompt) for s in picked],
                             [s.key for s in picked]], dtype=torch.long).to(self.device)
        fmeta = torch.tensor([[s.req.sampling.temperature for s in picked],
                              [s.req.sampling.top_p for s in picked]],
                             dtype=torch.float32).to(self.device)
        dst, plen, key = meta
        temp, top_p = fmeta
        logits = self._prefill(placed)
        tok, lp = self._first_tokens(logits, picked, temp, top_p, key)
        self.tok.index_copy_(0, dst, tok)
        self.pos.index_copy_(0, dst, plen)
        self.step_idx.index_fill_(0, dst, 1)
        self.key.index_copy_(0, dst, key)
        self.temp.index_copy_(0, dst, temp)
        self.top_p.index_copy_(0, dst, top_p)
        self.active.index_fill_(0, dst, True)
        if self.groups.enabled:
            # Rows of one plain prefill of a prompt are copies of it, whatever their request; a
            # request's samples placed with a prefix start are copies of their lead's row.
            self._group([(p.seq, ("prompt",) + prompt_key(p.seq.req))
                         for p in placed if not p.start] +
                        [(p.seq, ("request", id(p.seq.req))) for p in placed if p.start])
        tok_l, lp_l = tok.tolist(), lp.tolist()
        finished = []
        for s, t, l in zip(picked, tok_l, lp_l):
            s.launched = 1
            if self._append(s, t, l):
                finished.append(s)
        self._finish(finished)

    def _first_tokens(self, logits, picked: list[Sequence], temp, top_p, key):
        """Each sample's first token and its log-prob, drawn from its prompt's last logits as a
        decode step draws (step index 0)."""
        n = len(picked)
        use_top_p = any(s.req.sampling.top_p < 1 for s in picked)
        zeros = torch.zeros(n, dtype=torch.long, device=self.device)
        if self.triton and self.first_token_triton:
            # The decode steps' sampler (two kernels) with step index 0: the same draws.
            tok, lp = kernels.sample_and_advance(logits, temp, key, zeros)
            if use_top_p:
                tok, lp = self._with_top_p(logits, temp, top_p, sampling.uniform(key, zeros),
                                           tok, lp)
        else:
            tok, lp = sampling.sample(logits if bi.enabled() else logits.float(), temp, top_p,
                                      sampling.uniform(key, zeros), use_top_p)
        masked = self._masks(list(enumerate(picked)))
        if masked is not None:
            tok, lp = self._constrained(logits, temp, top_p, sampling.uniform(key, zeros), tok, lp,
                                        masked)
        return tok, lp

    def _place(self) -> list[Placed]:
        """Takes the waiting samples admitted now off the queue and gives each a cache row
        (s.slot). The one place that decides prefix reuse (see the module comment): the first
        sample of a request whose prompt shares at least prefix_min tokens with a kept row starts
        there, taking the row over or (when the row is pinned by another sample of this
        admission) copying its prefix; the request's other samples follow it (copies after its
        prefill)."""
        cache = self.prefix
        free = [i for i, s in enumerate(self.slots) if s is None and i not in cache.kept]
        free.reverse()  # pop() takes the lowest row
        reusing = bool(cache.rows) and bool(cache.kept)
        pinned: set[int] = set()  # rows a sample of this admission takes or copies a prefix from
        taken: list[int] = []  # kept rows taken over by a sample of this admission
        placed: list[Placed] = []
        leads: dict[int, Placed] = {}  # id(request) -> its first sample placed now
        queue, self.waiting = list(self.waiting), collections.deque()
        # Under slot pressure, the kept rows that waiting prompts would reuse are evicted last;
        # a prompt that would have to evict one is passed over (it waits for a row that frees).
        wanted = cache.wanted(queue) if reusing and len(queue) > len(free) else set()
        passed: set[int] = set()  # id() of the requests passed over
        budget = 0

        def row(spare_wanted: bool) -> int:
            """A row for a sample: a free one, else the least recently used kept one that is not
            pinned (and not wanted, with spare_wanted); -1 if none."""
            if free:
                return free.pop()
            return cache.evict_lru(pinned | wanted if spare_wanted else pinned)

        for i, s in enumerate(queue):
            if id(s.req) in passed:
                self.waiting.append(s)
                continue
            lead = leads.get(id(s.req))
            if lead is not None:  # another sample of a prompt prefilled now
                slot = row(False)
                if slot < 0:
                    self.waiting.extend(queue[i:])
                    break
                p = Placed(s, lead.start, -1, lead.seq)
            else:
                start, src = cache.match(s.req, pinned) if reusing else (0, -1)
                cost = len(s.req.prompt) - start
                if leads and budget + cost > self.prefill_tokens:
                    self.waiting.extend(queue[i:])
                    break
                if src >= 0 and src in cache.kept and src not in pinned:
                    slot = src  # the sample takes the kept row over
                    cache.take(src, start)
                    taken.append(src)
                else:
                    slot = row(True)
                    if slot < 0:
                        if any(r not in pinned for r in cache.kept):  # only wanted rows left
                            passed.add(id(s.req))
                            self.waiting.append(s)
                            continue
                        self.waiting.extend(queue[i:])
                        break
                    if src >= 0:
                        pinned.add(src)
                        cache.touch(src)
                budget += cost
                p = Placed(s, start, src, s)
                leads[id(s.req)] = p
                cache.count(len(s.req.prompt), start)
            pinned.add(slot)
            s.slot = slot
            s.weights = cache.weights
            cache.occupied(slot)
            placed.append(p)
        for r in taken:
            cache.unindex(r)
        return placed

    # ---- constraints (constrain.py) ----

    def _masks(self, rows: list[tuple[int, Sequence]]):
        """The masks of the constrained samples among rows ((row, sample) pairs): (rows as a
        tensor, an additive bias [len, vocab] of 0 for the allowed tokens and -inf for the
        others), or None when none is constrained. A sample whose constraint allows no token
        fails its request (it cannot happen with a vocabulary that has the grammar's bytes)."""
        idx, allowed = [], []
        for row, s in rows:
            if s.cst is None or s.done:
                continue
            ids = s.req.matcher.allowed(s.cst)
            if not ids:
                self._dead_end(s)
                continue
            idx.append(row)
            allowed.append(ids)
        if not idx:
            return None
        V = self.model.cfg.vocab_size
        bias = torch.full((len(idx), V), float("-inf"))
        for k, ids in enumerate(allowed):
            bias[k, torch.tensor(ids, dtype=torch.long)] = 0.0
        return torch.tensor(idx, device=self.device), bias.to(self.device)

    def _dead_end(self, s: Sequence) -> None:
        req = s.req
        if not req.cancelled:
            req.cancelled = True
            if req.on_error is not None:
                req.on_error("FAILED_PRECONDITION", f"request {req.id!r}: the constraint leaves no token "
                             f"of the vocabulary after {self.tokenizer.decode(s.tokens)!r}")

    # ---- a step: launched, then read back while the next one runs ----

    @torch.no_grad()
    def _launch(self):
        rows = []
        stop = []
        for slot, s in enumerate(self.slots):
            if s is None or s.done:
                continue
            if s.launched >= s.max_tokens:
                stop.append(slot)  # its last token is in flight; keep the row idle
                continue
            rows.append((slot, s))
        if stop:
            # Idle rows must not advance, and must write inside whatever length bucket runs next.
            self.row_changes += 1
            self._ungroup(stop)
            if self.prefix.rows:
                self.prefix.save_pos0(self.k, self.v, stop)
            idx = torch.tensor(stop, device=self.device)
            self.active[idx] = False
            self.pos[idx] = 0
        if not rows:
            return None
        B = _bucket(rows[-1][0] + 1, self.S, self.batch_sizes)
        longest = max(len(s.req.prompt) + s.launched for _, s in rows)  # = last position + 1
        L = min(-(-longest // self.length_bucket) * self.length_bucket, self.L)
        use_top_p = any(s.req.sampling.top_p < 1 for _, s in rows)
        # Constrained rows: their masks for this step, and the step runs eagerly (not a graph).
        self.masked = self._masks(rows)
        self._lora_step(rows)
        self._run(B, L, use_top_p)
        self.masked = None
        for _, s in rows:
            s.launched += 1
        h = self.host[self.launches % 2]
        self.launches += 1
        h.copy_(self.out, non_blocking=True)
        h_tok, h_lp = self._split_out(h, self.S)
        event = None
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
        return event, h_tok, h_lp, rows

    def _process(self, rec) -> None:
        event, h_tok, h_lp, rows = rec
        if event is not None:
            event.synchronize()
        toks, lps = h_tok.tolist(), h_lp.tolist()
        finished = []
        for slot, s in rows:
            if s.done:
                continue
            if self._append(s, toks[slot], lps[slot]):
                finished.append(s)
        self._finish(finished)

    # ---- finishing ----

    def _append(self, s: Sequence, tok: int, lp: float) -> bool:
        """Records a sampled token; True when the sample is finished."""
        if s.req.cancelled:
            s.done = True
            return True
        if not 0 <= tok < self.model.cfg.vocab_size and not self.bad_token:
            # The next step embeds it: on a GPU a device-side assertion that names no sample,
            # raised at a later synchronisation; this line comes before it.
            self.bad_token = True
            log.error("sample %d of request %r (row %d) drew token %d, outside the vocabulary "
                      "of %d, at response position %d", s.index, s.req.id, s.slot, tok,
                      self.model.cfg.vocab_size, len(s.tokens))
        s.tokens.append(tok)
        s.logprobs.append(lp)
        if s.cst is not None and tok not in self.eos:
            s.cst = s.cst.feed(s.req.matcher.texts[tok])
        if tok in self.eos:
            s.finish_reason = "stop"
            s.text = self.tokenizer.decode(s.tokens[:-1])
            return True
        if s.has_stop and self._hit_stop(s):
            return True
        if len(s.tokens) >= s.max_tokens:
            s.finish_reason = "length"
            s.text = self.tokenizer.decode(s.tokens)
            return True
        return False

    def _hit_stop(self, s: Sequence) -> bool:
        text = self.tokenizer.decode(s.tokens)
        stops = s.req.sampling.stop
        start = max(0, s.stop_scan - max(len(x) for x in stops))
        cut = min((i for i in (text.find(x, start) for x in stops if x) if i >= 0), default=-1)
        s.stop_scan = len(text)
        if cut < 0:
            return False
        s.text = text[:cut]
        s.finish_reason = "stop"
        return True

    def _finish(self, seqs: list[Sequence]) -> None:
        own = [s for s in seqs if s.slot >= 0 and self.slots[s.slot] is s]
        self._free([s.slot for s in own])
        if self.prefix.rows:
            self.prefix.keep([s for s in own if not s.req.cancelled
                              and s.weights == self.prefix.weights])
        for s in seqs:
            s.done = True
            if s.req.cancelled:
                continue
            s.req.on_completion(Completion(
                request_id=s.req.id, index=s.index, prompt_tokens=list(s.req.prompt),
                tokens=s.tokens, logprobs=s.logprobs, text=s.text,
                finish_reason=s.finish_reason))
