"""The decode step: one token for every cache row in use, as a CUDA graph per shape on a GPU.

A step runs rows [0, B) of the cache over positions [0, L) (generate.py's module comment) with
the decode layer's functions the options chose: PyTorch's, compiled, or split around the Triton
attention (kernels.py), at batch 1 optionally all in Triton kernels. Each (B, L, top-p, shared
prompts) is captured once as a CUDA graph and replayed. A compiler or kernel failure costs speed,
not service: the step drops to the next simpler path (`_degrade`).

LoRA adapters (lora.py) ride along in the same graphs: while the worker holds adapters, the rows'
adapters are resident in the bank's table (lora.Table, static tensors updated in place) and the
step reads each row's slot from `lora_idx`, part of the step state like the tokens and positions
(`_lora_step` writes it before the step). The graphs are captured again only when the table grows
(a new version). With the Triton kernels the step applies the table fused (lora.Fused: the
shrink folded into the base's product, then one expand kernel a projection). A step the table
cannot serve (more adapters than its slots, the deterministic mode) runs eagerly with lora.Rows,
as constrained steps do.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch

from . import batch_invariant as bi
from . import kernels, lora, sampling
from .model import (decode_layer, decode_post, decode_pre, decode_step, decode_step_b1,
                    decode_step_split)

log = logging.getLogger("slimen_torch")


@contextlib.contextmanager
def capture(graph: torch.cuda.CUDAGraph, pool):
    """Captures graph from the work launched inside (on a side stream, into the memory pool
    pool, errors for this thread's captures only): torch.cuda.graph without the
    torch.cuda.empty_cache it makes first. That call hands every cached block back to the
    driver, so the first step after a graph captured mid-run (a new batch shape, often on a
    rank of several, whose batches follow the dealing) got its memory again from cudaMalloc:
    on 2 H200s a capture's 304 cudaFree and the next training call's 325 cudaMalloc took
    0.11 s of the host's time. The graphs' own pool already keeps their memory apart. Every
    capture runs on torch.cuda.graph's one capture stream, as its own do: the caching allocator
    reuses a pool's blocks only on the stream they were taken on, so graphs captured on streams
    of their own would each keep their scratch memory instead of sharing it."""
    torch.cuda.synchronize()  # as torch.cuda.graph: nothing of the caller's still running
    cls = torch.cuda.graph
    if cls.default_capture_stream is None:
        cls.default_capture_stream = torch.cuda.Stream()
    stream = cls.default_capture_stream
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph.capture_begin(pool, capture_error_mode="thread_local")
        try:
            yield graph
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)


class Decode:
    """The decode methods of Generator (a mixin: they use its model, KV cache (k, v), step state
    (tok, pos, step_idx, key, temp, top_p, active, out_tok, out_lp), masked rows, LoRA bank and
    shared-prompt groups)."""
    def _init_decode(self, cuda_graphs: bool, compile_layers: bool, triton: bool,
                     fused_b1: bool) -> None:
        """The decode step's functions (compiled, Triton) and its CUDA graphs."""
        self.use_graphs = cuda_graphs and self.cuda
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
        # The first token of a prompt is drawn by the Triton sampler when the decode steps' is.
        self.first_token_triton = True
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.graphs_lora = 0  # the lora.Table version the graphs read (0: no adapters)
        self.pool = None
        # The decode step's adapters: through the table (lora.Slots, captured) unless off, when
        # every step with adapters runs lora.Rows eagerly (the path before the table; bench_lora.py
        # measures both). lora_mode: how the next step applies them (_lora_step).
        self.lora_table = True
        # With the Triton kernels the table's updates run fused (lora.Fused: two kernels a
        # projection instead of four); off: lora.Packed's arithmetic (bench_lora.py compares).
        self.lora_fused = True
        # Fused with the shrink folded into the base product (lora.Table.fold: the table holds a
        # copy of the projections' weights); off: the shrink a product of its own.
        self.lora_fold = True
        self.lora_mode = None
        self.lora_warned = False
        # _lora_step's cache: the (row_changes, bank, Bank.changes) its adapters were read at,
        # the rows' distinct adapters then, and the (table, Table.moves) its rows' slots were
        # written at.
        self.lora_key = self.lora_moves = None
        self.lora_ads: list = []

    def _graph_pool(self):
        """The memory pool the graphs share: a new one when no captured graph holds the last
        (after the graphs were dropped, e.g. the Triton kernels' fallback). Reopening a pool all
        of whose graphs were destroyed trips an internal assert of PyTorch's allocator
        ("use_count > 0"), failing the capture."""
        if self.pool is None or not (self.graphs or self.pf_graphs):
            self.pool = torch.cuda.graph_pool_handle()
        return self.pool

    def _lora_step(self, rows) -> None:
        """Before a decode step of rows ((cache row, sample) pairs): how it applies their
        adapters (lora_mode). None: the worker holds none. "table": the rows' adapters are made
        resident in the bank's table and each row's slot is written into lora_idx where it
        changed (lora.Slots). "rows": lora.Rows, eagerly, when the table cannot serve the step:
        more adapters than its max_slots, lora_table off, or the deterministic mode (whose
        products batch_invariant.lora_weights makes invariant).

        In the steady state (the same rows, the same adapters, no slot moved) it reads no row:
        the rows' distinct adapters are kept from the last step until a row changes
        (row_changes) or the bank does (Bank.changes), and their slots are written only after
        that or after the table moved an adapter (Table.moves). The write is one copy of every
        row's slot from pinned memory, which does not make the host wait for the GPU."""
        self.lora_mode = None
        if not self._lora():
            return
        self.lora_mode = "rows"
        if not self.lora_table or bi.enabled():
            return
        t = self._table()
        key = (self.row_changes, self.bank, self.bank.changes)
        if key != self.lora_key:
            self.lora_key = key
            self.lora_ads = list({id(a): a for a in (s.req.adapter for _, s in rows)
                                  if a is not None}.values())
            self.lora_moves = None  # the rows' slots to be looked at again
        if not t.place(self.lora_ads):
            if not self.lora_warned:
                self.lora_warned = True
                log.warning("a decode step uses more than %d LoRA adapters (the table's slots): "
                            "such steps run eagerly", t.max_slots)
            return
        if not t.cap:  # base rows only, and no adapter placed yet: the base's step
            self.lora_mode = None
            return
        self.lora_mode = "table"
        if self.lora_moves == (t, t.moves):
            return
        self.lora_moves = (t, t.moves)
        host, changed = self.lora_host, False
        for r, s in rows:
            k = t.slot_of(s.req.adapter)
            if host[r] != k:
                host[r], changed = k, True
        if changed:
            # Enqueued before the step that reads it; the caching host allocator keeps the
            # pinned block until the copy has run.
            src = torch.tensor(host, dtype=torch.long, pin_memory=self.cuda)
            self.lora_idx.copy_(src, non_blocking=True)

    def _table(self) -> "lora.Table":
        """The bank's table, folded when the decode step's updates run fused (lora_fold)."""
        t = self.bank.table
        t.fold = self.triton and self.lora_fused and self.lora_fold
        return t

    def _run(self, B: int, L: int, use_top_p: bool) -> None:
        """One decode step on rows [0, B) over positions [0, L): its shape's CUDA graph replayed
        (captured on first use; adapters through the table included), or run eagerly without
        graphs, with masks or with adapters the table cannot serve."""
        grouped = self.groups.active()
        if not self.use_graphs or self.lora_mode == "rows" or self.masked is not None:
            self._decode(B, L, use_top_p, grouped)
            return
        version = self.bank.table.version if self.lora_mode == "table" else 0
        if version != self.graphs_lora:
            # The graphs read the table's tensors, or were captured without adapters.
            self.graphs.clear()
            self.graphs_lora = version
        key = (B, L, use_top_p, grouped)
        g = self.graphs.get(key)
        if g is None:
            g = self._capture(B, L, use_top_p, grouped)
            self.graphs[key] = g
        g.replay()

    def _decode(self, B: int, L: int, use_top_p: bool, grouped: bool = False) -> None:
        """One decode step on rows [0, B) over positions [0, L): what a CUDA graph captures;
        grouped: with the shared-prompt pass of the batched attention (some rows are grouped)."""
        pos = self.pos[:B]
        if self.lora_mode == "rows":
            with self.model.using(self._rows([s.req.adapter if s is not None else None
                                              for s in self.slots[:B]])):
                hidden = decode_step(self.model, decode_layer, self.tok[:B], pos, self.k, self.v, L)
            logits = self.model.logits(hidden)
        elif self.fused_b1 and B == 1 and self.lora_mode is None:
            logits = decode_step_b1(self.model, kernels, self.tok[:B], pos, self.k, self.v, L)
        else:
            sel = (lora.Slots(self.bank.table, self.lora_idx[:B],
                              fused=self.triton and self.lora_fused)
                   if self.lora_mode == "table" else None)
            with self.model.using(sel):
                if self.triton:
                    attn = kernels.decode_attention
                    if grouped:
                        attn = functools.partial(
                            attn, shared=(self.groups.grp[:B], self.groups.plen[:B]))
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
            # (The deterministic sampler reads the logits in their dtype, as the trainer does.)
            tok, lp = sampling.sample(logits if bi.enabled() else logits.float(), self.temp[:B],
                                      self.top_p[:B], u, use_top_p)
        if self.masked is not None:
            tok, lp = self._constrained(logits, self.temp[:B], self.top_p[:B], u, tok, lp, self.masked)
        self.out_tok[:B].copy_(tok)
        self.out_lp[:B].copy_(lp)
        act = self.active[:B]
        self.tok[:B].copy_(tok)
        self.pos[:B].copy_(torch.where(act, (pos + 1).clamp(max=self.L - 1), pos))
        self.step_idx[:B].add_(act.long())

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
        with capture(g, self._graph_pool()):
            self._decode(B, L, use_top_p, grouped)
        log.info("captured decode graph rows=%d length=%d top_p=%s shared prompts=%s", B, L,
                 use_top_p, grouped)
        return g

    def _degrade(self, e: Exception, B: int) -> bool:
        """After a failed decode step: drops the batch-1 Triton step, compilation, then the
        Triton kernels; False when there is nothing left to drop."""
        if self.fused_b1 and B == 1 and self.lora_mode is None:  # (adapters: the split path ran)
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

    # ---- draws again for some rows (also of a prefill's first tokens) ----

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
