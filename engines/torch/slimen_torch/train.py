"""One optimizer step of the policy loss on a batch of samples.

The model that generates is the model that trains: its parameters are the rollout weights. On a
GPU they are bf16 (what generation reads) and the optimizer keeps fp32 master copies with its
moments; after a step the masters are cast back into the parameters in place, so captured decode
graphs stay valid. On the CPU everything is fp32 and the parameters are their own masters.

A batch is cut into micro-batches of at most `micro_batch_tokens` padded tokens; the loss is a
weighted sum with weights computed over the whole batch (loss.token_weights), so the gradients of
the micro-batches add up to the gradient of the batch.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import traceback

import numpy as np
import torch

from . import batch_invariant, kernels
from . import loss as L
from .model import Transformer, block_forward, copy_tensors, mlp, project_qkv, whole_block
from .types import Batch, RequestError, Sample, TrainStats

log = logging.getLogger("slimen_torch")


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, entropy_grad: bool):
    """logits [N, V] → (log-prob of each target [N], entropy [N]), computed in fp32.

    The entropy is always computed (it is reported); it carries a gradient only when asked, so
    that an unused entropy bonus costs no backward pass over the vocabulary. Compiled (on a GPU)
    this reads the bf16 logits a few times instead of materialising several fp32 copies of them.
    In the deterministic mode: batch_invariant's, the log-probs the sampler reports.
    """
    if batch_invariant.enabled():
        return batch_invariant.token_logprobs_entropy(logits, targets, entropy_grad)
    lsm = torch.log_softmax(logits.float(), dim=-1)
    logp = lsm.gather(1, targets[:, None]).squeeze(1)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        ent = -(lsm.exp() * lsm).sum(-1)
    return logp, ent


class Packed:
    """A micro-batch's (prompt, response) pairs as device tensors, built on the host and sent in
    one copy per dtype that does not wait for the GPU (pinned memory), before any of the pass's
    work is launched. A tensor made from a Python list on a GPU (`torch.tensor(..., device=)`)
    waits for every kernel queued before it: made between a micro-batch's forward and its loss,
    each one left the GPU idle while the host built the next.

    tokens [B, T] (rows right-padded), and over the N response tokens in order: idx [N] (the
    flattened position whose hidden state predicts each), targets [N], seq [N] (the row of each);
    floats: name → [N] fp32, one value per response token, given per row."""

    def __init__(self, pairs: list[tuple[list[int], list[int]]], dev: torch.device,
                 floats: dict | None = None):
        B = len(pairs)
        plen = np.fromiter((len(p) for p, _ in pairs), np.int64, B)
        rlen = np.fromiter((len(r) for _, r in pairs), np.int64, B)
        T = int((plen + rlen).max())
        N = int(rlen.sum())
        ints = np.zeros(B * T + 3 * N, np.int64)
        tokens = ints[:B * T].reshape(B, T)
        for row, (p, r) in enumerate(pairs):
            tokens[row, :len(p)] = p
            tokens[row, len(p):len(p) + len(r)] = r
        first = np.cumsum(rlen) - rlen  # each row's first response token in the flat order
        idx = ints[B * T:B * T + N]
        idx[:] = np.arange(N) + np.repeat(np.arange(B) * T + plen - 1 - first, rlen)
        ints[B * T + N:B * T + 2 * N] = tokens.reshape(-1)[idx + 1]
        ints[B * T + 2 * N:] = np.repeat(np.arange(B), rlen)
        names = list(floats or {})
        vals = np.empty((len(names), N), np.float32)
        for k, name in enumerate(names):
            rows = [np.asarray(v, dtype=np.float64) for v in floats[name]]
            # Rounded to fp32 from the Python floats, as torch.tensor(values, dtype=float32).
            vals[k] = np.concatenate(rows)
        it, ft = _to_device(torch.from_numpy(ints), dev), _to_device(torch.from_numpy(vals), dev)
        self.tokens = it[:B * T].view(B, T)
        self.idx, self.targets, self.seq = it[B * T:].view(3, N).unbind(0)
        for k, name in enumerate(names):
            setattr(self, name, ft[k])


def _to_device(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """A host tensor on dev; to a GPU through pinned memory without waiting for the stream."""
    if dev.type != "cuda":
        return t.to(dev)
    return t.pin_memory().to(dev, non_blocking=True)


def response_hidden(model: Transformer, pairs: list[tuple[list[int], list[int]]],
                    packed: Packed | None = None):
    """Final hidden states [N, hidden] at the positions that predict every response token of the
    (prompt, response) pairs, flattened in order, and the response tokens [N]. Rows are
    right-padded into one batch; on a GPU the forward runs under bf16 autocast. packed: the
    pairs already packed (Packed)."""
    dev = model.embed.device
    pk = packed if packed is not None else Packed(pairs, dev)
    with _autocast(dev):
        hidden = model(pk.tokens).flatten(0, 1)[pk.idx]
    return hidden, pk.targets


def _autocast(dev: torch.device):
    # The deterministic mode runs the model in its own dtype, as generation does.
    if dev.type == "cuda" and not batch_invariant.enabled():
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def response_logits(model: Transformer, pairs: list[tuple[list[int], list[int]]],
                    packed: Packed | None = None):
    """Logits [N, V] (bf16 under autocast) predicting every response token of the pairs, and the
    response tokens [N]."""
    hidden, targets = response_hidden(model, pairs, packed)
    with _autocast(hidden.device):
        return model.logits(hidden), targets


def check_samples(samples: list[Sample], vocab: int, max_len: int) -> None:
    for i, s in enumerate(samples):
        n = len(s.response)
        # A critic's sample (it has returns) carries no policy fields: the critic ignores them.
        policy_fields = ("old_logprobs", "advantages") if not s.returns else ()
        for name in ("loss_mask",) + policy_fields:
            if len(getattr(s, name)) != n:
                raise RequestError("INVALID_ARGUMENT", f"sample {i}: {name} has "
                                   f"{len(getattr(s, name))} entries for {n} response tokens")
        for name in ("returns", "old_values", "train_logprobs"):
            if getattr(s, name) and len(getattr(s, name)) != n:
                raise RequestError("INVALID_ARGUMENT", f"sample {i}: {name} has "
                                   f"{len(getattr(s, name))} entries for {n} response tokens")
        if n and not s.prompt:
            raise RequestError("INVALID_ARGUMENT", f"sample {i}: empty prompt (the first response "
                               "token needs a token before it)")
        if len(s.prompt) + n > max_len:
            raise RequestError("INVALID_ARGUMENT", f"sample {i}: {len(s.prompt) + n} tokens, "
                               f"longer than the model's {max_len}")
        bad = [t for t in s.prompt + s.response if not 0 <= t < vocab]
        if bad:
            raise RequestError("INVALID_ARGUMENT", f"sample {i}: token {bad[0]} outside the "
                               f"vocabulary [0, {vocab})")


def micro_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Sample indices grouped so that (rows × longest row) ≤ budget, longest first."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    out, cur = [], []
    for i in order:
        if cur and lengths[cur[0]] * (len(cur) + 1) > budget:
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    return out


# The deterministic mode's training micro-batches (Engine: deterministic with micro_batch_tokens
# 0): the largest of these token counts whose pass fits MICRO_BATCH_SHARE of the device's free
# memory, after the KV cache is made. The mode's log-prob head computes the whole logits of a
# micro-batch (the sampler's arithmetic) and its backward pass their gradient, at 16,384 tokens
# of a 152k vocabulary 10 GB in bf16; 4,096-token micro-batches kept a step's layers launching
# four times the kernels from Python, and training bound by the host. A row's log-probs do not
# depend on its micro-batch; the gradients' sums do, repeatably. False: 4,096 always (the first
# version; determinism.py --micro-batch-tokens 4096 for one run).
MICRO_BATCH_BY_MEMORY = True
MICRO_BATCH_SIZES = (16384, 12288, 8192, 4096)
MICRO_BATCH_SHARE = 0.5


def free_memory(device: torch.device) -> int | None:
    """Bytes a pass may still take on device: the driver's free memory plus what PyTorch's
    allocator holds unused; None off a GPU."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def pass_bytes_per_token(cfg, itemsize: int) -> int:
    """An upper bound on what a deterministic training pass holds a token: every layer's saved
    activations (the norms' inputs and outputs, q/k/v before and after their norms and rope, the
    attention's output, the MLP's gate/up and its product), and the whole logits with their
    gradient."""
    per_layer = 6 * cfg.hidden + 3 * (cfg.q_dim + 2 * cfg.kv_dim) + 3 * cfg.intermediate
    return itemsize * (cfg.layers * per_layer + 2 * cfg.vocab_size)


