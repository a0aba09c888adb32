"""The Llama-family decoder (Llama, Qwen2, Qwen3) in plain PyTorch.

Two forward paths share the weights:

* `Transformer.forward` runs whole sequences (training, scoring, prefill) with causal attention.
* `decode_step` runs one token for each row of a static KV cache (generation). Every shape in it is
  fixed for a given (rows, cache length), so a step can be compiled and captured as a CUDA graph.

The projections are fused the way gpt-fast fuses them (q/k/v in one matrix, gate/up in another):
one matrix product instead of three at batch 1, where the step is bound by kernel launches.
`weights.py` maps these names to and from Hugging Face checkpoint names. The arithmetic follows
transformers' modeling code step for step (RMSNorm in fp32 cast back before the weight, rotary
tables in fp32 cast to the activation dtype), which is what the logit-parity test checks.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from . import batch_invariant as bi
from . import lora
from .config import ModelConfig


def linear(x: torch.Tensor, w, b=None) -> torch.Tensor:
    """lora.linear (F.linear with a LoRAWeight's update); batch_invariant.linear in the
    deterministic mode."""
    if bi.enabled():
        return bi.linear(x, w, b)
    return lora.linear(x, w, b)


def bind_thread(device: torch.device) -> None:
    """Makes device the calling thread's current CUDA device. The current device is per thread:
    a thread started by a rank of a multi-GPU worker (rank k on cuda:k) would otherwise launch
    Triton kernels and capture CUDA graphs on cuda:0. A CUDA device has its index here: the
    engine resolves "cuda" to the building thread's GPU (in another thread "cuda" would be GPU 0)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


@torch.no_grad()
def copy_tensors(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """dst[i].copy_(src[i]) for every i (casting where the dtypes differ): one multi-tensor
    launch per few tensors instead of one launch per tensor from Python."""
    if hasattr(torch, "_foreach_copy_"):
        torch._foreach_copy_(dst, src)
    else:
        for d, s in zip(dst, src):
            d.copy_(s)


# ---- the KV cache's storage dtype (engine.Options.kv_cache_dtype) ----
#
# The cache holds keys and values in the model's dtype ("auto") or in float8_e4m3fn ("fp8", as
# vLLM's and SGLang's --kv-cache-dtype fp8 with its default per-tensor scale of 1.0): stored with
# saturation at ±448 (e4m3fn's largest finite value: PyTorch's cast turns anything beyond it into
# NaN), read back into the compute dtype. An fp8 cache is indexed through a uint8 view of it:
# PyTorch's CPU index_copy_ (and not every index kernel on every device) takes no float8.

KV_FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def kv_store(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in the cache's dtype: x itself when it is already; saturated into ±448 for fp8."""
    if x.dtype == dtype:
        return x
    if dtype == KV_FP8:
        x = x.clamp(-FP8_MAX, FP8_MAX)
    return x.to(dtype)


def kv_bytes(t: torch.Tensor) -> torch.Tensor:
    """A cache tensor (or a block of keys or values) for indexed copies: as 8-byte words along its
    last dimension (int64; the last dimension 8 / element size times shorter) where its layout
    allows, else an fp8 tensor as its bytes (not every index kernel takes float8), else itself.
    PyTorch's indexing kernels move one element a thread: a prefill's cache writes and row copies
    move bf16 in words 4× faster (docs/performance.md). Copy only between tensors of the same
    result dtype (kv_source); the cache itself, contiguous, always gives words."""
    r = 8 // t.element_size()
    if r > 1 and t.shape[-1] % r == 0 and t.stride(-1) == 1:
        try:
            return t.view(torch.int64)
        except RuntimeError:  # a stride or offset that is not a whole number of words
            pass
    return t.view(torch.uint8) if t.dtype == KV_FP8 else t


def kv_source(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """x, in cache's dtype (kv_store), viewed as kv_bytes views cache: what may be copied into an
    indexed kv_bytes(cache) (setitem would convert a mismatched dtype's values silently)."""
    want = kv_bytes(cache).dtype
    y = kv_store(x, cache.dtype)
    v = kv_bytes(y)
    if v.dtype != want:
        v = kv_bytes(y.contiguous())
    if v.dtype != want:
        raise TypeError(f"keys of {y.dtype} cannot be copied into a cache viewed as {want}")
    return v


def kv_write(cache: torch.Tensor, index, x: torch.Tensor) -> None:
    """cache[index] = x, x cast into the cache's dtype (kv_store), copied as kv_bytes."""
    kv_bytes(cache)[index] = kv_source(x, cache)


def kv_read(cache: torch.Tensor, index, dtype: torch.dtype) -> torch.Tensor:
    """cache[index] in the compute dtype."""
    if cache.dtype == dtype:
        return cache[index]
    return kv_bytes(cache)[index].view(cache.dtype).to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As transformers: normalise in fp32, cast back, then scale (the order matters in bf16).
    if bi.enabled():
        return bi.rms_norm(x, weight, eps)
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def residual_add(x, y):
    """The residual add x + y, rounded as the eager add in x's dtype, in a form that inductor
    does not turn into cuBLAS's addmm when y is a product: addmm first copies x into its output
    (a copy kernel a residual add: 56 of a batch-256 decode step's 351 kernels on Qwen3-0.6B)
    and rounds the sum once, where transformers rounds the product and then the sum. In the
    deterministic mode on a GPU: one kernel of the same arithmetic (batch_invariant)."""
    if bi.enabled():
        out = bi.residual_add(x, y)
        if out is not None:
            return out
    return (y.float() + x).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., heads, head_dim]; cos, sin: [..., head_dim], broadcast over the heads."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return x * cos + rotate_half(x) * sin


def inv_frequencies(cfg: ModelConfig) -> torch.Tensor:
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if cfg.llama3_rope is None:
        return inv
    factor, low, high, old_len = cfg.llama3_rope
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class Block(nn.Module):
    """One decoder layer: pre-norm attention with grouped-query heads, then a SwiGLU MLP."""

    def __init__(self, cfg: ModelConfig, device=None, dtype=None):
        super().__init__()
        f = dict(device=device, dtype=dtype)
        self.cfg = cfg
        qkv = cfg.q_dim + 2 * cfg.kv_dim
        self.attn_norm = nn.Parameter(torch.ones(cfg.hidden, **f))
        self.wqkv = nn.Parameter(torch.empty(qkv, cfg.hidden, **f))
        self.bqkv = nn.Parameter(torch.zeros(qkv, **f)) if cfg.qkv_bias else None
        self.q_norm = nn.Parameter(torch.ones(cfg.head_dim, **f)) if cfg.qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(cfg.head_dim, **f)) if cfg.qk_norm else None
        self.wo = nn.Parameter(torch.empty(cfg.hidden, cfg.q_dim, **f))
        self.bo = nn.Parameter(torch.zeros(cfg.hidden, **f)) if cfg.o_bias else None
        self.mlp_norm = nn.Parameter(torch.ones(cfg.hidden, **f))
        self.w13 = nn.Parameter(torch.empty(2 * cfg.intermediate, cfg.hidden, **f))  # gate; up
        self.w2 = nn.Parameter(torch.empty(cfg.hidden, cfg.intermediate, **f))

    def weights(self) -> tuple:
        """The layer's tensors in the order decode_layer takes them (None where absent)."""
        return (self.attn_norm, self.wqkv, self.bqkv, self.q_norm, self.k_norm, self.wo, self.bo,
                self.mlp_norm, self.w13, self.w2)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fn=None, **kw):
        """The layer through its module call (fn: block_forward or a compiled copy of it), so
        that hooks on the module run: FSDP2 gathers a sharded layer's weights in them
        (Transformer.call_layers)."""
        return (fn or block_forward)(self.cfg, x, self.weights(), cos, sin, **kw)


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in one kernel (PyTorch's fused CUDA kernel, forward and backward): the weight is
    applied before rounding, so in bf16 it differs from rms_norm in the last bit. Training only."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps).to(x.dtype)


def block_forward(cfg: ModelConfig, x, w: tuple, cos, sin, qkv_fn=None, mlp_fn=None,
                  norm=rms_norm, gqa: bool | None = None):
    """One layer over whole sequences: x [B, T, hidden] → (x, k, v), k and v [B, kv_heads, T, D]
    after rope (what prefill writes into the cache). qkv_fn and mlp_fn replace project_qkv and
    mlp (compiled versions of them: Trainer's regional compile); norm replaces rms_norm. gqa:
    whether the heads are grouped (default: from cfg). Compiled with dynamic shapes, cfg's head
    counts are symbolic and SDPA takes only a bool, so Dynamo breaks the graph around the
    attention; a bool given here (whole_block) is a constant and keeps the layer whole."""
    if bi.enabled() and qkv_fn is None and mlp_fn is None and norm is rms_norm:
        out = bi.layer(cfg, x, w, cos, sin)  # the same numbers, one autograd node
        if out is not None:
            return out
    q, k, v = (qkv_fn or project_qkv)(cfg, w, x, cos, sin, norm)  # [B, T, heads, D]
    if bi.enabled():
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        T = x.shape[1]
        pos = torch.arange(T, device=x.device).expand(x.shape[0], T)
        o = bi.attention(q, k, v, pos, cfg.head_dim ** -0.5, causal=True).flatten(2)
        if mlp_fn is None and norm is rms_norm:
            return after_attention(cfg, w, x, o), k, v
        x = residual_add(x, linear(o, w[5], w[6]))
        return residual_add(x, (mlp_fn or mlp)(cfg, w, x, norm)), k, v
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    o = F.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=cfg.head_dim ** -0.5,
        enable_gqa=cfg.heads != cfg.kv_heads if gqa is None else gqa)
    o = o.transpose(1, 2).flatten(2)
    x = residual_add(x, linear(o, w[5], w[6]))
    return residual_add(x, (mlp_fn or mlp)(cfg, w, x, norm)), k, v


def whole_block(cfg: ModelConfig):
    """block_forward with the grouping of cfg's heads a constant: what the trainer and the
    prefill compile. Traced whole, the attention sits inside the layer's graph; with the
    grouping left to cfg's (symbolic) head counts it would split the graph in two, and the
    training layer would pay three layout copies a layer at the seams (docs/performance.md)."""
    return functools.partial(block_forward, gqa=cfg.heads != cfg.kv_heads)


def project_qkv(cfg: ModelConfig, w: tuple, x, cos, sin, norm=rms_norm):
    """Input → q [..., heads, D], k and v [..., kv_heads, D], normalised, rope applied."""
    return qkv_from_normed(cfg, w, norm(x, w[0], cfg.rms_eps), cos, sin, norm)


def qkv_from_normed(cfg: ModelConfig, w: tuple, h, cos, sin, norm=rms_norm):
    """project_qkv after the layer's input norm (h = norm(x))."""
    q_norm, k_norm = w[3:5]
    q, k, v = decode_pre(cfg, h, w)
    if bi.enabled() and norm is rms_norm:  # on a GPU the norms and rope in one kernel
        qk = bi.qk_rope(q, k, q_norm, k_norm, cos, sin, cfg.rms_eps) if cfg.qk_norm else \
            bi.qk_rope(q, k, None, None, cos, sin, cfg.rms_eps)
        if qk is not None:
            return qk[0], qk[1], v
    if cfg.qk_norm:
        q, k = norm(q, q_norm, cfg.rms_eps), norm(k, k_norm, cfg.rms_eps)
    if bi.enabled():  # one kernel a tensor on a GPU, the same numbers
        return bi.rope(q, cos, sin, apply_rope), bi.rope(k, cos, sin, apply_rope), v
    cos, sin = cos.to(h.dtype), sin.to(h.dtype)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def mlp(cfg: ModelConfig, w: tuple, x, norm=rms_norm):
    return mlp_from_normed(cfg, w, norm(x, w[7], cfg.rms_eps))


def mlp_from_normed(cfg: ModelConfig, w: tuple, h):
    """mlp after its norm (h = norm(x))."""
    w13, w2 = w[8:]
    gu = linear(h, w13)
    if bi.enabled():  # the same operations; on a GPU the backward pass in one kernel
        a = bi.swiglu(gu)
        if a is not None:
            return linear(a, w2)
    gate, up = gu.chunk(2, dim=-1)
    return linear(F.silu(gate) * up, w2)


def after_attention(cfg: ModelConfig, w: tuple, x, o):
    """The deterministic layer after its attention output o: x + o's projection, then that plus
    the MLP of its norm; on a GPU the add and the norm in one kernel (bi.add_rms_norm), in every
    pass alike (decode steps, prefills, Score, training)."""
    y = linear(o, w[5], w[6])
    both = bi.add_rms_norm(x, y, w[7], cfg.rms_eps)
    if both is None:
        x = residual_add(x, y)
        return residual_add(x, mlp(cfg, w, x))
    x, h = both
    return residual_add(x, mlp_from_normed(cfg, w, h))


def decode_layer(cfg: ModelConfig, x, w: tuple, k_cache, v_cache, pos, mask, cos, sin):
    """One layer for one new token in each of the first B cache rows.

    x: [B, hidden]; k_cache, v_cache: the layer's whole cache [slots, kv_heads, max_len, D];
    pos: [B] the positions the new tokens are written at; mask: [B, L], True where a key is
    visible; attention reads positions [0, L) only. The cache is updated in place, which a
    compiled version of this function does in place too (the pattern gpt-fast relies on).
    """
    B, L = x.shape[0], mask.shape[1]
    q, k, v = project_qkv(cfg, w, x, cos, sin)  # [B, heads, D]
    # (The deterministic mode on a GPU: both writes in one kernel, the same bytes.)
    if not (bi.enabled() and bi.kv_write_rows(k_cache, v_cache, pos, k, v)):
        rows = torch.arange(B, device=x.device)
        kv_write(k_cache, (rows, slice(None), pos), k)
        kv_write(v_cache, (rows, slice(None), pos), v)
    keys = kv_read(k_cache, (slice(None, B), slice(None), slice(None, L)), x.dtype)
    values = kv_read(v_cache, (slice(None, B), slice(None), slice(None, L)), x.dtype)
    if bi.enabled():
        o = bi.attention(q[:, None], keys, values, pos[:, None], cfg.head_dim ** -0.5)
        return after_attention(cfg, w, x, o.reshape(B, cfg.q_dim))
    # Grouped-query attention as two batched products: the query heads of one key/value head form
    # the rows of one small matrix, so the cache is read once per key/value head, never copied.
    group = cfg.heads // cfg.kv_heads
    qg = q.view(B, cfg.kv_heads, group, cfg.head_dim)
    scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * cfg.head_dim ** -0.5
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    o = torch.matmul(probs, values).reshape(B, cfg.q_dim)
    wo, bo = w[5], w[6]
    x = residual_add(x, linear(o, wo, bo))
    return residual_add(x, mlp(cfg, w, x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, device=None, dtype=torch.float32):
        super().__init__()
        f = dict(device=device, dtype=dtype)
        self.cfg = cfg
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden, **f))
        self.layers = nn.ModuleList(Block(cfg, **f) for _ in range(cfg.layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden, **f))
        self.lm_head = None if cfg.tie_embeddings else nn.Parameter(
            torch.empty(cfg.vocab_size, cfg.hidden, **f))
        # A PPO critic's value head (hidden → 1), added by add_value_head; saved as score.*,
        # the names of transformers' *ForTokenClassification heads with one label.
        self.score = None
        self.score_bias = None
        # Rotary tables in fp32 for every position, computed the way transformers computes them.
        angles = torch.arange(cfg.max_seq_len, dtype=torch.float32)[:, None] * inv_frequencies(cfg)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos().to(device), persistent=False)
        self.register_buffer("sin", angles.sin().to(device), persistent=False)
        self.grad_checkpointing = False
        # The layer function of training passes: block_forward, or a compiled version of it
        # (engine.Options.compile_train on a GPU), and its RMSNorm (rms_norm, or fused_rms_norm
        # on a GPU). Inference passes (prefill, score) run block_forward with rms_norm.
        self.train_block_fn = block_forward
        self.train_norm = rms_norm
        # Training passes call each layer as a module (Block.forward), not its function on its
        # weights: set on a model whose layers FSDP2 shards (dist.py), whose hooks must run.
        self.call_layers = False
        # LoRA adapters applied by the passes (lora.One or lora.Rows; None: the base alone),
        # set for the length of a call with `using`.
        self.lora = None

    @contextlib.contextmanager
    def using(self, sel):
        """Runs the model's passes with the adapters of sel (lora.One / lora.Rows / None)."""
        saved, self.lora = self.lora, sel
        try:
            yield
        finally:
            self.lora = saved

    def layer_weights(self, i: int) -> tuple:
        """Layer i's weights (Block.weights), with the selected adapters' updates."""
        w = self.layers[i].weights()
        if self.lora is None:
            return w
        if bi.enabled():  # the updates in the arithmetic of One and Rows alike
            return bi.lora_weights(self.lora, self, i, w)
        return self.lora.weights(self, i, w)

    def init_weights(self, generator: torch.Generator, std: float = 0.02) -> None:
        """Random initialisation (make-model): normal(0, std) matrices, unit norms, zero biases."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.ndim == 2:
                    p.copy_(torch.randn(p.shape, generator=generator) * std)
                elif "norm" in name:
                    p.fill_(1.0)
                else:
                    p.zero_()

    def add_value_head(self) -> list[nn.Parameter]:
        """Creates a zero value head (every value starts at 0); returns its new parameters."""
        f = dict(device=self.embed.device, dtype=self.embed.dtype)
        self.score = nn.Parameter(torch.zeros(1, self.cfg.hidden, **f))
        self.score_bias = nn.Parameter(torch.zeros(1, **f))
        return [self.score, self.score_bias]

    def values(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden states [..., hidden] → values [...] (fp32)."""
        return F.linear(hidden, self.score, self.score_bias).float().squeeze(-1)

    @property
    def head_weight(self) -> torch.Tensor:
        return self.embed if self.lm_head is None else self.lm_head

    def forward(self, tokens: torch.Tensor, kv_sink=None, block_fn=None) -> torch.Tensor:
        """tokens: [B, T] → final hidden states [B, T, hidden] (after the last norm).

        Rows may be right-padded: causal attention keeps padding from reaching real tokens.
        kv_sink(layer, k, v), when given, receives every layer's keys and values (prefill).
        block_fn: the layer function of an inference pass without adapters (default
        block_forward: the transformers-order arithmetic; the generator's prefill passes a
        compiled copy).
        """
        T = tokens.shape[1]
        x = F.embedding(tokens, self.embed)
        cos, sin = self.cos[:T], self.sin[:T]
        train = self.training
        # Adapters run the eager layer, but for an inference pass under a selection whose
        # weights are tuples of tensors a compiled layer takes as they are (lora.Slots' Packed:
        # the prefill's under the adapters' table, with lora.PREFILL_COMPILED, the default).
        fn = block_forward
        if self.lora is None:
            fn = self.train_block_fn if train else (block_fn or block_forward)
        elif not train and block_fn is not None and getattr(self.lora, "compiled_ok", False):
            fn = block_fn
        kw = {"norm": self.train_norm} if train and self.train_norm is not rms_norm else {}
        for i, layer in enumerate(self.layers):
            if self.call_layers and train and self.lora is None:
                if self.grad_checkpointing:
                    x, k, v = checkpoint(layer, x, cos, sin, fn=fn, use_reentrant=False, **kw)
                else:
                    x, k, v = layer(x, cos, sin, fn=fn, **kw)
            elif self.grad_checkpointing and train:
                x, k, v = checkpoint(fn, self.cfg, x, self.layer_weights(i), cos, sin,
                                     use_reentrant=False, **kw)
            else:
                x, k, v = fn(self.cfg, x, self.layer_weights(i), cos, sin, **kw)
            if kv_sink is not None:
                kv_sink(i, k, v)
        return (self.train_norm if train else rms_norm)(x, self.norm, self.cfg.rms_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if bi.enabled():
            return bi.linear(hidden, self.head_weight)
        return F.linear(hidden, self.head_weight)


def decode_step(model: Transformer, layer_fn, tokens, pos, k_caches, v_caches, L: int):
    """One generated token for each of B cache rows → final hidden states [B, hidden].

    tokens, pos: [B]; k_caches[i], v_caches[i]: layer i's whole cache; attention reads positions
    [0, L). layer_fn is decode_layer, or a compiled version of it (one function serves every
    layer because the layer's weights are arguments, so it is compiled once).
    """
    x = F.embedding(tokens, model.embed)
    cos, sin = model.cos[pos], model.sin[pos]
    mask = torch.arange(L, device=pos.device)[None, :] <= pos[:, None]
    for i, (kc, vc) in enumerate(zip(k_caches, v_caches)):
        x = layer_fn(model.cfg, x, model.layer_weights(i), kc, vc, pos, mask, cos, sin)
    return rms_norm(x, model.norm, model.cfg.rms_eps)


# ---- decode with Triton attention (kernels.py): each layer is split around the attention ----

def decode_pre(cfg: ModelConfig, h, w: tuple):
    """The layer's normalised input h [..., hidden] → the raw projections q [..., heads, D], k
    and v [..., kv_heads, D] (views of one product). The decode step's first half: the Triton
    attention applies the q/k norm and rope itself (kernels.decode_attention's rope), two kernels
    a layer fewer than qkv_from_normed, which builds on this."""
    q, k, v = linear(h, w[1], w[2]).split([cfg.q_dim, cfg.kv_dim, cfg.kv_dim], dim=-1)
    return (q.unflatten(-1, (cfg.heads, cfg.head_dim)),
            k.unflatten(-1, (cfg.kv_heads, cfg.head_dim)),
            v.unflatten(-1, (cfg.kv_heads, cfg.head_dim)))


def decode_post(cfg: ModelConfig, x, o, w: tuple, next_norm):
    """After attention: x + o-projection + MLP → (x, the next layer's normalised input), so a
    compiled version fuses the residual add with the next norm."""
    x = residual_add(x, linear(o, w[5], w[6]))
    x = residual_add(x, mlp(cfg, w, x))
    return x, rms_norm(x, next_norm, cfg.rms_eps)


def decode_step_split(model: Transformer, pre_fn, post_fn, attn_fn, tokens, pos, k_caches,
                      v_caches, L: int):
    """decode_step with the attention outside the layer functions: pre_fn (decode_pre) and
    post_fn (decode_post) may be compiled, attn_fn is kernels.decode_attention (it applies the
    q/k norm and rope, and writes the new key and value into the cache). The layers' weights
    carry the adapters of model.lora as decode_step's do. Returns the final normalised hidden
    states [B, hidden]."""
    cfg = model.cfg
    B = tokens.shape[0]
    x = F.embedding(tokens, model.embed)
    layers = model.layers
    h = rms_norm(x, layers[0].attn_norm, cfg.rms_eps)
    scale = cfg.head_dim ** -0.5
    for i, (layer, kc, vc) in enumerate(zip(layers, k_caches, v_caches)):
        w = model.layer_weights(i)  # with the adapters of model.lora (lora.Slots: tensors only)
        q, k, v = pre_fn(cfg, h, w)
        o = attn_fn(q, k, v, kc, vc, pos, L, scale,
                    rope=(w[3], w[4], model.cos, model.sin, cfg.rms_eps))
        nxt = layers[i + 1].attn_norm if i + 1 < len(layers) else model.norm
        x, h = post_fn(cfg, x, o.reshape(B, cfg.q_dim), w, nxt)
    return h


def decode_step_b1(model: Transformer, kernels, tokens, pos, k_caches, v_caches, L: int):
    """One token of cache row 0 in Triton kernels (kernels.py): per layer a fused norm + q/k/v
    product, q/k norm + rope + attention (writing the cache), o-projection + residual, fused norm
    + gate/up + SwiGLU, down projection + residual; then the final norm fused with the output
    head. Returns the logits [1, vocab] in the model's dtype."""
    cfg = model.cfg
    dev, dt = tokens.device, model.embed.dtype
    H, KV, D = cfg.heads, cfg.kv_heads, cfg.head_dim
    x = F.embedding(tokens[:1], model.embed)[0]
    x2 = torch.empty_like(x)
    qkv = torch.empty(cfg.q_dim + 2 * cfg.kv_dim, dtype=dt, device=dev)
    a = torch.empty(cfg.intermediate, dtype=dt, device=dev)
    q = qkv[:cfg.q_dim].view(1, H, D)
    k = qkv[cfg.q_dim:cfg.q_dim + cfg.kv_dim].view(1, KV, D)
    v = qkv[cfg.q_dim + cfg.kv_dim:].view(1, KV, D)
    scale = D ** -0.5
    eps = cfg.rms_eps
    for layer, kc, vc in zip(model.layers, k_caches, v_caches):
        (attn_norm, wqkv, bqkv, q_norm, k_norm, wo, bo, mlp_norm, w13, w2) = layer.weights()
        kernels.gemv(x, wqkv, qkv, bias=bqkv, norm_w=attn_norm, eps=eps)
        o = kernels.decode_attention(q, k, v, kc, vc, pos, L, scale,
                                     rope=(q_norm, k_norm, model.cos, model.sin, eps))
        kernels.gemv(o.view(-1), wo, x2, bias=bo, res=x)
        kernels.gemv(x2, w13, a, norm_w=mlp_norm, eps=eps, swiglu=True)
        kernels.gemv(a, w2, x, res=x2)
    logits = torch.empty(1, cfg.vocab_size, dtype=dt, device=dev)
    kernels.gemv(x, model.head_weight, logits[0], norm_w=model.norm, eps=eps)
    return logits
