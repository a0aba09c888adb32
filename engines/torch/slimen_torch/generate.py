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

Prefix reuse (opt-in: `prefix_rows` > 0, the worker's --prefix-cache). A conversation sends each
turn as a new request whose prompt is the previous turn's prompt and sampled tokens followed by the
new messages, so most of its prefill would re-read what the cache had a moment ago. With prefix
reuse a finished sample's row is *kept* (up to prefix_rows of them, least recently used first out)
instead of freed at once: its token ids (prompt + sampled tokens but the last, whose key and value
were never computed) are what positions [0, n) of the row hold. An idle row still rides in decode
steps, writing at position 0 (reading one key: cheap); so when a row goes idle its position 0 is
saved (`_save_pos0`) and put back when the row is reused. `_place` is the one place that decides
reuse: a new request's prompt is compared with every kept row; the longest common prefix (at least
prefix_min tokens, at most the prompt's length - 1) wins, and the request's first sample takes that
row (or, when an earlier request of the same admission took it, gets a copy of the prefix in a row
of its own); its other samples get copies of the prompt after the prefill. A kept row is evicted
(least recently used, sparing rows that waiting prompts would reuse) only when a sample needs a
row and no row is free. A prompt with a cached
prefix is prefilled eagerly from its first new token (`_prefill_offsets`: positions start at the
prefix length, attention covers the cached keys), never by the bucketed CUDA-graph path of a lone
prompt; prompts without one are prefilled exactly as with reuse off. The engine drops every kept
row when the weights change (a training step, a load, an adapter change): `forget_prefixes`; under
LoRA adapters a row is reused only by requests of the adapter that computed it.
Reuse relaxes batch invariance: a suffix prefill is a different computation from a full one, so a
completion's floating-point values can depend on whether an earlier turn was still cached.
"""

from __future__ import annotations

import collections
import functools
import logging
import typing

import torch
import torch.nn.functional as F

from . import kernels, lora, sampling
from .model import (Transformer, block_forward, decode_layer, decode_post, decode_pre,
                    decode_step, decode_step_b1, decode_step_split, kv_bytes, kv_read, kv_source,
                    kv_write, mlp, project_qkv, rms_norm, whole_block)
from .types import Completion

log = logging.getLogger("slimen_torch")


class Request:
    """A generate request being served: its prompt, sampling settings and samples."""

    def __init__(self, rid, prompt, n, sampling_, on_completion, on_error=None):
        self.id = rid
        self.prompt = prompt
        self.n = n
        self.sampling = sampling_
        self.on_completion = on_completion  # called with each finished Completion
        self.on_error = on_error  # called with (code, message) if the request fails
        self.cancelled = False
        self.adapter = None  # the lora.Adapter that generates it; None: the base
        self.matcher = None  # its constraint's constrain.Matcher; None: none


class Sequence:
    """One sample of a request."""

    __slots__ = ("req", "index", "max_tokens", "key", "tokens", "logprobs", "slot", "launched",
                 "done", "finish_reason", "text", "stop_scan", "has_stop", "weights", "cst")

    def __init__(self, req: Request, index: int, max_tokens: int):
        self.req = req
        self.index = index
        self.max_tokens = max_tokens
        self.key = sampling.row_key(req.sampling.seed, index)
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.slot = -1
        self.launched = 0  # tokens whose sampling has been launched (prefill counts one)
        self.done = False
        self.finish_reason = ""
        self.text = ""
        self.stop_scan = 0  # text length already searched for stop strings
        self.has_stop = bool(req.sampling.stop)
        self.weights = 0  # Generator.weights when it was admitted
        # Where the response is in its constraint (constrain.State); None: unconstrained.
        self.cst = req.matcher.g.start() if req.matcher is not None else None


class Placed(typing.NamedTuple):
    """A sample admitted into its row (seq.slot): prefilled from prompt token `start` on (0: the
    whole prompt). A lead (lead is seq, the request's first sample placed in this admission) with
    start > 0 finds tokens [0, start) in row src (its own row, or one copied from first); another
    sample (a follower) gets a copy of its lead's row after the lead's prefill."""

    seq: Sequence
    start: int
    src: int
    lead: Sequence


def _bucket(n: int, cap: int, sizes) -> int:
    for s in sizes:
        if s >= n:
            return min(s, cap)
    return cap


def compiled_prefill_layer(cfg):
    """The prefill's layer compiled (dynamic shapes), traced whole (model.whole_block)."""
    return torch.compile(whole_block(cfg), dynamic=True)


def _prompt_key(req: Request) -> tuple:
    """Requests of one key hold the same prompt keys and values: the prompt and the adapter."""
    return tuple(req.prompt), id(req.adapter)


def _padded(rows: list[list[int]], T: int) -> torch.Tensor:
    """Token lists right-padded with 0 to T, as one [len(rows), T] tensor made by one call (a
    torch.tensor a prompt took 35 ms of host time for 256 prompts on the H200's machine)."""
    return torch.tensor([r + [0] * (T - len(r)) for r in rows], dtype=torch.long)


SHARE_GROUP = 8  # rows a shared-prompt group holds at most (its queries: one product's rows)


class Generator:
    """Owns the KV cache and the decode graphs; driven by one thread (engine.Worker)."""

    def __init__(self, model: Transformer, tokenizer, eos: list[int], *, slots: int, max_len: int,
                 cuda_graphs: bool, compile_layers: bool, prefill_tokens: int,
                 compile_prefill: bool = False,
                 length_bucket: int = 64, triton: bool = False, fused_b1: bool = False,
                 prefill_graph_max: int = 0, prefix_rows: int = 0, prefix_min: int = 16,
                 kv_dtype: torch.dtype | None = None, shared_prompts: bool = False):
        self.model = model
        # The cache's storage dtype: the model's, or float8_e4m3fn (engine.Options.kv_cache_dtype
        # "fp8"): every write casts with saturation (model.kv_store), every read converts back
        # to the model's dtype (model.kv_read; the Triton kernel converts to fp16, exactly).
        self.kv_dtype = kv_dtype or model.embed.dtype
        self.tokenizer = tokenizer
        self.eos = set(eos)
        self.S, self.L = slots, max_len
        self.device = model.embed.device
        self.cuda = self.device.type == "cuda"
        self.use_graphs = cuda_graphs and self.cuda
        self.prefill_tokens = prefill_tokens
        self.length_bucket = length_bucket
        self.layer_fn = decode_layer
        self.compile_error = ""
        self.kernel_error = ""
        # With Triton (kernels.py): attention and sampling in Triton kernels, each layer split
        # around the attention into decode_pre and decode_post (compiled); at batch 1 optionally
        # the whole step in Triton kernels (decode_step_b1).
        self.triton = triton and kernels.available(self.device)
        self.fused_b1 = fused_b1 and self.triton
        self.pre_fn, self.post_fn = decode_pre, decode_post
        if compile_layers:
            # One compiled function serves every layer: the layer's weights are arguments. Shapes
            # are dynamic so that new (rows, length) buckets do not recompile.
            if self.triton:
                self.pre_fn = torch.compile(decode_pre, fullgraph=True, dynamic=True)
                self.post_fn = torch.compile(decode_post, fullgraph=True, dynamic=True)
            else:
                self.layer_fn = torch.compile(decode_layer, fullgraph=True, dynamic=True)
        # The prefill's layer, compiled with compile_prefill (the engine's GPU default): its
        # norms, rope and residual adds fuse into a few kernels (eagerly a layer is ~60 kernels,
        # which bound a lone prompt's graph-captured prefill), at the price of compiling it on
        # first use (once for a lone prompt, again for a batch). The same arithmetic in another
        # summation order, so its keys and values can differ from Score's forward pass in the
        # last bits; scoring and training keep their own layer functions.
        self.prefill_fn = block_forward
        if compile_prefill:
            self.prefill_fn = compiled_prefill_layer(model.cfg)
        self.k = self.v = None  # per layer [slots, kv_heads, max_len, head_dim], on first use
        # A lone prompt of at most prefill_graph_max tokens is prefilled padded to a multiple of
        # length_bucket, by a CUDA graph per bucket (_prefill_bucketed); 0: always eagerly.
        self.prefill_graph_max = min(prefill_graph_max, max_len)
        self.pf_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pf_buf = self.pf_host = self.pf_logits = None
        self.prefill_error = ""
        # The first token of a prompt is drawn by the Triton sampler when the decode steps' is.
        self.first_token_triton = True
        long = dict(dtype=torch.long, device=self.device)
        f32 = dict(dtype=torch.float32, device=self.device)
        S = slots
        # Device-side step state, one entry per cache row (see the module comment).
        self.tok, self.pos, self.step_idx, self.key = (torch.zeros(S, **long) for _ in range(4))
        self.temp, self.top_p = torch.zeros(S, **f32), torch.ones(S, **f32)
        self.active = torch.zeros(S, dtype=torch.bool, device=self.device)
        # A step's sampled tokens (int64) and log-probs (fp32) side by side in one buffer of
        # 32-bit words, so that one copy a step brings both to the host (two copies cost the
        # batch-1 step ~1% on the H200).
        self.out = torch.zeros(3 * S, dtype=torch.int32, device=self.device)
        self.out_tok, self.out_lp = self._split_out(self.out, S)
        self.masked = None  # the constrained rows of the step being run (_masks)
        pin = self.cuda
        self.host = [torch.zeros(3 * S, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.slots: list[Sequence | None] = [None] * S
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.inflight = None
        self.launches = 0
        self.batch_sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
        # The worker's LoRA adapters (lora.Bank), set by the engine. While it holds any, every
        # pass runs eagerly with each row's adapter (lora.Rows): no CUDA graphs, compiled
        # layers or Triton layer kernels, which were traced without adapters.
        self.bank = None
        # Prefix reuse (see the module comment): kept rows, least recently used first, and the
        # token ids each row holds (-1 past them, and everywhere in rows that are not kept).
        self.prefix_rows = min(max(prefix_rows, 0), slots)
        self.prefix_min = max(prefix_min, 1)
        self.kept: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.kept_adapter: list = [None] * slots  # the LoRA adapter that computed a row's keys
        # An index of the kept rows by their leading blocks of prefix_min tokens: a chain hash of
        # blocks 1..k → the rows whose first k blocks hash so (_match compares only those rows).
        self.by_hash: dict[int, set[int]] = {}
        self.row_hashes: list[list[int]] = [[] for _ in range(slots)]
        self.kept_tokens = torch.full((slots, max_len), -1, dtype=torch.int32) \
            if self.prefix_rows else None
        # Position 0 of each layer's keys and values of rows gone idle (the decode steps an idle
        # row rides in overwrite it), on first use: [slots, kv_heads, head_dim] a layer.
        self.k0 = self.v0 = None
        self.saved0 = [False] * slots  # the row's position 0 is in k0/v0
        self.prefix_stats = dict(prompts=0, hits=0, prompt_tokens=0, reused_tokens=0, evicted=0)
        # Counts forget_prefixes calls: a sample admitted before the weights changed finishes
        # with keys and values partly of the old weights, so its row is not kept.
        self.weights = 0
        self.offset_scores = 1 << 28  # one offset-prefill chunk's attention scores, at most
        # Shared prompts (kernels.decode_attention's shared): the samples of a request admitted
        # together hold the same prompt keys and values, so the batched Triton attention reads
        # them once, from a lead row, for groups of up to SHARE_GROUP rows. grp[lead] lists a
        # group's rows (-1 past them), plen[row] its shared length (0: in no group); the host's
        # copies change when a group forms (_admit) or a row leaves it (_ungroup: a leaving lead
        # hands the group to a member, whose own copy of the prompt is the same).
        self.share = shared_prompts and self.triton
        self.lead = [-1] * slots
        self.n_grouped = 0  # rows in a group: none, and the steps run without the shared pass
        self.grp_host = torch.full((slots, SHARE_GROUP), -1, dtype=torch.long)
        self.plen_host = torch.zeros(slots, dtype=torch.long)
        self.grp, self.plen = self.grp_host.to(self.device), self.plen_host.to(self.device)

    @staticmethod
    def _split_out(buf: torch.Tensor, S: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [S] int64, log-probs [S] fp32): views of a step's output words."""
        return buf[:2 * S].view(torch.int64), buf[2 * S:].view(torch.float32)

    def _lora(self) -> bool:
        return self.bank is not None and bool(self.bank.adapters)

    def _rows(self, adapters) -> "lora.Rows":
        return self.bank.rows(adapters, self.device)

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
        self._free([i for i, s in enumerate(self.slots) if s is not None])
        self.forget_prefixes()
        for r in reqs.values():
            if not r.cancelled and r.on_error is not None:
                r.cancelled = True
                r.on_error("INTERNAL", message)

    def _graph_pool(self):
        """The memory pool the graphs share: a new one when no captured graph holds the last
        (after the graphs were dropped, e.g. the Triton kernels' fallback). Reopening a pool all
        of whose graphs were destroyed trips an internal assert of PyTorch's allocator
        ("use_count > 0"), failing the capture."""
        if self.pool is None or not (self.graphs or self.pf_graphs):
            self.pool = torch.cuda.graph_pool_handle()
        return self.pool

    def forget_prefixes(self) -> int:
        """Drops every kept row (the weights changed: their keys and values are stale); returns
        how many there were."""
        n = len(self.kept)
        self.weights += 1
        self.kept.clear()
        self.kept_adapter = [None] * self.S
        self.by_hash.clear()
        self.row_hashes = [[] for _ in range(self.S)]
        if self.kept_tokens is not None:
            self.kept_tokens.fill_(-1)
        return n

    def take_prefix_stats(self) -> dict:
        """The prefix-reuse counters since the last call, and zeroes them."""
        out = dict(self.prefix_stats, kept=len(self.kept))
        self.prefix_stats = dict.fromkeys(self.prefix_stats, 0)
        return out

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
        self._ungroup(slots)
        for slot in slots:
            self.slots[slot] = None
        idx = torch.tensor(slots, device=self.device)
        self.active[idx] = False
        if self.prefix_rows:
            self._save_pos0(slots)
        self.pos[idx] = 0  # an idle row keeps writing at position 0, inside every length bucket

    def _group(self, keyed: list[tuple[Sequence, tuple]]) -> None:
        """Groups samples just admitted whose rows hold copies of one prompt's keys and values
        (the same key) for the shared-prompt attention, SHARE_GROUP rows a group at most."""
        by_req: dict[tuple, list[Sequence]] = {}
        for s, key in keyed:
            by_req.setdefault(key, []).append(s)
        changed = False
        for same in by_req.values():
            for i in range(0, len(same) - 1, SHARE_GROUP):
                rows = [s.slot for s in same[i:i + SHARE_GROUP]]
                if len(rows) < 2:
                    continue
                for r in rows:
                    self.lead[r] = rows[0]
                self.n_grouped += len(rows)
                self.grp_host[rows[0], :len(rows)] = torch.tensor(rows)
                self.plen_host[rows] = len(same[0].req.prompt)
                changed = True
        if changed:
            self._sync_groups()

    def _ungroup(self, rows: list[int]) -> None:
        """Takes rows out of their groups (they finish, stop or go idle, and an idle row
        overwrites its position 0): a group whose lead leaves passes to its first other member;
        a group left with one row ends."""
        changed = False
        for r in rows:
            lead = self.lead[r]
            if lead < 0:
                continue
            members = [m for m in self.grp_host[lead].tolist() if m >= 0 and m != r]
            self.grp_host[lead] = -1
            self.lead[r], self.plen_host[r] = -1, 0
            self.n_grouped -= 1
            if len(members) >= 2:
                for m in members:
                    self.lead[m] = members[0]
                self.grp_host[members[0], :len(members)] = torch.tensor(members)
            else:
                for m in members:
                    self.lead[m], self.plen_host[m] = -1, 0
                self.n_grouped -= len(members)
            changed = True
        if changed:
            self._sync_groups()

    def _sync_groups(self) -> None:
        # In stream order: a step already launched keeps the groups it was launched with.
        self.grp.copy_(self.grp_host)
        self.plen.copy_(self.plen_host)

    def _keep(self, seqs: list[Sequence]) -> None:
        """Keeps the rows of finished samples for prefix reuse (their slots were just freed)."""
        for s in seqs:
            ids = s.req.prompt + s.tokens[:-1]
            self.kept_tokens[s.slot, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
            self.kept_adapter[s.slot] = s.req.adapter
            self.row_hashes[s.slot] = hs = list(self._block_hashes(ids, len(ids)))
            for h in hs:
                self.by_hash.setdefault(h, set()).add(s.slot)
            self.kept[s.slot] = None
            self.kept.move_to_end(s.slot)
        while len(self.kept) > self.prefix_rows:
            self._evict(next(iter(self.kept)))

    def _save_pos0(self, rows: list[int]) -> None:
        """Saves position 0 of rows about to go idle (not already saved)."""
        rows = [r for r in rows if not self.saved0[r]]
        if not rows:
            return
        # (An fp8 cache's bytes: these are copies, and not every index kernel takes float8.)
        ks, vs = [kv_bytes(t) for t in self.k], [kv_bytes(t) for t in self.v]
        if self.k0 is None:
            self.k0 = [kc[:, :, 0].clone() for kc in ks]
            self.v0 = [vc[:, :, 0].clone() for vc in vs]
        idx = torch.tensor(rows, device=self.device)
        for kc, vc, k0, v0 in zip(ks, vs, self.k0, self.v0):
            k0[idx] = kc[idx, :, 0]
            v0[idx] = vc[idx, :, 0]
        for r in rows:
            self.saved0[r] = True

    def _restore_pos0(self, rows: list[int]) -> None:
        """Puts position 0 of idle rows back (before their prefix is read)."""
        idx = torch.tensor(rows, device=self.device)
        for kc, vc, k0, v0 in zip(map(kv_bytes, self.k), map(kv_bytes, self.v), self.k0, self.v0):
            kc[idx, :, 0] = k0[idx]
            vc[idx, :, 0] = v0[idx]

    def _evict(self, row: int) -> None:
        del self.kept[row]
        self._unindex(row)
        self.prefix_stats["evicted"] += 1

    def _unindex(self, row: int) -> None:
        self.kept_tokens[row].fill_(-1)
        for h in self.row_hashes[row]:
            rows = self.by_hash[h]
            rows.discard(row)
            if not rows:
                del self.by_hash[h]
        self.row_hashes[row] = []

    def _block_hashes(self, ids: list[int], n: int):
        """The chain hashes of the whole blocks of prefix_min tokens in ids[:n]."""
        B, h = self.prefix_min, 0
        for k in range(n // B):
            h = hash((h, tuple(ids[k * B:(k + 1) * B])))
            yield h

    # ---- prefill ----

    @torch.no_grad()
    def _admit(self) -> None:
        if not self.waiting:
            return
        placed = self._place()
        if not placed:
            return
        picked = [p.seq for p in placed]
        self._ensure_cache()
        for s in picked:
            self.slots[s.slot] = s
        n = len(picked)
        # The samples' rows, prompt lengths and keys, and their sampling settings: one copy each.
        meta = torch.tensor([[s.slot for s in picked], [len(s.req.prompt) for s in picked],
                             [s.key for s in picked]], dtype=torch.long).to(self.device)
        fmeta = torch.tensor([[s.req.sampling.temperature for s in picked],
                              [s.req.sampling.top_p for s in picked]],
                             dtype=torch.float32).to(self.device)
        dst, plen, key = meta
        temp, top_p = fmeta
        plain = [i for i, p in enumerate(placed) if not p.start]
        cached = [i for i, p in enumerate(placed) if p.start]
        logits = self._prefill_plain([picked[i] for i in plain])
        if cached:
            rest = self._prefill_from([placed[i] for i in cached])
            if logits is None:
                logits = rest
            else:
                both = torch.empty(n, rest.shape[1], dtype=rest.dtype, device=self.device)
                both[torch.tensor(plain, device=self.device)] = logits
                both[torch.tensor(cached, device=self.device)] = rest
                logits = both
        use_top_p = any(s.req.sampling.top_p < 1 for s in picked)
        zeros = torch.zeros(n, dtype=torch.long, device=self.device)
        if self.triton and self.first_token_triton:
            # The decode steps' sampler (two kernels) with step index 0: the same draws.
            tok, lp = kernels.sample_and_advance(logits, temp, key, zeros)
            if use_top_p:
                tok, lp = self._with_top_p(logits, temp, top_p, sampling.uniform(key, zeros),
                                           tok, lp)
        else:
            tok, lp = sampling.sample(logits.float(), temp, top_p, sampling.uniform(key, zeros),
                                      use_top_p)
        masked = self._masks(list(enumerate(picked)))
        if masked is not None:
            tok, lp = self._constrained(logits, temp, top_p, sampling.uniform(key, zeros), tok, lp,
                                        masked)
        self.tok.index_copy_(0, dst, tok)
        self.pos.index_copy_(0, dst, plen)
        self.step_idx.index_fill_(0, dst, 1)
        self.key.index_copy_(0, dst, key)
        self.temp.index_copy_(0, dst, temp)
        self.top_p.index_copy_(0, dst, top_p)
        self.active.index_fill_(0, dst, True)
        if self.share:
            # Rows of one plain prefill of a prompt are copies of it, whatever their request; a
            # request's samples placed with a prefix start are copies of their lead's row.
            self._group([(picked[i], ("prompt",) + _prompt_key(picked[i].req)) for i in plain] +
                        [(picked[i], ("request", id(picked[i].req))) for i in cached])
        tok_l, lp_l = tok.tolist(), lp.tolist()
        finished = []
        for s, t, l in zip(picked, tok_l, lp_l):
            s.launched = 1
            if self._append(s, t, l):
                finished.append(s)
        self._finish(finished)

    def _place(self) -> list[Placed]:
        """Takes the waiting samples admitted now off the queue and gives each a cache row
        (s.slot). The one place that decides prefix reuse (see the module comment): the first
        sample of a request whose prompt shares at least prefix_min tokens with a kept row starts
        there, taking the row over or (when the row is pinned by another sample of this
        admission) copying its prefix; the request's other samples follow it (copies after its
        prefill)."""
        free = [i for i, s in enumerate(self.slots) if s is None and i not in self.kept]
        free.reverse()  # pop() takes the lowest row
        reusing = bool(self.prefix_rows) and bool(self.kept)
        pinned: set[int] = set()  # rows a sample of this admission takes or copies a prefix from
        taken: list[int] = []  # kept rows taken over by a sample of this admission
        placed: list[Placed] = []
        leads: dict[int, Placed] = {}  # id(request) -> its first sample placed now
        queue, self.waiting = list(self.waiting), collections.deque()
        # Under slot pressure, the kept rows that waiting prompts would reuse are evicted last;
        # a prompt that would have to evict one is passed over (it waits for a row that frees).
        wanted = self._wanted(queue) if reusing and len(queue) > len(free) else set()
        passed: set[int] = set()  # id() of the requests passed over
        budget = 0
        st = self.prefix_stats

        def row(spare_wanted: bool) -> int:
            """A row for a sample: a free one, else the least recently used kept one that is not
            pinned (and not wanted, with spare_wanted); -1 if none."""
            if free:
                return free.pop()
            spare = pinned | wanted if spare_wanted else pinned
            old = next((r for r in self.kept if r not in spare), -1)
            if old >= 0:
                self._evict(old)
            return old

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
                start, src = self._match(s.req, pinned) if reusing else (0, -1)
                cost = len(s.req.prompt) - start
                if leads and budget + cost > self.prefill_tokens:
                    self.waiting.extend(queue[i:])
                    break
                if src >= 0 and src in self.kept and src not in pinned:
                    slot = src  # the sample takes the kept row over
                    del self.kept[src]
                    taken.append(src)
                    # Its prefix stays valid (for copies) until the prefill writes past it.
                    self.kept_tokens[src, start:].fill_(-1)
                else:
                    slot = row(True)
                    if slot < 0:
                        if any(r not in pinned for r in self.kept):  # only wanted rows left
                            passed.add(id(s.req))
                            self.waiting.append(s)
                            continue
                        self.waiting.extend(queue[i:])
                        break
                    if src >= 0:
                        pinned.add(src)
                        if src in self.kept:
                            self.kept.move_to_end(src)
                budget += cost
                p = Placed(s, start, src, s)
                leads[id(s.req)] = p
                st["prompts"] += 1
                st["prompt_tokens"] += len(s.req.prompt)
                if start:
                    st["hits"] += 1
                    st["reused_tokens"] += start
            pinned.add(slot)
            s.slot = slot
            s.weights = self.weights
            self.saved0[slot] = False
            placed.append(p)
        for r in taken:
            self._unindex(r)
        return placed

    def _wanted(self, queue: list[Sequence]) -> set[int]:
        """The kept rows the prompts of the first waiting requests (twice as many as there are
        rows) would reuse."""
        out, seen = set(), set()
        for s in queue:
            if len(seen) >= 2 * self.S:
                break
            if id(s.req) not in seen:
                seen.add(id(s.req))
                _, src = self._match(s.req, set())
                if src >= 0:
                    out.add(src)
        return out

    def _match(self, req: Request, pinned: set[int]) -> tuple[int, int]:
        """(length, row) of the longest prefix of req's prompt a kept row of the same adapter
        holds (a row taken over in this admission holds its new sample's start), at most the
        prompt's length - 1 tokens and at least prefix_min; (0, -1) when none. Ties go to a row
        not pinned, then to the lowest."""
        prompt = req.prompt
        n = min(len(prompt), self.L) - 1
        rows: set[int] = set()
        for h in self._block_hashes(prompt, n):  # the rows sharing the most leading blocks
            deeper = self.by_hash.get(h)
            if not deeper:
                break
            rows = deeper
        rows = sorted(r for r in rows if self.kept_adapter[r] is req.adapter)
        if not rows:
            return 0, -1
        # Exact from here (a hash may collide; a row taken over holds only its new start).
        p = torch.tensor(prompt[:n], dtype=torch.int32)
        differ = self.kept_tokens[rows, :n] != p  # -1 past a row's tokens: never equal
        lcp = torch.where(differ.any(1), differ.int().argmax(1), n)
        score = lcp * 2 + torch.tensor([r not in pinned for r in rows])
        i = int(score.argmax())
        length = int(lcp[i])
        return (length, rows[i]) if length >= self.prefix_min else (0, -1)

    def _prefill_plain(self, picked: list[Sequence]):
        """The prompts of samples placed with start 0, as with prefix reuse off: one prompt by the
        bucketed path when it can, else eagerly. Logits [len(picked), vocab] or None if none."""
        if not picked:
            return None
        # Requests with the same prompt (and adapter) are prefilled once: GRPO's groups sent as
        # one request with n samples, or as n requests (n_samples_per_prompt).
        keys = [_prompt_key(s.req) for s in picked]
        reqs: dict[tuple, Request] = {}  # _prompt_key -> its first request, in prefill order
        for key, s in zip(keys, picked):
            reqs.setdefault(key, s.req)
        n = len(picked)
        dst = torch.tensor([s.slot for s in picked], device=self.device)
        if len(reqs) == 1 and not self._lora():
            # One prompt (the batch-1 case): the bucketed, graph-captured prefill into the first
            # sample's row; the other samples' rows get copies.
            logits = self._prefill_bucketed(picked[0].req.prompt, picked[0].slot)
            if logits is not None:
                if n > 1:
                    self._copy_rows(dst[:1], dst[1:], len(picked[0].req.prompt))
                    logits = logits.expand(n, -1).contiguous()
                return logits
        row = {key: i for i, key in enumerate(reqs)}
        src_list = [row[key] for key in keys]
        own = src_list == list(range(n))  # every sample has its own prompt: no gather
        slots = [s.slot for s in picked]
        if slots == list(range(slots[0], slots[0] + n)):
            dst = slice(slots[0], slots[0] + n)  # consecutive rows: a strided copy, not an index
        logits = self._prefill_eager([r.prompt for r in reqs.values()],
                                     None if own else torch.tensor(src_list, device=self.device),
                                     dst, [r.adapter for r in reqs.values()])
        return logits if own else logits[src_list]

    def _prefill_from(self, placed: list[Placed]) -> torch.Tensor:
        """Samples placed with a prefix start: the source rows' prefixes copied into the leads'
        rows, the leads' prompts prefilled from their starts (in chunks), the prompts copied into
        the followers' rows. Returns each sample's last logits [len(placed), vocab]."""
        leads = [p for p in placed if p.lead is p.seq]
        self._restore_pos0(sorted({p.src for p in leads}))
        for p in leads:
            if p.src != p.seq.slot:
                self._copy_rows(torch.tensor([p.src], device=self.device),
                                torch.tensor([p.seq.slot], device=self.device), p.start)
        # Chunks whose attention scores (rows × new tokens × attended positions × heads) stay
        # within offset_scores elements: the math attention kernel materialises them.
        parts, chunk, size = [], [], (0, 0)
        heads = self.model.cfg.heads
        for p in leads:
            plen = len(p.seq.req.prompt)
            new = (max(size[0], plen - p.start), max(size[1], plen))
            if chunk and (len(chunk) + 1) * new[0] * new[1] * heads > self.offset_scores:
                parts.append(self._prefill_offsets(chunk))
                chunk, new = [], (plen - p.start, plen)
            chunk.append(p)
            size = new
        parts.append(self._prefill_offsets(chunk))
        logits = torch.cat(parts)
        index = {id(p.seq): i for i, p in enumerate(leads)}
        for p in placed:
            if p.lead is not p.seq:
                self._copy_rows(torch.tensor([p.lead.slot], device=self.device),
                                torch.tensor([p.seq.slot], device=self.device),
                                len(p.seq.req.prompt))
        return logits[torch.tensor([index[id(p.lead)] for p in placed], device=self.device)]

    @torch.no_grad()
    def _prefill_offsets(self, leads: list[Placed]) -> torch.Tensor:
        """Each lead's prompt i from token starts[i] on into its cache row, whose positions
        [0, starts[i]) already hold the keys and values of its first starts[i] tokens: the new
        tokens sit at positions starts[i] + t (rope), attend over the row's cached positions and
        causally over each other, and their keys and values are written after the prefix. The
        batch is right-padded; padding positions past a prompt hold the padding's keys (no decode
        step reads them before overwriting), clamped to max_len - 1. Returns the logits of each
        prompt's last token [len(leads), vocab] in the model's dtype."""
        m, cfg = self.model, self.model.cfg
        prompts = [p.seq.req.prompt for p in leads]
        starts = [p.start for p in leads]
        rows = [p.seq.slot for p in leads]
        B = len(prompts)
        T = max(len(p) - s for p, s in zip(prompts, starts))
        tokens = _padded([p[s:] for p, s in zip(prompts, starts)], T).to(self.device)
        start = torch.tensor(starts, device=self.device)
        pos = (start[:, None] + torch.arange(T, device=self.device)).clamp(max=self.L - 1)
        Lk = min(max(starts) + T, self.L)  # attended positions [0, Lk)
        mask = (torch.arange(Lk, device=self.device)[None, None, :] <= pos[:, :, None])[:, None]
        row = torch.tensor(rows, device=self.device)
        x = F.embedding(tokens, m.embed)
        cos, sin = m.cos[pos], m.sin[pos]  # [B, T, D]
        adapters = [p.seq.req.adapter for p in leads]
        with m.using(self._rows(adapters) if self._lora() else None):
            for i, (kc, vc) in enumerate(zip(self.k, self.v)):
                w = m.layer_weights(i)
                q, k, v = project_qkv(cfg, w, x, cos, sin)  # [B, T, heads, D]
                kv_write(kc, (row[:, None], slice(None), pos), k)
                kv_write(vc, (row[:, None], slice(None), pos), v)
                # The prompt's new tokens attend to their own keys as the cache holds them
                # (rounded to fp8 with an fp8 cache), as the decode steps will.
                keys = kv_read(kc, (row, slice(None), slice(None, Lk)), x.dtype)
                values = kv_read(vc, (row, slice(None), slice(None, Lk)), x.dtype)
                o = F.scaled_dot_product_attention(
                    q.transpose(1, 2), keys, values, attn_mask=mask,
                    scale=cfg.head_dim ** -0.5, enable_gqa=cfg.heads != cfg.kv_heads)
                x = x + lora.linear(o.transpose(1, 2).flatten(2), w[5], w[6])
                x = x + mlp(cfg, w, x)
        last = torch.tensor([len(p) - s - 1 for p, s in zip(prompts, starts)], device=self.device)
        h = rms_norm(x[torch.arange(B, device=self.device), last], m.norm, cfg.rms_eps)
        return m.logits(h)


    @torch.no_grad()
    def _prefill_eager(self, prompts: list[list[int]], src, dst, adapters=None) -> torch.Tensor:
        """The prompts (right-padded into one batch) through Transformer.forward; every sample
        row dst[i] (dst: an index tensor or a slice) gets the keys and values of prompt src[i]
        (src None: of prompt i, without gathering them). Returns the logits of each prompt's
        last token [len(prompts), vocab] in the model's dtype."""
        T = max(len(p) for p in prompts)
        tokens = _padded(prompts, T).to(self.device)

        def sink(layer, k, v):
            # Every sample of a prompt gets a copy of the prompt's keys and values.
            kv_write(self.k[layer], (dst, slice(None), slice(None, T)),
                     k if src is None else k[src])
            kv_write(self.v[layer], (dst, slice(None), slice(None, T)),
                     v if src is None else v[src])

        with self.model.using(self._rows(adapters) if adapters and self._lora() else None):
            hidden = self._uncompiling(lambda: self.model(tokens, kv_sink=sink,
                                                          block_fn=self.prefill_fn))
        last = torch.tensor([len(p) - 1 for p in prompts], device=self.device)
        return self.model.logits(hidden[torch.arange(len(prompts), device=self.device), last])

    def _copy_rows(self, src, dst, T: int) -> None:
        """The first T positions of cache row src [1] into the rows dst [m]."""
        for kc, vc in zip(map(kv_bytes, self.k), map(kv_bytes, self.v)):
            kc[dst, :, :T] = kc[src, :, :T]
            vc[dst, :, :T] = vc[src, :, :T]

    # ---- bucketed prefill (one prompt, CUDA graphs) ----

    def _prefill_bucket(self, T: int) -> int:
        """The padded length a prompt of T tokens is prefilled at; 0: too long for the path."""
        if T > self.prefill_graph_max:
            return 0
        return min(-(-T // self.length_bucket) * self.length_bucket, self.L)

    @torch.no_grad()
    def _prefill_bucketed(self, prompt: list[int], slot: int):
        """One prompt into cache row slot, padded to a length bucket, replaying the bucket's CUDA
        graph (captured on first use; on the CPU the same code runs directly). Returns the last
        token's logits [1, vocab] (a buffer the next call overwrites), or None when the prompt is
        too long for the path or the path failed (it is then switched off; the caller prefills
        eagerly)."""
        Tb = self._prefill_bucket(len(prompt))
        if not Tb:
            return None
        P = self.L  # room for any prompt, whatever prefill_graph_max is set to later
        if self.pf_buf is None:
            # Inputs: the padded tokens, then (at P) the last token's index and the cache row.
            self.pf_host = torch.zeros(P + 2, dtype=torch.long, pin_memory=self.cuda)
            self.pf_buf = torch.zeros(P + 2, dtype=torch.long, device=self.device)
            self.pf_logits = torch.empty(1, self.model.cfg.vocab_size, dtype=self.model.embed.dtype,
                                         device=self.device)
        # The previous prefill's copy is done: its first token was read back (a sync) since.
        h = self.pf_host
        h[:len(prompt)] = torch.tensor(prompt)
        h[P] = len(prompt) - 1
        h[P + 1] = slot
        self.pf_buf.copy_(h, non_blocking=True)
        try:
            if self.use_graphs:
                g = self.pf_graphs.get(Tb)
                if g is None:
                    g = self._uncompiling(lambda: self._capture_prefill(Tb))
                    self.pf_graphs[Tb] = g
                g.replay()
            else:
                self._uncompiling(lambda: self._prefill_static(Tb))
            return self.pf_logits
        except Exception as e:  # costs speed, not service
            log.warning("the bucketed prefill failed, prefilling eagerly from now on: %s", e)
            self.prefill_error = f"{type(e).__name__}: {e}"
            self.pf_graphs.clear()
            self.prefill_graph_max = 0
            return None

    def _uncompiling(self, fn):
        """fn(); after a failure with the compiled prefill layer, fn() again with the eager one
        (a compiler failure costs speed, not service)."""
        try:
            return fn()
        except Exception as e:
            if self.prefill_fn is block_forward:
                raise
            log.warning("torch.compile of the prefill layer failed, running it eagerly: %s", e)
            self.compile_error = f"prefill: {type(e).__name__}: {e}"
            self.prefill_fn = block_forward
            return fn()

    def _prefill_static(self, Tb: int) -> None:
        """What a prefill graph captures: the prompt in pf_buf padded to Tb tokens through every
        layer, its keys and values written into cache row pf_buf[L + 1] (positions [0, Tb); those
        past the prompt hold the padding's, which no decode step reads before overwriting them),
        the last token's logits into pf_logits. Causal attention keeps the padding from reaching
        the prompt's tokens."""
        m, cfg, P = self.model, self.model.cfg, self.L
        tokens = self.pf_buf[:Tb].view(1, Tb)
        last, row = self.pf_buf[P:P + 1], self.pf_buf[P + 1:P + 2]
        x = F.embedding(tokens, m.embed)
        cos, sin = m.cos[:Tb], m.sin[:Tb]
        for layer, kc, vc in zip(m.layers, self.k, self.v):
            x, k, v = self.prefill_fn(cfg, x, layer.weights(), cos, sin)
            # (index_copy_ takes no float8 on the CPU: an fp8 cache is written as its bytes.)
            kv_bytes(kc)[:, :, :Tb].index_copy_(0, row, kv_source(k, kc))
            kv_bytes(vc)[:, :, :Tb].index_copy_(0, row, kv_source(v, vc))
        h = rms_norm(x[0].index_select(0, last), m.norm, cfg.rms_eps)
        self.pf_logits.copy_(m.logits(h))

    def _capture_prefill(self, Tb: int) -> torch.cuda.CUDAGraph:
        # A warm-up run outside the capture (it initialises the libraries, and computes what the
        # replay computes again), then the capture, as _capture does for the decode steps.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._prefill_static(Tb)
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._graph_pool(), capture_error_mode="thread_local"):
            self._prefill_static(Tb)
        log.info("captured prefill graph length=%d", Tb)
        return g

    # ---- decode ----

    def _decode(self, B: int, L: int, use_top_p: bool, grouped: bool = False) -> None:
        """One decode step on rows [0, B) over positions [0, L): what a CUDA graph captures;
        grouped: with the shared-prompt pass of the batched attention (some rows are grouped)."""
        pos = self.pos[:B]
        if self._lora():
            with self.model.using(self._rows([s.req.adapter if s is not None else None
                                              for s in self.slots[:B]])):
                hidden = decode_step(self.model, decode_layer, self.tok[:B], pos, self.k, self.v, L)
            logits = self.model.logits(hidden)
        elif self.fused_b1 and B == 1:
            logits = decode_step_b1(self.model, kernels, self.tok[:B], pos, self.k, self.v, L)
        else:
            if self.triton:
                attn = kernels.decode_attention
                if grouped:
                    attn = functools.partial(attn, shared=(self.grp[:B], self.plen[:B]))
                hidden = decode_step_split(self.model, self.pre_fn, self.post_fn, attn,
                                           self.tok[:B], pos, self.k, self.v, L)
            else:
                hidden = decode_step(self.model, self.layer_fn, self.tok[:B], pos, self.k,
                                     self.v, L)
            logits = self.model.logits(hidden)
        if self.triton and not use_top_p and self.masked is None:
            # Sampling, log-probs and the step state in two kernels, reading the logits once.
            kernels.sample_and_advance(logits, self.temp, self.key, self.step_idx, self.active,
                                       self.pos, self.tok, self.out_tok, self.out_lp,
                                       max_pos=self.L - 1)
            return
        u = sampling.uniform(self.key[:B], self.step_idx[:B])
        if self.triton:
            tok, lp = kernels.sample_and_advance(logits, self.temp, self.key, self.step_idx)
            tok, lp = self._with_top_p(logits, self.temp[:B], self.top_p[:B], u, tok, lp)
        else:
            tok, lp = sampling.sample(logits.float(), self.temp[:B], self.top_p[:B], u, use_top_p)
        if self.masked is not None:
            tok, lp = self._constrained(logits, self.temp[:B], self.top_p[:B], u, tok, lp, self.masked)
        self.out_tok[:B].copy_(tok)
        self.out_lp[:B].copy_(lp)
        act = self.active[:B]
        self.tok[:B].copy_(tok)
        self.pos[:B].copy_(torch.where(act, (pos + 1).clamp(max=self.L - 1), pos))
        self.step_idx[:B].add_(act.long())

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

    @staticmethod
    def _constrained(logits, temp, top_p, u, tok, lp, masked):
        """tok, lp with the constrained rows drawn again from their masked logits: the draw from
        the distribution renormalised over the allowed tokens (the nucleus taken among them), at
        the row's own u; the log-prob stays the model's, over the whole vocabulary (what Score
        and training compute). The other rows keep their draws."""
        rows, bias = masked
        lf = logits.index_select(0, rows).float()
        t2, _ = sampling.sample(lf + bias, temp.index_select(0, rows), top_p.index_select(0, rows),
                                u.index_select(0, rows), bool((top_p.index_select(0, rows) < 1).any()))
        lp2 = lf.gather(1, t2[:, None]).squeeze(1) - torch.logsumexp(lf, dim=-1)
        tok, lp = tok.clone(), lp.clone()
        tok[rows] = t2.to(tok.dtype)
        lp[rows] = lp2.to(lp.dtype)
        return tok, lp

    @staticmethod
    def _with_top_p(logits, temp, top_p, u, tok, lp):
        """The Triton sampler's draws (tok, lp) with the rows that ask for top-p drawn again by
        the PyTorch nucleus sampler: the other rows keep exactly the draws they get in a batch
        without top-p."""
        tok_p, lp_p = sampling.sample(logits.float(), temp, top_p, u, True)
        nucleus = top_p < 1
        return torch.where(nucleus, tok_p, tok), torch.where(nucleus, lp_p, lp)

    def _run(self, B: int, L: int, use_top_p: bool) -> None:
        grouped = self.share and self.n_grouped > 0
        if not self.use_graphs or self._lora() or self.masked is not None:
            self._decode(B, L, use_top_p, grouped)
            return
        key = (B, L, use_top_p, grouped)
        g = self.graphs.get(key)
        if g is None:
            g = self._capture(B, L, use_top_p, grouped)
            self.graphs[key] = g
        g.replay()

    def _capture(self, B: int, L: int, use_top_p: bool, grouped: bool) -> torch.cuda.CUDAGraph:
        # A warm-up run compiles and initialises the libraries outside the capture. It advances
        # the step state, which is saved and restored; the keys and values it writes are the ones
        # the real step writes again at the same positions.
        saved = [t.clone() for t in (self.tok, self.pos, self.step_idx)]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            while True:
                try:
                    self._decode(B, L, use_top_p, grouped)
                    break
                except Exception as e:
                    # A compiler or kernel failure costs speed, not service.
                    for t, s in zip((self.tok, self.pos, self.step_idx), saved):
                        t.copy_(s)
                    if not self._degrade(e, B):
                        raise
        torch.cuda.current_stream().wait_stream(stream)
        for t, s in zip((self.tok, self.pos, self.step_idx), saved):
            t.copy_(s)
        g = torch.cuda.CUDAGraph()
        # Every graph writes its results into the buffers above, so graphs may share scratch
        # memory and be replayed in any order.
        with torch.cuda.graph(g, pool=self._graph_pool(), capture_error_mode="thread_local"):
            self._decode(B, L, use_top_p, grouped)
        log.info("captured decode graph rows=%d length=%d top_p=%s shared prompts=%s", B, L,
                 use_top_p, grouped)
        return g

    def _degrade(self, e: Exception, B: int) -> bool:
        """After a failed decode step: drops the batch-1 Triton step, compilation, then the
        Triton kernels; False when there is nothing left to drop."""
        if self.fused_b1 and B == 1:
            log.warning("the batch-1 Triton decode step failed, using the layer path: %s", e)
            self.kernel_error = f"batch 1: {type(e).__name__}: {e}"
            self.fused_b1 = False
            return True
        compiled = self.layer_fn is not decode_layer or self.pre_fn is not decode_pre
        if compiled:
            log.warning("torch.compile of the decode layer failed, running it eagerly: %s", e)
            self.compile_error = f"{type(e).__name__}: {e}"
            self.layer_fn, self.pre_fn, self.post_fn = decode_layer, decode_pre, decode_post
            return True
        if self.triton:
            log.warning("the Triton decode kernels failed, using PyTorch: %s", e)
            self.kernel_error = f"{type(e).__name__}: {e}"
            self.triton = self.fused_b1 = False
            self.graphs.clear()
            return True
        return False

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
            self._ungroup(stop)
            if self.prefix_rows:
                self._save_pos0(stop)
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
        if self.prefix_rows:
            self._keep([s for s in own if not s.req.cancelled and s.weights == self.weights])
        for s in seqs:
            s.done = True
            if s.req.cancelled:
                continue
            s.req.on_completion(Completion(
                request_id=s.req.id, index=s.index, prompt_tokens=list(s.req.prompt),
                tokens=s.tokens, logprobs=s.logprobs, text=s.text,
                finish_reason=s.finish_reason))