def deterministic_micro_batch_tokens(cfg, itemsize: int, free: int | None) -> int:
    """The deterministic mode's micro-batch (MICRO_BATCH_BY_MEMORY): the largest of
    MICRO_BATCH_SIZES whose pass_bytes_per_token fit MICRO_BATCH_SHARE of free bytes (None,
    off a GPU: the smallest)."""
    if not MICRO_BATCH_BY_MEMORY or free is None:
        return MICRO_BATCH_SIZES[-1]
    per = pass_bytes_per_token(cfg, itemsize)
    for n in MICRO_BATCH_SIZES:
        if n * per <= MICRO_BATCH_SHARE * free:
            return n
    return MICRO_BATCH_SIZES[-1]


# Inductor's coalescing analysis asserts on some of the training layer's kernels when shapes are
# dynamic (torch 2.11: AssertionError in tiling_utils.get_pw_red_splits, "coalesce_tiling_analysis
# does not yet apply to dynamic shapes" says its config); without it the layer compiles.
# cpp.vec_isa_ok False: the layer's graph holds one CPU kernel (the attention's scale, a float64
# scalar saved for the backward pass), and choosing its CPU vector instructions makes inductor
# build and load a test program in a new Python process for each candidate (AVX-512, AVX2, …):
# most of every worker's first step, warm compile cache or not (docs/performance.md). Plain C++
# is all one scalar store needs.
# triton.mix_order_reduction_non_strict_mode: the backward pass's norm-weight reductions are fused
# across row and column order whatever the micro-batch's size; strict, inductor fuses them only
# from 5 Mi elements on and guards the compiled layer on it, so a run whose micro-batches cross
# that size (8,192 tokens at hidden 640) would recompile the layer in the middle of a run.
# Read from inductor's config at the first compile, not at import: torch._inductor (with Dynamo)
# takes seconds to import, which every rank of a restarted worker group paid before it listened
# (a group's rank imports it while the ranks meet, import_compiler_later), and a worker on one
# CPU never compiles.
@functools.cache
def compile_options() -> dict:
    """compile_options: the inductor options of the compiled training layer (above)."""
    from torch._inductor import config as inductor_config

    opts = {"triton.coalesce_tiling_analysis": False, "cpp.vec_isa_ok": False}
    if hasattr(inductor_config.triton, "mix_order_reduction_non_strict_mode"):
        opts["triton.mix_order_reduction_non_strict_mode"] = True
    return opts


