"""The prefill: prompts written into their KV-cache rows, and the logits of their last tokens.

Three paths, as Generator._admit places the samples (generate.py):
- a lone prompt of at most prefill_graph_max tokens is padded to a multiple of length_bucket and
  run by a CUDA graph per bucket (`_prefill_bucketed`; on the CPU the same code runs directly);
- other prompts without a cached prefix run eagerly in one right-padded batch (`_prefill_eager`),
  each prompt once however many samples share it;
- a prompt with a cached prefix (prefix_cache.py) is prefilled from its first new token
  (`_prefill_offsets`: positions start at the prefix length, attention covers the cached keys).
A prompt's other samples get copies of its keys and values (`_copy_rows`).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from . import batch_invariant, lora
from .decode import capture
from .model import (after_attention, block_forward, kv_bytes, kv_read, kv_source, kv_write,
                    mlp, project_qkv, rms_norm, whole_block)
from .sequence import Placed, Request, Sequence, prompt_key

log = logging.getLogger("slimen_torch")


def compiled_prefill_layer(cfg):
    """The prefill's layer compiled (dynamic shapes), traced whole (model.whole_block)."""
    return torch.compile(whole_block(cfg), dynamic=True)


def _padded(rows: list[list[int]], T: int) -> torch.Tensor:
    """Token lists right-padded with 0 to T, as one [len(rows), T] tensor made by one call
    (a torch.tensor a prompt costs host time that grows with the batch)."""
    return torch.tensor([r + [0] * (T - len(r)) for r in rows], dtype=torch.long)


class Prefill:
    """The prefill methods of Generator (a mixin: they use its model, KV cache (k, v), rows
    (L, device), CUDA-graph pool and LoRA bank)."""

    def _init_prefill(self, *, compile_prefill: bool, prefill_graph_max: int) -> None:
        # The prefill's layer, compiled with compile_prefill (the engine's GPU default): its
        # norms, rope and residual adds fuse into a few kernels (eagerly a layer is ~60 kernels,
        # which bound a lone prompt's graph-captured prefill), at the price of compiling it on
        # first use (once for a lone prompt, again for a batch). The same arithmetic in another
        # summation order, so its keys and values can differ from Score's forward pass in the
        # last bits; scoring and training keep their own layer functions.
        self.prefill_fn = block_forward
        if compile_prefill:
            self.prefill_fn = compiled_prefill_layer(self.model.cfg)
        # A lone prompt of at most prefill_graph_max tokens is prefilled padded to a multiple of
        # length_bucket, by a CUDA graph per bucket (_prefill_bucketed); 0: always eagerly.
        self.prefill_graph_max = min(prefill_graph_max, self.L)
        self.pf_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pf_buf = self.pf_host = self.pf_logits = None
        self.prefill_error = ""
        self.offset_scores = 1 << 28  # one offset-prefill chunk's attention scores, at most

    def _prefill(self, placed: list[Placed]) -> torch.Tensor:
        """The prompts of the samples just placed (their rows in seq.slot); returns each sample's
        last logits [len(placed), vocab]. Samples placed with start 0 are prefilled as with
        prefix reuse off (_prefill_plain), the others from their prefix (_prefill_from)."""
        picked = [p.seq for p in placed]
        plain = [i for i, p in enumerate(placed) if not p.start]
        cached = [i for i, p in enumerate(placed) if p.start]
        logits = self._prefill_plain([picked[i] for i in plain])
        if cached:
            rest = self._prefill_from([placed[i] for i in cached])
            if logits is None:
                logits = rest
            else:
                both = torch.empty(len(placed), rest.shape[1], dtype=rest.dtype,
                                   device=self.device)
                both[torch.tensor(plain, device=self.device)] = logits
                both[torch.tensor(cached, device=self.device)] = rest
                logits = both
        return logits

    def _prefill_plain(self, picked: list[Sequence]):
        """The prompts of samples placed with start 0, as with prefix reuse off: one prompt by the
        bucketed path when it can, else eagerly. Logits [len(picked), vocab] or None if none."""
        if not picked:
            return None
        # Requests with the same prompt (and adapter) are prefilled once: GRPO's groups sent as
        # one request with n samples, or as n requests (n_samples_per_prompt).
        keys = [prompt_key(s.req) for s in picked]
        reqs: dict[tuple, Request] = {}  # prompt_key -> its first request, in prefill order
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
        self.prefix.restore_pos0(self.k, self.v, sorted({p.src for p in leads}))
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
        with m.using(self._prefill_lora(adapters) if self._lora() else None):
            for i, (kc, vc) in enumerate(zip(self.k, self.v)):
                w = m.layer_weights(i)
                q, k, v = project_qkv(cfg, w, x, cos, sin)  # [B, T, heads, D]
                kv_write(kc, (row[:, None], slice(None), pos), k)
                kv_write(vc, (row[:, None], slice(None), pos), v)
                # The prompt's new tokens attend to their own keys as the cache holds them
                # (rounded to fp8 with an fp8 cache), as the decode steps will.
                keys = kv_read(kc, (row, slice(None), slice(None, Lk)), x.dtype)
                values = kv_read(vc, (row, slice(None), slice(None, Lk)), x.dtype)
                if batch_invariant.enabled():  # as the decode steps and the trainer attend
                    o = batch_invariant.attention(q, keys, values, pos, cfg.head_dim ** -0.5)
                    x = after_attention(cfg, w, x, o.flatten(2))
                    continue
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

        with self.model.using(self._prefill_lora(adapters) if adapters and self._lora() else None):
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
        with capture(g, self._graph_pool()):
            self._prefill_static(Tb)
        log.info("captured prefill graph length=%d", Tb)
        return g