def import_compiler_later():
    """Starts importing the compiler (compile_options: torch._inductor, Dynamo) on a thread of
    its own, for a worker that will need it and is about to wait anyway (a rank of a group, for
    the others): the seconds of the import then pass meanwhile, not after. Returns the thread:
    join it before importing anything the compiler imports too (FSDP, torch.distributed.tensor),
    since two threads importing the same modules in different orders may each see the other's
    half-initialised."""
    import threading

    t = threading.Thread(target=compile_options, name="slimen-torch-import-compiler",
                         daemon=True)
    t.start()
    return t


class Trainer:
    COMPILE_MODES = ("", "block", "block-static", "regional")

    def __init__(self, model: Transformer, *, micro_batch_tokens: int, reference=None,
                 compile: str | bool = "", fused_head: bool = False, params=None):
        self.model = model
        # A critic's value head (score, score_bias) comes last, wherever the model registers it: a head
        # created after the optimizer is appended (add_params), so every trainer of the same
        # model, with or without the head at its start, orders the optimizer's state alike.
        # params: train only these (a LoRA adapter's A and B over a frozen base, lora.View).
        if params is not None:
            self.params = list(params)
        else:
            named = list(model.named_parameters())
            self.params = [p for n, p in named if not n.startswith("score")] + \
                [p for n, p in named if n.startswith("score")]
        self.mixed = self.params[0].dtype != torch.float32
        self.cuda = self.params[0].device.type == "cuda"
        self.micro_batch_tokens = micro_batch_tokens
        self.reference = reference  # callable returning the frozen reference Transformer
        self.masters = None
        self.opt = None
        # The optimizer step launched before the step's read-back (_apply): a fused optimizer's.
        self.step_ahead = False
        # bf16 parameters with fp32 masters on a GPU: the whole optimizer step (clip, AdamW, the
        # copy into the parameters) in one Triton pass per parameter (_fused_apply); False: the
        # masters' fp32 gradients, torch's fused AdamW and a copy back (bench's train_old_opt).
        self.fused_step = kernels.HAVE_TRITON and self.cuda and self.mixed
        self.steps = 0
        # Log-probs from the hidden states in chunks (kernels.linear_logprobs), with the Triton
        # element-wise passes on a GPU; else from the whole logits (token_logprobs).
        self.fused_head = fused_head
        self.head_triton = kernels.HAVE_TRITON and self.cuda
        self.compile_error = ""
        self._set_mode("block" if compile is True else (compile or ""))

    def _set_mode(self, mode: str) -> None:
        """Installs the training layer of a compile mode: "" eager; "block" the whole layer
        compiled (forward and backward; shapes dynamic, since micro-batches differ in rows and
        length), "block-static" the same specialised to each shape, "regional" the q/k/v and MLP
        parts compiled around an eager attention."""
        if mode not in self.COMPILE_MODES:
            raise ValueError(f"compile mode {mode!r}: use one of {self.COMPILE_MODES}")
        self.mode = mode
        self.model.train_block_fn = block_forward
        self.logprob_fn = token_logprobs
        opts = compile_options() if self.cuda else None
        if mode in ("block", "block-static"):
            self.model.train_block_fn = torch.compile(whole_block(self.model.cfg),
                                                      dynamic=mode == "block", options=opts)
            if not self.fused_head:
                self.logprob_fn = torch.compile(token_logprobs, dynamic=True, options=opts)
        elif mode == "regional":
            self.model.train_block_fn = functools.partial(
                block_forward, qkv_fn=torch.compile(project_qkv, dynamic=True, options=opts),
                mlp_fn=torch.compile(mlp, dynamic=True, options=opts))

    def add_params(self, params: list) -> None:
        """Parameters created after the trainer (a critic's value head) train from now on."""
        self.params += params
        if self.opt is not None:
            new = [p.detach().float().clone().requires_grad_() for p in params] if self.mixed \
                else params
            self.masters += new
            self.opt.add_param_group({**{k: v for k, v in self.opt.param_groups[0].items()
                                         if k != "params"}, "params": new})

    def reset(self) -> None:
        """Trainer.reset: the trainer starts over from its model's weights as a new one would (no
        optimizer state, no masters, step 0, no gradients), keeping its compiled training layer;
        a load then puts a saved state back (Engine._load). A value head the model gained since
        (a critic's checkpoint loaded into it) trains too, last, as a new trainer orders it."""
        for p in self.params:
            p.grad = None
        self.opt = self.masters = None
        self.step_ahead = False
        self.steps = 0
        mine = {id(p) for p in self.params}
        head = [p for n, p in self.model.named_parameters()
                if n.startswith("score") and id(p) not in mine]
        if head:
            self.add_params(head)

    def _uncompile(self, err: Exception) -> bool:
        """After a failure of a compiled step: the next mode down (block → regional → eager);
        False if already eager. The whole traceback is kept in compile_error."""
        if not self.mode:
            return False
        nxt = "regional" if self.mode.startswith("block") else ""
        log.warning("torch.compile of the training step (%s) failed, now %s: %s", self.mode,
                    nxt or "eager", err)
        self.compile_error += f"[{self.mode}] {traceback.format_exc()}\n"
        self._set_mode(nxt)
        for p in self.params:
            p.grad = None
        return True

    def _optimizer(self) -> torch.optim.Optimizer:
        if self.opt is None:
            if self.mixed:
                self.masters = [p.detach().float().clone().requires_grad_() for p in self.params]
            else:
                # A list of its own: add_params appends a new head to both.
                self.masters = list(self.params)
            self.opt = torch.optim.AdamW(self.masters, lr=0.0, fused=self.cuda)
            self.step_ahead = self.cuda
        return self.opt

    def _logprobs(self, model: Transformer, pairs, entropy_grad: bool, packed=None):
        """(log-prob [N], entropy [N]) of every response token of the (prompt, response) pairs,
        and the response tokens [N]. packed: the pairs as Packed."""
        if self.fused_head:
            hidden, targets = response_hidden(model, pairs, packed)
            logp, ent = kernels.linear_logprobs(hidden, model.head_weight, targets,
                                                entropy_grad=entropy_grad,
                                                use_triton=self.head_triton)
            return logp, ent, targets
        logits, targets = response_logits(model, pairs, packed)
        logp, ent = self.logprob_fn(logits, targets, entropy_grad=entropy_grad)
        return logp, ent, targets

    def _retrying(self, fn, *args):
        """fn(*args), retried after dropping a failed compile mode (block → regional → eager),
        then the Triton passes of the log-prob head."""
        while True:
            try:
                return fn(*args)
            except (RequestError, ValueError):
                raise
            except Exception as e:
                if self._uncompile(e):
                    continue
                if not (self.fused_head and self.head_triton):
                    raise
                log.warning("the Triton log-prob kernels failed, using PyTorch: %s", e)
                self.compile_error += f"[head] {traceback.format_exc()}\n"
                self.head_triton = False
                for p in self.params:
                    p.grad = None
            finally:
                self.model.eval()  # generation and scoring always see the model in eval mode

    def step(self, batch: Batch) -> TrainStats:
        return self._retrying(self._step, batch)

    def _step(self, batch: Batch) -> TrainStats:
        cfg = L.resolve(batch.loss)
        kept = [i for i, s in enumerate(batch.samples) if s.response]
        samples = [batch.samples[i] for i in kept]
        check_samples(samples, self.model.cfg.vocab_size, self.model.cfg.max_seq_len)
        lengths = [len(s.prompt) + len(s.response) for s in samples]
        critic = any(s.returns for s in samples)
        if critic:
            self._check_critic(batch.loss, samples)
        plan = self._plan(lengths)
        # The weights count every sample of the step, those with an empty response too (slime's
        # reductions count a sample without trained tokens); only the others are run, and only
        # those of this trainer's passes need theirs (_own).
        own = self._own(plan, len(samples))
        weights: list = [None] * len(samples)
        for i, w in zip(own, L.token_weights([s.group for s in batch.samples],
                                             [s.loss_mask for s in batch.samples],
                                             cfg.aggregation, only=[kept[i] for i in own])):
            weights[i] = w
        if critic:
            return self._critic_step(batch.loss, cfg, samples, weights, plan)
        opt = self._optimizer()
        dev = self.params[0].device
        ref_model = self.reference() if cfg.kl_coef > 0 else None
        self.model.train()
        sums = {k: torch.zeros((), dtype=torch.float64, device=dev)
                for k in ("loss", "pg", "kl", "entropy", "clipped", "tokens", "lp_diff",
                          "lp_diff_w")
                + (("tis_clipped", "tis_weight") if cfg.use_tis else ())}
        diff_max = torch.zeros((), dtype=torch.float64, device=dev)
        for mb in plan:
            idle = not mb  # a pass of no samples of this rank's (dist.py): weight 0, not counted
            mb = mb or [0]
            group = [samples[i] for i in mb]
            pairs = [(s.prompt, s.response) for s in group]
            floats = {"old": [s.old_logprobs for s in group],
                      "adv": [s.advantages for s in group],
                      "mask": [s.loss_mask for s in group], "weight": [weights[i] for i in mb]}
            if cfg.use_tis:
                floats["train"] = [s.train_logprobs or [0.0] * len(s.response) for s in group]
                floats["has_train"] = [[1.0 if s.train_logprobs else 0.0] * len(s.response)
                                       for s in group]
            pk = Packed(pairs, dev, floats)
            logp, ent, targets = self._fwd(
                lambda m: self._logprobs(m, pairs, cfg.ent_coef > 0, pk))
            ref = None
            if ref_model is not None:
                with torch.no_grad():
                    ref = self._logprobs(ref_model, pairs, False, pk)[0]
            old, rollout = pk.old, None
            if cfg.use_tis:
                # The rollout's log-probs only divide the TIS ratio; the PPO ratio's old
                # log-probs are the trainer's: sent by the host, else those of the weights
                # before this step, which are the current ones, detached.
                rollout = old
                old = torch.where(pk.has_train != 0, pk.train, logp.detach().float())
            out = L.policy_loss(cfg, logp, old, pk.adv, pk.mask,
                                pk.weight * (0.0 if idle else 1.0),
                                entropy=ent, ref_logp=ref, seq=pk.seq, n_seqs=len(group),
                                rollout_logp=rollout)
            if not idle:
                out.update(L.logprob_mismatch(old if cfg.use_tis else logp.detach(),
                                              pk.old, pk.mask, pk.weight))
                diff_max = torch.maximum(diff_max, out.pop("lp_diff_max").double())
            self._backward(out["loss"])
            for k in sums:
                if k in out and not idle:
                    sums[k] += out[k].detach().double()
        return self._apply(batch.loss, sums, diff_max)

    @staticmethod
    def _check_critic(lc, samples: list[Sample]) -> None:
        if any(not s.returns for s in samples):
            raise RequestError("INVALID_ARGUMENT", "a critic batch needs returns for every sample")
        if lc.value_clip > 0 and any(not s.old_values for s in samples):
            raise RequestError("INVALID_ARGUMENT", "value_clip needs old_values for every sample")

    def _critic_step(self, lc, cfg: L.Loss, samples: list[Sample], weights: list,
                     plan: list[list[int]]) -> TrainStats:
        """The value loss of a PPO critic: Σ w·max((V − R)², (clip(V, V_old ± c) − R)²), with
        the token weights of the policy loss's aggregation (weights[i]: sample i's, for those
        of the plan's passes) and no clipping when c is 0."""
        clip = lc.value_clip
        self._optimizer()
        self.model.train()
        dev = self.params[0].device
        sums = {k: torch.zeros((), dtype=torch.float64, device=dev)
                for k in ("loss", "pg", "kl", "entropy", "clipped", "tokens")}
        for mb in plan:
            idle = not mb  # as in _step
            mb = mb or [0]
            group = [samples[i] for i in mb]
            pairs = [(s.prompt, s.response) for s in group]
            floats = {"ret": [s.returns for s in group], "mask": [s.loss_mask for s in group],
                      "weight": [weights[i] for i in mb]}
            if clip > 0:
                floats["old"] = [s.old_values for s in group]
            pk = Packed(pairs, dev, floats)
            v = self._fwd(lambda m: m.values(response_hidden(m, pairs, pk)[0]))
            ret, mask, w = pk.ret, pk.mask, pk.weight * (0.0 if idle else 1.0)
            trained = mask != 0
            l1 = (v - ret) ** 2
            clipped = torch.zeros_like(trained)
            if clip > 0:
                old = pk.old
                l2 = (old + (v - old).clamp(-clip, clip) - ret) ** 2
                clipped = (l2 > l1) & trained
                l1 = torch.where(clipped, l2, l1)
            loss = torch.where(trained, w * l1, torch.zeros_like(l1)).sum()
            self._backward(loss)
            if idle:
                continue
            sums["loss"] += loss.detach().double()
            sums["clipped"] += clipped.sum()
            sums["tokens"] += trained.sum()
        stats = self._apply(lc, sums)
        stats.value_loss = stats.loss
        stats.pg_loss = 0.0
        return stats

    def sft_step(self, pairs: list[tuple[list[int], list[int]]], lc) -> TrainStats:
        """One supervised step: token-mean negative log-likelihood of the responses.

        Reported as TrainStats with loss = pg_loss = the NLL (warm-up before RL, see sft.py)."""
        return self._retrying(self._sft_step, pairs, lc)

    def _sft_step(self, pairs, lc) -> TrainStats:
        pairs = [(p, r) for p, r in pairs if r]
        check_samples([Sample(p, r, [1.0] * len(r), [0.0] * len(r), [0.0] * len(r))
                       for p, r in pairs], self.model.cfg.vocab_size, self.model.cfg.max_seq_len)
        self._optimizer()
        self.model.train()
        dev = self.params[0].device
        total = sum(len(r) for _, r in pairs)
        sums = {k: torch.zeros((), dtype=torch.float64, device=dev)
                for k in ("loss", "pg", "kl", "entropy", "clipped", "tokens")}
        for mb in self._plan([len(p) + len(r) for p, r in pairs]):
            idle = not mb  # as in _step
            mb = mb or [0]
            mine = [pairs[i] for i in mb]
            pk = Packed(mine, dev)
            logp, ent, targets = self._fwd(lambda m: self._logprobs(m, mine, False, pk))
            nll = -logp.sum() / total * (0.0 if idle else 1.0)
            self._backward(nll)
            if idle:
                continue
            sums["loss"] += nll.detach().double()
            sums["entropy"] += ent.sum().double() / total
            sums["tokens"] += len(targets)
        sums["pg"] = sums["loss"]
        return self._apply(lc, sums)

    # ---- what a sharded trainer (dist.py) does differently ----

    def _fwd(self, fn):
        """fn(model): a training pass over the model; the sharded trainer runs it inside the
        module call that gathers its weights."""
        return fn(self.model)

    def _plan(self, lengths: list[int]) -> list[list[int]]:
        """The micro-batches this trainer runs, as sample indices; an empty one is a pass that
        trains nothing (a rank with fewer micro-batches than another, dist.py)."""
        return micro_batches(lengths, self.micro_batch_tokens)

    def _own(self, plan: list[list[int]], n: int) -> list[int]:
        """The samples (of n) whose loss weights this trainer computes: all of them; a sharded
        trainer's rank only those of its passes (dist.py)."""
        return list(range(n))

    def _backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def _reduce(self, sums: dict) -> dict:
        """The step's sums over every rank."""
        return sums

    def _reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        """The largest of t over every rank (a sharded trainer's ranks: dist.py's size)."""
        if getattr(self, "size", 1) > 1:
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return t

    def _grad_norm(self, grads) -> torch.Tensor:
        return torch.nn.utils.get_total_norm(grads)

    def _clip(self, grads, max_norm: float, norm: float) -> None:
        """Scales the gradients by max_norm / (norm + 1e-6) when that is below 1, as
        clip_grads_with_norm_ does (which takes the parameters, not their gradients: given the
        gradients it finds no .grad on them and clips nothing). norm: the read-back norm."""
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            torch._foreach_mul_(grads, coef)

    def _stepped(self) -> None:
        """After an optimizer step: the generating model gets the new weights."""
        if self.mixed:
            with torch.no_grad():
                copy_tensors(self.params, self.masters)

    def _master_grads(self) -> None:
        """The bf16 gradients, cast into fp32 gradients of the masters: one flat buffer for the
        step (freed with the gradients after it) and one multi-tensor copy, not a cast launched
        from Python per parameter."""
        pairs = [(p, m) for p, m in zip(self.params, self.masters) if p.grad is not None]
        for m in self.masters:
            m.grad = None
        if pairs:
            flat = torch.empty(sum(p.numel() for p, _ in pairs), dtype=torch.float32,
                               device=pairs[0][1].device)
            views = [v.view(p.shape) for v, (p, _) in
                     zip(flat.split([p.numel() for p, _ in pairs]), pairs)]
            copy_tensors(views, [p.grad for p, _ in pairs])
            for v, (p, m) in zip(views, pairs):
                m.grad = v
        for p in self.params:
            p.grad = None

    def _fusable(self) -> bool:
        """Whether this step takes _fused_apply: bf16 parameters with fp32 masters, some with a
        gradient, and an AdamW without the options the kernel does not implement."""
        return (self.fused_step and self.mixed and self.opt is not None
                and any(p.grad is not None for p in self.params)
                and all(not g["amsgrad"] and not g["maximize"] and not g["differentiable"]
                        and g.get("decoupled_weight_decay", True) for g in self.opt.param_groups))

    def _fused_apply(self, lc, sums) -> torch.Tensor:
        """The optimizer step of bf16 parameters with fp32 masters, launched without a read-back:
        the gradient norm from the bf16 gradients (their fp32 values are exact, so it is the
        masters' norm up to the order of the sum), then per parameter one pass
        (kernels.adamw) that scales its bf16 gradient by the clip coefficient, applies
        torch.optim.AdamW to the master and its moments and writes the bf16 parameter, or does
        nothing when the loss or the norm is not finite: the steps of _master_grads, the norm,
        the clip, the optimizer and _stepped without the fp32 gradients. The moments and step
        counts stay in self.opt.state (checkpoints unchanged), the counts advanced as the fused
        AdamW advances them (not on a skipped step). Returns the norm (a device tensor)."""
        opt = self.opt
        group = {m: g for g in opt.param_groups for m in g["params"]}
        todo = [(p, m) for p, m in zip(self.params, self.masters) if p.grad is not None]
        grads = [p.grad for p, _ in todo]
        norm = torch.linalg.vector_norm(
            torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32)), 2.0)
        bad = ~(torch.isfinite(sums["loss"]) & torch.isfinite(norm))
        if lc.max_grad_norm > 0:  # as the unfused path's: in fp64, applied in fp32
            coef = torch.full((), lc.max_grad_norm, dtype=torch.float64, device=norm.device)
            coef = (coef / (norm.double() + 1e-6)).clamp(max=1.0).float()
        else:
            coef = torch.ones((), dtype=torch.float32, device=norm.device)
        for _, m in todo:
            st = opt.state[m]
            if not st:  # as torch.optim.Adam._init_group makes it
                g = group[m]
                st["step"] = (torch.zeros((), dtype=torch.float32, device=m.device)
                              if g["capturable"] or g["fused"] else torch.tensor(0.0))
                st["exp_avg"] = torch.zeros_like(m, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(m, memory_format=torch.preserve_format)
        steps = [opt.state[m]["step"] for _, m in todo]
        g0 = opt.param_groups[0]
        beta1, beta2 = g0["betas"]
        hyper = dict(lr=g0["lr"], beta1=beta1, beta2=beta2, eps=g0["eps"],
                     weight_decay=g0["weight_decay"])
        sc = kernels.adamw_scalars(coef, bad.float(), steps, hyper["lr"], beta1, beta2)
        with torch.no_grad():
            for i, (p, m) in enumerate(todo):
                st = opt.state[m]
                if self.fused_step:
                    try:
                        kernels.adamw(p, m, p.grad, st["exp_avg"], st["exp_avg_sq"], sc[i],
                                      **hyper)
                        continue
                    except Exception as e:
                        # The parameters before this one are stepped: this step ends in
                        # PyTorch, the next ones take the unfused path.
                        log.warning("the fused optimizer step (Triton) failed, using "
                                    "PyTorch's AdamW: %s", e)
                        self.compile_error += f"[adamw] {traceback.format_exc()}\n"
                        self.fused_step = False
                kernels.adamw(p, m, p.grad, st["exp_avg"], st["exp_avg_sq"], sc[i],
                              use_triton=False, **hyper)
        # As the fused AdamW does under a GradScaler: + 1, − found_inf.
        torch._foreach_add_(steps, 1)
        torch._foreach_sub_(steps, [bad.float().to(steps[0].device)] * len(steps))
        for p in self.params:
            p.grad = None
        for m in self.masters:
            m.grad = None
        return norm

    def _apply(self, lc, sums, diff_max=None) -> TrainStats:
        """The optimizer step after the backward passes: sums are the step's statistics (summed
        over ranks here), diff_max the largest rollout/trainer log-prob mismatch of a policy
        step (None for other steps)."""
        sums = self._reduce(sums)
        if diff_max is not None:
            sums["lp_diff_max"] = self._reduce_max(diff_max)
        opt = self.opt
        for g in opt.param_groups:
            g["lr"] = lc.lr
            g["betas"] = (lc.beta1 or 0.9, lc.beta2 or 0.999)
            g["eps"] = lc.adam_eps or 1e-8
            g["weight_decay"] = lc.weight_decay
        dev = next(iter(sums.values())).device
        fused = self._fusable()
        grads = []
        if fused:
            norm = self._fused_apply(lc, sums)
        else:
            if self.mixed:
                self._master_grads()
            grads = [m.grad for m in self.masters if m.grad is not None]
            norm = self._grad_norm(grads) if grads else torch.zeros((), device=dev)
        # With a fused optimizer (the one-pass step of _fused_apply, or torch's fused AdamW) the
        # step is launched before anything is read back: the clip is scaled on the device and a
        # non-finite loss or norm makes the optimizer skip the update there (found_inf, as under
        # a GradScaler), so the GPU never waits for the host between the backward pass and the
        # optimizer. Else the host reads first and decides.
        ahead = fused or (self.step_ahead and bool(grads))
        if ahead and not fused:
            bad = ~(torch.isfinite(sums["loss"]) & torch.isfinite(norm))
            if lc.max_grad_norm > 0:
                n = norm.detach().double()
                coef = torch.full((), lc.max_grad_norm, dtype=torch.float64, device=n.device)
                torch._foreach_mul_(grads, (coef / (n + 1e-6)).clamp(max=1.0).float())
            opt.found_inf = bad.float()
            try:
                opt.step()
            finally:
                del opt.found_inf
            opt.zero_grad(set_to_none=True)
            self._stepped()
        # One wait for the GPU: the step's sums and the gradient norm read back together.
        got = torch.stack([v.double() for v in sums.values()]
                          + [norm.detach().double().reshape(()).to(dev)]).tolist()
        vals = dict(zip(sums, got))
        tokens = int(vals["tokens"])
        stats = TrainStats(loss=vals["loss"], pg_loss=vals["pg"], kl=vals["kl"],
                           entropy=vals["entropy"], tokens=tokens,
                           clip_frac=vals["clipped"] / tokens if tokens else 0.0)
        if tokens and "tis_clipped" in vals:
            stats.tis_clip_frac = vals["tis_clipped"] / tokens
            stats.tis_weight = vals["tis_weight"] / tokens
        if "lp_diff_max" in vals:
            stats.logprob_diff_mean = vals["lp_diff"] / tokens if tokens else 0.0
            stats.logprob_diff_max = vals["lp_diff_max"]
            stats.logprob_abs_diff = vals["lp_diff_w"]
        if not math.isfinite(stats.loss):
            return self._skip(stats, f"non-finite loss {stats.loss}")
        stats.grad_norm = got[-1]
        if not math.isfinite(stats.grad_norm):
            return self._skip(stats, f"non-finite gradient norm {stats.grad_norm}")
        if not ahead:
            if lc.max_grad_norm > 0 and grads:
                self._clip(grads, lc.max_grad_norm, stats.grad_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
            self._stepped()
        self.steps += 1
        self.model.eval()
        return stats

    def _skip(self, stats: TrainStats, reason: str) -> TrainStats:
        for p in self.params:
            p.grad = None
        if self.masters is not None:
            for m in self.masters:
                m.grad = None
        stats.skipped = True
        stats.reason = reason
        self.model.eval()
        return stats

    # ---- optimizer state in checkpoints ----

    def state_dict(self) -> dict | None:
        if self.opt is None:
            return None
        state = {"optimizer": self.opt.state_dict(), "steps": self.steps}
        if self.mixed:
            state["masters"] = [m.detach().cpu() for m in self.masters]
        return state

    def load_state_dict(self, state: dict) -> None:
        opt = self._optimizer()
        sizes = [len(g["params"]) for g in state["optimizer"]["param_groups"]]
        if len(sizes) != len(opt.param_groups):
            # Parameters added after the optimizer was made (a value head created once the
            # engine had trained) were saved as a group of their own; a trainer built on the
            # loaded model has them in its first: split its parameters as the save did.
            if sum(sizes) != len(self.masters):
                raise ValueError(f"the optimizer state holds {sum(sizes)} parameters, the model "
                                 f"{len(self.masters)}: it belongs to another model")
            groups, k = [], 0
            for n in sizes:
                groups.append({"params": self.masters[k:k + n]})
                k += n
            self.opt = opt = torch.optim.AdamW(groups, lr=0.0, fused=self.cuda)
        if self.mixed:
            with torch.no_grad():
                for m, saved in zip(self.masters, state["masters"]):
                    m.copy_(saved)
        opt.load_state_dict(state["optimizer"])
        self.steps = state.get("steps", 0)
