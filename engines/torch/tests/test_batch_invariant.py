"""Deterministic mode on the CPU (issue 38): a row's logits and sampled tokens are the same
whatever else is in its batch and however its cache row is laid out, the trainer's log-probs
equal the rollout's bit for bit (with LoRA and the prefix cache too), and the checks fail when an
invariant kernel is swapped for a plain one."""

import os

import pytest
import torch

from slimen_torch import batch_invariant as bi
from slimen_torch import lora
from slimen_torch.engine import Engine, Options
from slimen_torch.model import decode_layer, decode_step
from slimen_torch.types import Batch, GenerateRequest, LossConfig, Sample, Sampling, ScoreRequest


def plain_matmul(x, w):
    """A product that is not batch-invariant, as the default mode's is not: its reduction along K
    is split by the row count, as GPU libraries choose split-K by shape. torch's own product on the
    CPU also depends on the row count (a matrix-vector kernel for one row), but whether it does is
    the BLAS's choice, which another CPU may make otherwise; this one differs on every machine."""
    k = x.shape[-1]
    if x.reshape(-1, k).shape[0] <= 1:
        return x @ w.t()
    h = k // 2
    return x[..., :h] @ w[:, :h].t() + x[..., h:] @ w[:, h:].t()


@pytest.fixture
def swap_matmul(monkeypatch):
    """Swaps the invariant product of deterministic mode for the plain one."""
    monkeypatch.setattr(bi, "_MATMUL", plain_matmul)


# ---- the functions ----

def test_tree_sum_is_the_same_for_any_padding_and_batch():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 37, generator=g)
    alone = torch.stack([bi.tree_sum(x[i:i + 1])[0] for i in range(5)])
    assert torch.equal(bi.tree_sum(x), alone)
    # Zeros past a row's entries (a longer cache, padding) change nothing, bit for bit.
    padded = torch.cat([x, torch.zeros(5, 90)], dim=1)
    assert torch.equal(bi.tree_sum(padded), bi.tree_sum(x))
    assert torch.allclose(bi.tree_sum(x), x.double().sum(-1).float(), atol=1e-5)
    assert torch.allclose(bi.prefix_sum(x), x.cumsum(-1), atol=1e-5)
    assert torch.equal(bi.prefix_sum(x[3:4]), bi.prefix_sum(x)[3:4])


def test_the_invariant_product_does_not_depend_on_the_row_count():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(96, 64, generator=g)
    x = torch.randn(33, 64, generator=g)
    full = bi.matmul(x, w)
    assert torch.allclose(full, x @ w.t(), atol=1e-5)
    for rows in ([0], [5, 6], list(range(1, 33, 3))):
        assert torch.equal(bi.matmul(x[rows], w), full[rows])
    # The swap tests' plain product does depend on it.
    assert not torch.equal(torch.stack([plain_matmul(x[i:i + 1], w)[0] for i in range(33)]),
                           plain_matmul(x, w))


def test_rms_norm_and_log_probs_are_row_invariant():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 48, generator=g)
    w = torch.randn(48, generator=g)
    n = bi.rms_norm(x, w, 1e-6)
    assert torch.equal(bi.rms_norm(x[4:5], w, 1e-6), n[4:5])
    logits = torch.randn(9, 700, generator=g)
    t = torch.randint(0, 700, (9,), generator=g)
    lp = bi.token_logprobs(logits, t)
    assert torch.equal(bi.token_logprobs(logits[2:3], t[2:3]), lp[2:3])
    ref = torch.log_softmax(logits, -1).gather(1, t[:, None])[:, 0]
    assert torch.allclose(lp, ref, atol=1e-5)


def test_the_sampler_draws_a_row_alike_in_any_batch():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 2048, generator=g) * 3
    temp = torch.tensor([1.0, 0.7, 0.0, 1.0, 1.3, 1.0])
    top_p = torch.tensor([1.0, 0.9, 1.0, 0.5, 1.0, 1.0])
    u = torch.rand(6, generator=g)
    tok, lp = bi.sample(logits, temp, top_p, u, True)
    for i in range(6):
        t1, l1 = bi.sample(logits[i:i + 1], temp[i:i + 1], top_p[i:i + 1], u[i:i + 1],
                           bool(top_p[i] < 1))
        assert t1.item() == tok[i].item() and torch.equal(l1, lp[i:i + 1])
    assert torch.equal(tok[2], logits[2].argmax())


def test_attention_is_the_same_for_any_cache_length_and_batch():
    g = torch.Generator().manual_seed(5)
    B, T, H, KV, D = 3, 150, 4, 2, 16
    q = torch.randn(B, T, H, D, generator=g)
    k = torch.randn(B, KV, T, D, generator=g)
    v = torch.randn(B, KV, T, D, generator=g)
    pos = torch.arange(T).expand(B, T)
    o = bi.attention(q, k, v, pos, 0.25)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k, v, is_causal=True, scale=0.25, enable_gqa=True).transpose(1, 2)
    assert torch.allclose(o, ref, atol=1e-5)
    # One query of row 1 at position 100 (a decode step) over a longer cache holding garbage past
    # its position, alone: bit for bit what the whole sequence gave it.
    kc = torch.cat([k[1:2], torch.full((1, KV, 60, D), float("nan"))], dim=2)
    vc = torch.cat([v[1:2], torch.full((1, KV, 60, D), float("nan"))], dim=2)
    kc[:, :, 101:] = float("nan")
    vc[:, :, 101:] = float("nan")
    one = bi.attention(q[1:2, 100:101], kc, vc, torch.tensor([[100]]), 0.25)
    assert torch.equal(one, o[1:2, 100:101])


# ---- the model: generation and training paths ----

@pytest.fixture(scope="module")
def det_engine(model_dirs):
    e = Engine(str(model_dirs["tiny-qwen3"]), Options(device="cpu", deterministic=True))
    yield e
    e.close()


def decode_logits(model, prompts, row_of, steps_at):
    """Each prompt prefilled into cache row row_of[i] of a cache of 8 rows × 256 positions
    (Transformer.forward with a sink), then one decode step of all rows at once, whose logits are
    returned in the prompts' order. steps_at: the cache length the step attends over."""
    cfg = model.cfg
    shape = (8, cfg.kv_heads, 256, cfg.head_dim)
    ks = [torch.full(shape, float("nan")) for _ in range(cfg.layers)]
    vs = [torch.full(shape, float("nan")) for _ in range(cfg.layers)]
    B = max(row_of) + 1
    tok = torch.zeros(B, dtype=torch.long)
    pos = torch.zeros(B, dtype=torch.long)
    for p, r in zip(prompts, row_of):
        def sink(i, k, v, r=r, n=len(p) - 1):
            ks[i][r, :, :n] = k[0, :, :n]
            vs[i][r, :, :n] = v[0, :, :n]
        model(torch.tensor([p[:-1]]), kv_sink=sink)
        tok[r], pos[r] = p[-1], len(p) - 1
    for r in range(B):
        if r not in row_of:  # an idle row: some other prompt's state
            tok[r], pos[r] = 7, 3
            for i in range(cfg.layers):
                ks[i][r, :, :4] = 0.5
                vs[i][r, :, :4] = -0.5
    hidden = decode_step(model, decode_layer, tok, pos, ks, vs, steps_at)
    logits = model.logits(hidden)
    return [logits[r] for r in row_of]


def invariance_gap(model, prompts) -> float:
    """The largest difference between a prompt's next-token logits computed (a) by the training
    forward over the whole prompt, (b) decoded alone in row 0 over a short cache, (c) decoded in
    a batch with the others in another row over a longer cache. 0 in the deterministic mode."""
    with torch.no_grad(), bi.mode():
        full = [model.logits(model(torch.tensor([p]))[0, -1]) for p in prompts]
        alone = [decode_logits(model, [p], [0], len(p))[0] for p in prompts]
        rows = [5, 1, 3][:len(prompts)]
        batch = decode_logits(model, prompts, rows, 200)
    gap = 0.0
    for f, a, b in zip(full, alone, batch):
        gap = max(gap, (f - a).abs().max().item(), (f - b).abs().max().item())
    return gap


PROMPTS = [list(range(3, 90)), [5, 9, 11, 4, 30, 31], list(range(100, 170, 2))]


def test_logits_are_the_same_across_paths_batches_and_cache_rows(det_engine):
    assert invariance_gap(det_engine.model, PROMPTS) == 0.0


def test_a_plain_product_breaks_the_invariance(det_engine, swap_matmul):
    assert invariance_gap(det_engine.model, PROMPTS) > 0.0


def test_a_plain_attention_breaks_the_invariance(det_engine, monkeypatch):
    # The default mode's attention: SDPA over the sequence, a softmax over the whole cache row
    # in decode. Computed here by PyTorch's SDPA with a mask over [0, L).
    def plain(q, k, v, q_pos, scale, causal=False):
        mask = torch.arange(k.shape[2])[None, None, :] <= q_pos[:, :, None]
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), torch.nan_to_num(k), torch.nan_to_num(v), attn_mask=mask[:, None],
            scale=scale, enable_gqa=True).transpose(1, 2)
    monkeypatch.setattr(bi, "attention", plain)
    assert invariance_gap(det_engine.model, PROMPTS) > 0.0


# ---- the engine: sampled tokens, and the trainer's log-probs ----

def req(rid, prompt, seed, n=1, adapter=""):
    return GenerateRequest(id=rid, prompt_tokens=prompt, n=n, adapter=adapter,
                           sampling=Sampling(max_tokens=12, temperature=1.0, seed=seed))


def sampled(e: Engine, reqs):
    return {(c.request_id, c.index): (c.tokens, c.logprobs) for c in e.generate(reqs)}


def engine_gap(e: Engine, adapter="") -> tuple[bool, float]:
    """(whether request a's samples are the same alone and in a batch of others, the largest
    |score − rollout log-prob| of a batch's samples)."""
    a = req("a", PROMPTS[0], 7, n=2, adapter=adapter)
    alone = sampled(e, [a])
    mixed = sampled(e, [req("x", PROMPTS[1], 1), a, req("y", PROMPTS[2], 2, n=3, adapter=adapter)])
    same = all(mixed[k] == v for k, v in alone.items())
    gap = 0.0
    for (rid, _), (toks, lps) in mixed.items():
        prompt = {"a": PROMPTS[0], "x": PROMPTS[1], "y": PROMPTS[2]}[rid]
        adp = "" if rid == "x" else adapter
        got = e.score([ScoreRequest(tokens=toks, prompt_tokens=prompt, adapter=adp)])[0]
        gap = max(gap, max(abs(x - y) for x, y in zip(got, lps)))
    return same, gap


def test_samples_do_not_depend_on_their_batch_and_scores_equal_them(det_engine):
    same, gap = engine_gap(det_engine)
    assert same and gap == 0.0


def test_with_lora(det_engine):
    e = det_engine
    if "p" not in e.adapter_names():
        e.add_adapter("p", lora.LoRAConfig(rank=4, alpha=8, targets=("q_proj", "v_proj",
                                                                     "down_proj")), 3)
        # One step so that B is no longer zero (a fresh adapter changes nothing).
        c = e.generate([req("t", PROMPTS[1], 5, n=2, adapter="p")])
        b = Batch(samples=[Sample(x.prompt_tokens, x.tokens, [1.0] * len(x.tokens),
                                  list(x.logprobs), [1.0 if x.index else -1.0] * len(x.tokens))
                           for x in c], loss=LossConfig(lr=5e-2), adapter="p")
        e.train(b)
    same, gap = engine_gap(e, adapter="p")
    assert same and gap == 0.0
    # Training: the step's mismatch, from its own forward, is 0.
    c = e.generate([req("t2", PROMPTS[2], 6, n=3, adapter="p")])
    b = Batch(samples=[Sample(x.prompt_tokens, x.tokens, [1.0] * len(x.tokens), list(x.logprobs),
                              [0.5] * len(x.tokens)) for x in c],
              loss=LossConfig(lr=1e-3), adapter="p")
    st = e.train(b)
    assert st.tokens > 0 and st.logprob_diff_max == 0.0


def test_a_plain_product_breaks_the_engine_checks(det_engine, swap_matmul):
    same, gap = engine_gap(det_engine)
    assert not same or gap > 0.0


def test_deterministic_mode_refuses_an_fp8_cache(model_dirs):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        Engine(str(model_dirs["tiny-qwen3"]), Options(device="cpu", deterministic=True,
                                                       kv_cache_dtype="fp8"))



def test_the_training_micro_batch_is_as_large_as_free_memory_allows(model_dirs, monkeypatch):
    # The deterministic mode's micro-batches: the largest of 16,384 / 12,288 / 8,192 / 4,096
    # tokens whose pass (saved activations, the whole logits and their gradient) fits half of
    # the free memory; 4,096 without a GPU's free memory or with the switch off, and the
    # option's own value when given. Qwen3-0.6B's shape in bf16: ~2.2 MB a token.
    from types import SimpleNamespace

    from slimen_torch import engine as engine_mod
    from slimen_torch import train
    cfg = SimpleNamespace(hidden=1024, q_dim=2048, kv_dim=1024, intermediate=3072, layers=28,
                          vocab_size=151936)
    gb = 1 << 30
    assert train.pass_bytes_per_token(cfg, 2) == 2 * (28 * 27648 + 2 * 151936)
    for free, want in ((80 * gb, 16384), (60 * gb, 12288), (40 * gb, 8192), (10 * gb, 4096),
                       (None, 4096)):
        assert train.deterministic_micro_batch_tokens(cfg, 2, free) == want
    monkeypatch.setattr(train, "MICRO_BATCH_BY_MEMORY", False)
    assert train.deterministic_micro_batch_tokens(cfg, 2, 80 * gb) == 4096
    monkeypatch.setattr(train, "MICRO_BATCH_BY_MEMORY", True)
    # The engine asks once its cache is made (here a CPU engine told of a large free memory).
    monkeypatch.setattr(engine_mod, "free_memory", lambda device: 1 << 40)
    d = str(model_dirs["tiny-qwen3"])
    got = {}
    for det, mbt in ((True, 0), (True, 2048), (False, 0)):
        e = Engine(d, Options(device="cpu", deterministic=det, micro_batch_tokens=mbt))
        try:
            got[det, mbt] = e.trainer.micro_batch_tokens
            if det and not mbt:
                # A row's log-probs are the same in a micro-batch of 16,384 tokens and alone.
                pairs = [ScoreRequest(tokens=list(range(40, 40 + 9 + i)),
                                      prompt_tokens=list(range(3, 30 + 11 * i)))
                         for i in range(3)]
                big = e.score(pairs)
                e.trainer.micro_batch_tokens = 1
                assert e.score(pairs) == big
        finally:
            e.close()
    assert got == {(True, 0): 16384, (True, 2048): 2048, (False, 0): 4096}

# ---- the Triton kernels (a GPU's path), on the CPU under Triton's interpreter ----

@pytest.fixture
def interpreted():
    if not (bi.HAVE_TRITON and os.environ.get("TRITON_INTERPRET") == "1"):
        pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1, conftest's without a GPU)")


@pytest.mark.parametrize("split", [1, 2])
def test_the_triton_product_keeps_a_row_whatever_the_row_count(interpreted, monkeypatch, split):
    # The tile shape is the same for every M: a row's K-reduction is the same, so the leading
    # rows of a product and a single row give what the whole product gave them. (Whether a row
    # in another position of a tile gives the same is the GPU's matrix instruction's property,
    # which determinism.py checks on the device; the interpreter's NumPy product is not that.)
    # The same with K split in 2 parts (--split-k: 3 and 2 steps of 64, each part's sum from 0,
    # then the two added), which is not the unsplit sum.
    monkeypatch.setattr(bi, "SPLIT_K", split)
    monkeypatch.setattr(bi, "SPLIT_K_MIN", 100)
    g = torch.Generator().manual_seed(6)
    for K in (40, 300):
        x = torch.randn(70, K, generator=g)
        w = torch.randn(24, K, generator=g)
        y = bi.matmul_triton(x, w, torch.float32)
        assert torch.allclose(y, x @ w.t(), atol=1e-4)
        for k in (1, 5, 64):
            assert torch.equal(bi.matmul_triton(x[:k], w, torch.float32), y[:k])
        assert torch.equal(bi.matmul_triton(x[69:70], w, torch.float32), y[69:70])
        if split > 1 and K > 100:
            monkeypatch.setattr(bi, "SPLIT_K", 1)
            whole = bi.matmul_triton(x, w, torch.float32)
            monkeypatch.setattr(bi, "SPLIT_K", split)
            assert torch.allclose(whole, y, atol=1e-4) and not torch.equal(whole, y)


@pytest.mark.parametrize("form", [f for f in bi.MATMUL_FORMS if f != "plain"])
def test_the_tma_forms_give_the_plain_products(interpreted, monkeypatch, form):
    # The Hopper forms (MATMUL_FORM) index, group, walk and store the tiles as the plain kernel
    # does: the same outputs (under the interpreter its NumPy products, on sm_90 bench_tiles.py
    # --forms compares the bits), with ragged edges in M, N and K (the TMA unit's zero fill for
    # the masks' zeros), groups of 2 row blocks (the last one short), a tile's columns stored
    # whole or in two halves, several tiles a persistent program (4 under the interpreter), and
    # a row's numbers whatever the row count. fp32 operands here (the interpreter's bf16
    # products read the bits); strides of 16 bytes.
    monkeypatch.setattr(bi, "GROUP_M", 2)
    g = torch.Generator().manual_seed(16)
    tile = (32, 32, 16, 4, 3)
    for M, N, K in ((70, 96, 200), (130, 40, 16), (5, 132, 36)):
        x = torch.randn(M, K, generator=g)
        w = torch.randn(N, K, generator=g)
        ref = torch.empty(M, N)
        bi.matmul_tiled(x, w, ref, tile)
        for sub in (1, 2):
            monkeypatch.setattr(bi, "EPILOGUE_SUBTILE", sub)
            y = torch.full((M, N), 7.0)
            bi.matmul_tiled(x, w, y, tile, form)
            assert torch.equal(y, ref), (M, N, K, sub)
        one = torch.full((1, N), 7.0)
        bi.matmul_tiled(x[M - 1:].clone(), w, one, tile, form)
        assert torch.equal(one, ref[M - 1:])
    with pytest.raises(ValueError):
        bi.matmul_tiled(x, w, y, tile, "swizzled")


def test_the_products_form_is_chosen_by_rows_and_layout(monkeypatch):
    # MATMUL_FORM takes products of FORM_MIN_M rows or more whose operands TMA descriptors can
    # describe (bf16/fp16, contiguous columns, 16-byte aligned base and row strides); every
    # other product, and every product with the form plain, the plain kernel.
    def form(x, w=None, y=None):
        w = torch.zeros(64, 64, dtype=x.dtype) if w is None else w
        y = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype) if y is None else y
        return bi._form(x, w, y)

    m = bi.FORM_MIN_M
    x = torch.zeros(m, 64, dtype=torch.bfloat16)
    monkeypatch.setattr(bi, "MATMUL_FORM", "plain")
    assert form(x) == "plain"
    monkeypatch.setattr(bi, "MATMUL_FORM", "persistent")
    assert form(x) == "persistent"
    assert form(torch.zeros(m, 64, dtype=torch.float16)) == "persistent"
    assert form(x, y=torch.empty(m, 64)) == "persistent"  # an fp32 output
    assert form(x[:m - 1]) == "plain"  # fewer rows: a decode step's
    assert form(x.float()) == "plain"  # fp32 operands: the plain kernel's IEEE products
    assert form(x, w=torch.zeros(64, 64, dtype=torch.float16)) == "plain"
    wide = torch.zeros(m, 65, dtype=torch.bfloat16)
    assert form(wide[:, 1:]) == "plain"  # a row stride of 130 bytes
    flat = torch.zeros(m * 64 + 1, dtype=torch.bfloat16)
    assert form(flat[1:].view(m, 64)) == "plain"  # a base 2 bytes past an aligned one
    assert form(torch.zeros(64, m, dtype=torch.bfloat16).t()) == "plain"  # strided columns
    assert form(x, y=torch.empty(m, 128, dtype=torch.bfloat16)[:, :64]) == "persistent"
    assert form(x, y=torch.empty(m, 72, dtype=torch.bfloat16)[:, 1:65]) == "plain"
    # A GPU other than Hopper (sm_90): no TMA before it, unchecked bits after it.
    monkeypatch.setattr(bi, "_hopper", lambda device: False)
    assert form(x) == "plain"


def test_the_products_take_the_form_where_chosen(interpreted, monkeypatch):
    # matmul_triton sends a product that _form gives a Hopper form to that form's kernel, in
    # the product's tile; the others to the plain kernel (here the TMA kernels are recorded, not
    # run: the interpreter's bf16 products are not the GPU's).
    calls = []
    monkeypatch.setattr(bi, "_matmul_tma", lambda x, w, y, tile, form: calls.append(
        (x.shape[0], tile, form)) or y.zero_())
    monkeypatch.setattr(bi, "MATMUL_FORM", "tma")
    monkeypatch.setattr(bi, "FORM_MIN_M", 32)
    g = torch.Generator().manual_seed(17)
    w = torch.randn(48, 64, generator=g).bfloat16()
    x = torch.randn(40, 64, generator=g).bfloat16()
    assert torch.equal(bi.matmul_triton(x, w, torch.bfloat16), torch.zeros(40, 48))
    assert calls == [(40, bi._tile(40, 48, 64), "tma")]
    bi.matmul_triton(x[:31], w, torch.bfloat16)  # fewer rows: the plain kernel
    bi.matmul_triton(x.float(), w.float(), torch.float32)
    assert len(calls) == 1

def test_the_triton_attention_is_the_same_for_any_cache(interpreted):
    g = torch.Generator().manual_seed(7)
    B, T, H, KV, D = 1, 70, 2, 1, 8
    q = torch.randn(B, T, H, D, generator=g)
    k = torch.randn(B, KV, T, D, generator=g)
    v = torch.randn(B, KV, T, D, generator=g)
    o = bi.attention_triton(q, k, v, torch.arange(T)[None], 0.3)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k, v, is_causal=True, scale=0.3, enable_gqa=True).transpose(1, 2)
    assert torch.allclose(o, ref, atol=1e-5)
    # The query at position 66 (past the first 64-position chunk) decoded over a longer cache
    # row holding NaN past it: what the whole sequence gave it.
    kc = torch.cat([k, torch.full((1, KV, 20, D), float("nan"))], dim=2)
    vc = torch.cat([v, torch.full((1, KV, 20, D), float("nan"))], dim=2)
    kc[:, :, 67:] = vc[:, :, 67:] = float("nan")
    one = bi.attention_triton(q[:, 66:67].contiguous(), kc, vc, torch.tensor([[66]]), 0.3)
    assert torch.equal(one, o[:, 66:67])


def test_a_cached_prefix_changes_nothing(model_dirs):
    # A second turn whose prompt extends the first's is prefilled from the kept row (only its new
    # tokens run, attending to the cached keys): the same tokens and log-probs, bit for bit, as
    # the whole prompt prefilled cold, with a LoRA adapter too.
    e = Engine(str(model_dirs["tiny-qwen3"]), Options(device="cpu", deterministic=True,
                                                       prefix_cache=8, prefix_min=4))
    try:
        e.add_adapter("p", lora.LoRAConfig(rank=4, alpha=8, targets=("q_proj", "o_proj")), 3)
        c = e.generate([req("t", PROMPTS[1], 5, n=2, adapter="p")])
        e.train(Batch(samples=[Sample(x.prompt_tokens, x.tokens, [1.0] * len(x.tokens),
                                      list(x.logprobs), [1.0 if x.index else -1.0] * len(x.tokens))
                               for x in c], loss=LossConfig(lr=5e-2), adapter="p"))
        for adapter in ("", "p"):
            first = e.generate([req("c1", PROMPTS[0], 9, adapter=adapter)])[0]
            turn2 = PROMPTS[0] + first.tokens + [40, 41, 42]
            hit = sampled(e, [req("c2", turn2, 10, adapter=adapter)])
            assert e.gen.take_prefix_stats()["hits"] >= 1
            e._call(e.gen.forget_prefixes)
            cold = sampled(e, [req("c2", turn2, 10, adapter=adapter)])
            assert hit == cold
            (toks, lps), = hit.values()
            got = e.score([ScoreRequest(tokens=toks, prompt_tokens=turn2, adapter=adapter)])[0]
            assert got == lps
    finally:
        e.close()


def test_a_kept_version_samples_in_the_same_arithmetic(model_dirs):
    # The rollout thread of a kept weights version (rollout.max_staleness > 0) computes in the
    # engine's mode: its samples, in another batch, equal the engine's own bit for bit. An engine
    # of its own: the shared one holds test_with_lora's adapter, and a worker serving adapters
    # keeps no versions.
    from test_versions import collect
    e = Engine(str(model_dirs["tiny-qwen3"]), Options(device="cpu", deterministic=True))
    try:
        reqs = [req("v0", PROMPTS[0], 3, n=2), req("v1", PROMPTS[2], 4)]
        own = [(c.tokens, c.logprobs) for c in e.generate(reqs)]
        e.keep_version(0)
        kept = collect(lambda r, *cb: e.submit_version(0, r, *cb),
                       [req("x", PROMPTS[1], 1, n=3)] + reqs)[3:]
        assert kept == own
        e.drop_versions(1)
    finally:
        e.close()


def test_the_triton_row_sums_keep_a_row_whatever_its_batch_and_padding(interpreted, monkeypatch):
    # A GPU's sums over a row (RMSNorm's mean square, the log-softmax, the sampler's masses):
    # one program a row, so a row alone, in a batch, or padded with zeros past its entries sums
    # alike; close to torch's sums. 2,500 entries: three chunks of ROW_BLOCK, the last partial.
    g = torch.Generator().manual_seed(8)
    x = torch.randn(5, 2500, generator=g) * 4
    x[3, 100:] = float("-inf")  # a row of few finite entries
    s = bi.row_sum_triton(x.clamp(min=-50))
    assert torch.allclose(s, x.clamp(min=-50).sum(-1), rtol=1e-5, atol=1e-3)
    padded = torch.cat([x.clamp(min=-50), torch.zeros(5, 700)], dim=-1)
    assert torch.equal(bi.row_sum_triton(padded), s)
    lse = bi.logsumexp_triton(x)
    assert torch.allclose(lse, torch.logsumexp(x, -1), atol=1e-5)
    for i in range(5):
        assert torch.equal(bi.row_sum_triton(x[i:i + 1].clamp(min=-50)), s[i:i + 1])
        assert torch.equal(bi.logsumexp_triton(x[i:i + 1]), lse[i:i + 1])
    assert bi.logsumexp_triton(torch.full((1, 10), float("-inf"))).item() == float("-inf")
    # Through the mode's functions (row_kernels on): the gradients are the plain ones.
    monkeypatch.setattr(bi, "FORCE_TRITON", True)
    xg = x[:, :300].clone().requires_grad_()
    bi.logsumexp(xg).sum().backward()
    assert torch.allclose(xg.grad, torch.softmax(x[:, :300], -1), atol=1e-6)
    h = torch.randn(7, 64, generator=g)
    w = torch.randn(64, generator=g)
    y = bi.rms_norm(h, w, 1e-6)
    ref = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert torch.allclose(y, ref, atol=1e-5)
    for i in range(7):
        assert torch.equal(bi.rms_norm(h[i:i + 1], w, 1e-6), y[i:i + 1])


def test_the_triton_sampler_draws_a_row_alike_in_any_batch(interpreted, monkeypatch):
    # The GPU's sampler: the logits (bf16, as a decode step has them) in parts of VOCAB_PART
    # entries, a program a part, then a program a row. A row's token and log-prob are the same
    # alone and in a batch of other rows; the log-prob is bit for bit the one the trainer's head
    # and Score compute for that token (the same log-sum-exp kernels on the same logits); the
    # draws are the tree sums' (the CPU's) at the same uniforms, greedy rows their arg-max, and
    # top-p rows the nucleus draw.
    monkeypatch.setattr(bi, "FORCE_TRITON", True)
    monkeypatch.setattr(bi, "VOCAB_PART", 512)  # 5 parts of 2,100 entries, the last partial
    g = torch.Generator().manual_seed(21)
    B, V = 7, 2100
    logits = (torch.randn(B, V, generator=g) * 3).bfloat16()
    logits[4, 1000:] = float("-inf")  # a row whose last parts have no weight
    temp = torch.tensor([1.0, 0.7, 0.0, 1.0, 1.3, 1.0, 0.0])
    u = torch.rand(B, generator=g)
    u[5] = 1 - 2 ** -24  # the last entry with weight
    tok, lp = bi.sample(logits, temp, torch.ones(B), u, False)
    assert tok.dtype == torch.int64 and lp.dtype == torch.float32
    for i in range(B):
        t1, l1 = bi.sample(logits[i:i + 1], temp[i:i + 1], torch.ones(1), u[i:i + 1], False)
        assert t1.item() == tok[i].item() and torch.equal(l1, lp[i:i + 1]), i
    assert torch.equal(lp, bi.token_logprobs(logits, tok))
    head = bi.token_logprobs_entropy(logits.clone().requires_grad_(), tok, True)[0]
    assert torch.equal(head.detach(), lp)
    ref = torch.log_softmax(logits.float(), -1).gather(1, tok[:, None])[:, 0]
    assert torch.allclose(lp, ref, atol=1e-5)
    assert tok[2] == logits[2].float().argmax() and tok[6] == logits[6].float().argmax()
    assert tok[4] < 1000 and tok[5] == V - 1
    monkeypatch.setattr(bi, "FORCE_TRITON", False)
    cpu = bi.sample(logits.float(), temp, torch.ones(B), u, False)[0]
    assert torch.equal(cpu, tok)
    # Top-p rows: the nucleus draw, a row alike alone; the others keep the kernels' draw.
    monkeypatch.setattr(bi, "FORCE_TRITON", True)
    top_p = torch.tensor([1.0, 0.5, 1.0, 0.9, 1.0, 1.0, 0.3])
    tp, lpp = bi.sample(logits, temp, top_p, u, True)
    keep = top_p == 1
    assert torch.equal(tp[keep], tok[keep]) and torch.equal(lpp[keep], lp[keep])
    assert tp[6] == tok[6]  # greedy wins over top-p
    for i in range(B):
        t1, l1 = bi.sample(logits[i:i + 1], temp[i:i + 1], top_p[i:i + 1], u[i:i + 1],
                           bool(top_p[i] < 1))
        assert t1.item() == tp[i].item() and torch.equal(l1, lpp[i:i + 1]), i
    # The frequencies follow the distribution: one row drawn at 200 evenly spaced uniforms (a
    # token's share is then within 1/200 of its probability: the check's 0.01 holds; 400 rows
    # took half this test's time under the interpreter).
    row = (torch.randn(1, 600, generator=g) * 0.5).bfloat16()
    row[0, :3] = 3.0
    n = 200
    uu = (torch.arange(n, dtype=torch.float32) + 0.5) / n
    tt, _ = bi.sample(row.expand(n, -1), torch.ones(n), torch.ones(n), uu, False)
    p = torch.softmax(row.float(), -1)[0]
    for k in range(3):
        assert abs((tt == k).float().mean().item() - p[k].item()) < 0.01


@pytest.mark.parametrize("bwd", ["triton", "triton2", "sdpa"])
def test_the_triton_attention_gradient_is_sdpa_s_in_both_forms(interpreted, monkeypatch, bwd):
    # The training pass's attention (causal: the causal SDPA kernel in the "sdpa" backward pass,
    # the bounds by arithmetic in the "triton2" one) and a masked one give SDPA's gradients, in
    # each backward pass; the "sdpa" one leaves PyTorch's deterministic setting as it found it.
    monkeypatch.setattr(bi, "ATTN_BWD", bwd)
    for name in ("ATTN_BWD_DQ", "ATTN_BWD_DQ_F32", "ATTN_BWD2_DQ", "ATTN_BWD2_DQ_F32"):
        monkeypatch.setattr(bi, name, (16, 16, 4, 1))
    for name in ("ATTN_BWD_DKDV", "ATTN_BWD_DKDV_F32", "ATTN_BWD2_DKDV", "ATTN_BWD2_DKDV_F32"):
        monkeypatch.setattr(bi, name, (16, 32, 4, 1))
    g = torch.Generator().manual_seed(9)
    B, T, H, KV, D = 2, 20, 4, 2, 16
    q, k, v = (torch.randn(*s, generator=g) for s in ((B, T, H, D), (B, KV, T, D), (B, KV, T, D)))
    go = torch.randn(B, T, H, D, generator=g)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    o = torch.nn.functional.scaled_dot_product_attention(
        ref[0].transpose(1, 2), ref[1], ref[2], is_causal=True, scale=0.3,
        enable_gqa=True).transpose(1, 2)
    want = torch.autograd.grad(o, ref, go)
    pos = torch.arange(T).expand(B, T)
    for causal in (True, False):
        ins = [t.clone().requires_grad_() for t in (q, k, v)]
        got = torch.autograd.grad(bi._Attention.apply(*ins, pos, 0.3, causal, True), ins, go)
        for a, b in zip(got, want):
            assert torch.allclose(a, b, atol=1e-5)
    assert not torch.are_deterministic_algorithms_enabled()


@pytest.mark.parametrize("bwd", ["triton", "triton2"])
def test_the_triton_attention_backward_is_the_gradient_and_repeats(interpreted, monkeypatch,
                                                                    bwd):
    # The training pass's backward in the two Triton kernels (dQ by query blocks, dK and dV by
    # key blocks over the query heads sharing them), never SDPA: the gradient of attention_torch
    # in fp32, and within bf16's rounding in bf16, with grouped heads (4 on 2, 2 on 2), queries
    # past the first 16-row block, a row whose queries start at position 6 of a longer key row,
    # and a row whose last queries are padding (position -1: they see no key, have output 0 and
    # no gradient). Two calls give the same gradients bit for bit (with the grouped heads, where
    # dK and dV add over the heads of a key head; once per setting). (In bf16 the output comes
    # from attention_torch: the interpreter's forward kernel reads bf16 operands of its products
    # as their bits; the backward kernels read them as fp32 there.) In fp32 with the forward's
    # log-sum-exp of each row (ATTN_LSE, kept by the forward kernel without changing its output)
    # and with the dQ kernel's own alike. The blocks whose queries see all their keys without
    # the masks' work (ATTN_BWD_FULL_BLOCKS), the same numbers as masked. The second form
    # ("triton2": rows of the heads of a key head together; FULL_BLOCKS changes nothing there)
    # alike, with a group of 3 (rows 15 of a 16-row block), and in a causal pass (queries at
    # 0..Lk-1) with its bounds by arithmetic: the same gradient as the masked loops'. (The
    # second form takes no FULL_BLOCKS: its runs are the first call and, grouped, the repeat.
    # Its group of 3 in fp32 alone: bf16 changes the loads and stores, not the rows' heads,
    # and the groups of 2 and 1 check it.)
    monkeypatch.setattr(bi, "ATTN_BWD", bwd)
    for name in ("ATTN_BWD_DQ", "ATTN_BWD_DQ_F32", "ATTN_BWD2_DQ", "ATTN_BWD2_DQ_F32"):
        monkeypatch.setattr(bi, name, (16, 16, 4, 1))
    for name in ("ATTN_BWD_DKDV", "ATTN_BWD_DKDV_F32", "ATTN_BWD2_DKDV", "ATTN_BWD2_DKDV_F32"):
        monkeypatch.setattr(bi, name, (16, 16, 4, 1))  # whole blocks under the diagonal

    def no_sdpa(*a, **kw):
        raise AssertionError("the Triton attention's backward pass called SDPA")
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", no_sdpa)
    g = torch.Generator().manual_seed(12)
    for H, KV in ((4, 2), (2, 2)) + (((6, 2),) if bwd == "triton2" else ()):
        B, T, D, Lk = 2, 40, 16, 46
        q = torch.randn(B, T, H, D, generator=g)
        k = torch.randn(B, KV, Lk, D, generator=g)
        v = torch.randn(B, KV, Lk, D, generator=g)
        go = torch.randn(B, T, H, D, generator=g)
        pos = torch.stack([torch.arange(T) + 6, torch.arange(T)])
        pos[1, 29:] = -1
        for dtype, tol in ((torch.float32, 1e-5),) + (((torch.bfloat16, 3e-2),) if H != 6 else ()):
            ins = [t.to(dtype) for t in (q, k, v)]
            ref = [t.float().requires_grad_() for t in ins]
            out = bi.attention_torch(*ref, pos, 0.3)
            want = torch.autograd.grad(out, ref, go)
            for lse in ((True, False) if dtype == torch.float32 else (False,)):
                monkeypatch.setattr(bi, "ATTN_LSE", lse)
                runs = []
                # whole blocks on, on again (the repeat), off (the second form: no such switch)
                fulls = (True, True, False) if H > KV else (True, False)
                for full in (fulls[:-1] if bwd == "triton2" else fulls):
                    monkeypatch.setattr(bi, "ATTN_BWD_FULL_BLOCKS", full)
                    if dtype == torch.float32:
                        xs = [t.clone().requires_grad_() for t in ins]
                        o = bi._Attention.apply(*xs, pos, 0.3, False, True)
                        runs.append(torch.autograd.grad(o, xs, go))
                    else:
                        o = out.detach().nan_to_num(0.0).to(dtype)
                        runs.append(bi.attention_backward_triton(*ins, o, pos, go.to(dtype),
                                                                 0.3))
                for *same, w in zip(*runs, want):
                    a = same[0]
                    assert a.dtype == dtype and all(torch.equal(a, b) for b in same[1:])
                    assert (a.float() - w).abs().max() <= tol * max(1.0, w.abs().max().item())
                assert not runs[0][0][1, 29:].any()
        # The forward's log-sum-exp: the output unchanged, each row's log Σ exp(q·k·0.3) over
        # the keys it sees, 0 for a row that sees none.
        buf = torch.full((B, T, H), 7.0)
        o = bi.attention_triton(q, k, v, pos, 0.3, lse=buf)
        assert torch.equal(o, bi.attention_triton(q, k, v, pos, 0.3))
        s = torch.einsum("bthd,bhld->bthl", q, k.repeat_interleave(H // KV, 1)) * 0.3
        seen = torch.arange(Lk)[None, None, None, :] <= pos[:, :, None, None]
        want_lse = torch.logsumexp(s.masked_fill(~seen, float("-inf")), -1).nan_to_num(
            0.0, neginf=0.0)
        assert torch.allclose(buf, want_lse, atol=1e-5) and not buf[1, 29:].any()
        if bwd == "triton2":  # a causal pass: Tq = Lk, the positions 0..T-1
            kc, vc = k[:, :, :T].contiguous(), v[:, :, :T].contiguous()
            pc = torch.arange(T).expand(B, T)
            ref = [t.clone().requires_grad_() for t in (q, kc, vc)]
            want = torch.autograd.grad(bi.attention_torch(*ref, pc, 0.3), ref, go)
            o = bi.attention_torch(q, kc, vc, pc, 0.3)
            runs = [bi.attention_backward_triton(q, kc, vc, o, pc, go, 0.3, causal=c)
                    for c in (True, True, False)]
            for *same, w in zip(*runs, want):
                assert torch.equal(same[0], same[1])
                for a in same:
                    assert (a - w).abs().max() <= 1e-5 * max(1.0, w.abs().max().item())


def test_the_triton_rms_norm_keeps_a_row_and_has_the_plain_gradient(interpreted, monkeypatch):
    # The GPU's RMSNorm (one kernel a row; 1,500 entries: two chunks): each row alike alone and
    # in a batch, close to the tree-sum form; in bf16 as model.rms_norm rounds (cast, then the
    # weight); its gradients the PyTorch form's.
    g = torch.Generator().manual_seed(10)
    x = torch.randn(6, 1500, generator=g) * 3
    w = torch.randn(1500, generator=g)
    y = bi.rms_norm_triton(x, w, 1e-6)
    assert torch.allclose(y, bi.rms_norm(x, w, 1e-6), rtol=1e-5, atol=1e-5)
    for i in range(6):
        assert torch.equal(bi.rms_norm_triton(x[i:i + 1], w, 1e-6), y[i:i + 1])
    xb, wb = x.bfloat16(), w.bfloat16()
    yb = bi.rms_norm_triton(xb, wb, 1e-6)
    x32 = xb.float()
    ref = wb * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()
    assert yb.dtype == torch.bfloat16
    assert (yb.float() - ref.float()).abs().max() <= 0.02 * ref.float().abs().max()
    monkeypatch.setattr(bi, "FORCE_TRITON", True)
    xs, ws = x[:, :64].clone().requires_grad_(), w[:64].clone().requires_grad_()
    go = torch.randn(6, 64, generator=g)
    got = torch.autograd.grad(bi.rms_norm(xs, ws, 1e-6), (xs, ws), go)
    xr, wr = x[:, :64].clone().requires_grad_(), w[:64].clone().requires_grad_()
    want = torch.autograd.grad(wr * xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-6),
                               (xr, wr), go)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-5)


def test_the_triton_rms_norm_backward_is_the_gradient_and_repeats(interpreted, monkeypatch):
    # The GPU's RMSNorm backward pass in one kernel (gx a row at a time, gw as the programs'
    # partial sums over their rows, added after): the gradient of the PyTorch form in fp32, and
    # within bf16's rounding in bf16, with programs of 4 rows (the last of 2) and of 1; the same
    # bit for bit twice; what _RMSNorm's backward pass returns.
    g = torch.Generator().manual_seed(13)
    x = torch.randn(6, 3, 40, generator=g) * 2
    w = torch.randn(40, generator=g)
    go = torch.randn(6, 3, 40, generator=g)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        xs, ws = x.to(dtype), w.to(dtype)
        xr, wr = xs.float().requires_grad_(), ws.float().requires_grad_()
        x32 = xr.float()
        y = wr * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype).float()
        want = torch.autograd.grad(y, (xr, wr), go)
        for programs in (4, 1024):
            monkeypatch.setattr(bi, "RMS_BWD_PROGRAMS", programs)
            one = bi.rms_norm_backward_triton(xs, ws, go.to(dtype), 1e-6)
            two = bi.rms_norm_backward_triton(xs, ws, go.to(dtype), 1e-6)
            for a, b, c in zip(one, two, want):
                assert a.dtype == dtype and a.shape == c.shape and torch.equal(a, b)
                assert (a.float() - c).abs().max() <= tol * max(1.0, c.abs().max().item())
    monkeypatch.setattr(bi, "FORCE_TRITON", True)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    got = torch.autograd.grad(bi.rms_norm(xg, wg, 1e-6), (xg, wg), go)
    for a, b in zip(got, bi.rms_norm_backward_triton(x, w, go, 1e-6)):
        assert torch.equal(a, b)


def test_the_triton_log_prob_head_backward_is_the_gradient(interpreted, monkeypatch):
    # The trainer's log-prob head on a GPU: the same log-probs, bit for bit, as the chunked form
    # it replaces (the sampler's arithmetic), its entropies to rounding (one kernel a row), and
    # in its backward pass one kernel a row: the chunked form's gradient (fp32; bf16 logits
    # within their rounding), with and without the entropy's gradient, over several row
    # chunks; the same bit for bit twice.
    monkeypatch.setattr(bi, "FORCE_TRITON", True)
    monkeypatch.setattr(bi, "_CHUNK", 1 << 11)  # chunks of 3 rows (on the CPU)
    g = torch.Generator().manual_seed(14)
    N, V = 7, 2500
    logits = torch.randn(N, V, generator=g) * 3
    targets = torch.randint(0, V, (N,), generator=g)
    wl, we = torch.randn(N, generator=g), torch.randn(N, generator=g)

    def run(x, new, entropy_grad):
        monkeypatch.setattr(bi, "HEAD_BWD_TRITON", new)
        x = x.clone().requires_grad_()
        lp, ent = bi.token_logprobs_entropy(x, targets, entropy_grad)
        assert ("HeadLogprobs" in type(lp.grad_fn).__name__) == new
        loss = (lp * wl).sum() + ((ent * we).sum() if entropy_grad else 0.0)
        return lp.detach(), ent.detach(), torch.autograd.grad(loss, x)[0]

    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        x = logits.to(dtype)
        for entropy_grad in (False, True):
            lp, ent, gx = run(x, True, entropy_grad)
            lp0, ent0, gx0 = run(x, False, entropy_grad)
            assert torch.equal(lp, lp0)
            assert torch.allclose(ent, ent0, rtol=1e-5, atol=1e-5)
            assert gx.dtype == dtype
            assert (gx.float() - gx0.float()).abs().max() <= tol * gx0.float().abs().max()
            assert torch.equal(run(x, True, entropy_grad)[2], gx)
    assert torch.equal(bi.token_logprobs(logits, targets), run(logits, True, False)[0])


def test_the_fused_rope_and_residual_add_round_as_eager_mode(interpreted, monkeypatch):
    # The GPU's rotary embedding and residual add in one kernel each give eager mode's numbers
    # bit for bit in bf16 (each product and the sum rounded as PyTorch rounds them), for the
    # tables of a decode step ([B, D]), a training pass ([T, D], broadcast over the batch) and a
    # prefill after a cached prefix ([B, T, D]); their gradients, and SwiGLU's from its one
    # backward kernel, are eager autograd's to bf16's rounding; without the kernels
    # (FUSED_ELEMENTWISE off) the eager operations run.
    from slimen_torch.model import apply_rope
    monkeypatch.setattr(bi, "FORCE_TRITON", True)
    g = torch.Generator().manual_seed(15)
    angles = torch.randn(30, 8, generator=g) * 3
    cos_t, sin_t = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    B, T, H, D = 2, 5, 3, 16
    pos = torch.randint(0, 30, (B, T), generator=g)
    for shape, cos, sin in (((B, H, D), cos_t[pos[:, 0]], sin_t[pos[:, 0]]),
                            ((B, T, H, D), cos_t[:T], sin_t[:T]),
                            ((B, T, H, D), cos_t[pos], sin_t[pos])):
        x = (torch.randn(*shape, generator=g) * 4).bfloat16()
        go = torch.randn(*shape, generator=g).bfloat16()
        xe = x.clone().requires_grad_()
        want = apply_rope(xe, cos.bfloat16(), sin.bfloat16())
        xf = x.clone().requires_grad_()
        got = bi.rope(xf, cos, sin, apply_rope)
        assert "Rope" in type(got.grad_fn).__name__ and torch.equal(got, want)
        ge, = torch.autograd.grad(want, xe, go)
        gf, = torch.autograd.grad(got, xf, go)
        assert (gf.float() - ge.float()).abs().max() <= 1e-2 * ge.float().abs().max()
        y = (torch.randn(*shape, generator=g) * 4).bfloat16()
        s = bi.residual_add(x, y)
        assert torch.equal(s, (y.float() + x).to(x.dtype))
    # SwiGLU: the eager operations forward (the same numbers), one kernel backward.
    gu = (torch.randn(4, 3, 2 * 40, generator=g) * 3).bfloat16()
    ga = torch.randn(4, 3, 40, generator=g).bfloat16()
    ge = gu.clone().requires_grad_()
    gate, up = ge.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    gf = gu.clone().requires_grad_()
    got = bi.swiglu(gf)
    assert "SwiGLU" in type(got.grad_fn).__name__ and torch.equal(got, want)
    we, = torch.autograd.grad(want, ge, ga)
    wf, = torch.autograd.grad(got, gf, ga)
    assert wf.dtype == torch.bfloat16
    assert (wf.float() - we.float()).abs().max() <= 2e-2 * we.float().abs().max()
    monkeypatch.setattr(bi, "FUSED_ELEMENTWISE", False)
    assert bi.residual_add(x, y) is None and bi.swiglu(gu) is None
    assert bi.rope(xf, cos, sin, apply_rope).grad_fn is not None
    assert "Rope" not in type(bi.rope(xf, cos, sin, apply_rope).grad_fn).__name__


def test_the_decode_steps_fused_kernels_keep_the_training_forwards_logits(interpreted,
                                                                         model_dirs,
                                                                         monkeypatch):
    # A GPU's decode step (the kernels, under the interpreter, in fp16: the rope kernel's
    # 16-bit) writes the cache in one kernel and runs SwiGLU's forward in one: a prompt's
    # next-token logits are bit for bit the training forward's (which takes the same SwiGLU
    # kernel), decoded alone and in a batch over a longer cache; the cache holds the bytes the
    # indexed copies write; SwiGLU's kernel rounds as eager mode does.
    from slimen_torch.config import read_config
    from slimen_torch.model import Transformer, kv_write
    from slimen_torch.weights import load_weights
    monkeypatch.setattr(bi, "FORCE_TRITON", True)
    cfg, _ = read_config(model_dirs["tiny-qwen3"])
    model = Transformer(cfg, dtype=torch.float16)
    load_weights(model, model_dirs["tiny-qwen3"])
    calls = {"kv": 0, "swiglu": 0}
    for name, key in (("_kv_write_kernel", "kv"), ("_swiglu_kernel", "swiglu")):
        kern = getattr(bi, name)

        class Counted:
            def __init__(self, kern, key):
                self.kern, self.key = kern, key

            def __getitem__(self, grid):
                calls[self.key] += 1
                return self.kern[grid]
        monkeypatch.setattr(bi, name, Counted(kern, key))

    with torch.no_grad():
        # decode_logits' caches are fp32: the fp16 model's are fp16
        monkeypatch.setattr(torch, "full", _half_full(torch.full))
        gap = invariance_gap(model, PROMPTS[1:])
    assert gap == 0.0
    assert calls["kv"] > 0 and calls["swiglu"] > 0
    g = torch.Generator().manual_seed(22)
    B, H, D = 3, cfg.kv_heads, cfg.head_dim
    k = torch.randn(B, H, D, generator=g).half()
    v = torch.randn(B, 2 * H, D, generator=g).half()[:, ::2]  # strided, as a view of q/k/v
    pos = torch.tensor([5, 0, 9])
    want = [torch.randn(4, H, 12, D, generator=g).half() for _ in range(2)]
    got = [t.clone() for t in want]
    assert bi.kv_write_rows(got[0], got[1], pos, k, v)
    rows = torch.arange(B)
    kv_write(want[0], (rows, slice(None), pos), k)
    kv_write(want[1], (rows, slice(None), pos), v)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    gu = (torch.randn(5, 2 * 72, generator=g) * 4).half()
    gate, up = gu.chunk(2, dim=-1)
    assert torch.equal(bi._swiglu_forward(gu), torch.nn.functional.silu(gate) * up)
    monkeypatch.setattr(bi, "FUSED_ELEMENTWISE", False)
    assert not bi.kv_write_rows(got[0], got[1], pos, k, v)


class _Counted:
    """A Triton kernel whose launches are counted into calls[key]."""

    def __init__(self, kern, calls, key):
        self.kern, self.calls, self.key = kern, calls, key

    def __getitem__(self, grid):
        self.calls[self.key] += 1
        return self.kern[grid]


def _count_kernels(monkeypatch, names) -> dict:
    calls = {n: 0 for n in names}
    for n in names:
        monkeypatch.setattr(bi, n, _Counted(getattr(bi, n), calls, n))
    return calls


@pytest.mark.parametrize("shape", ["tiny-qwen3", "tiny-qwen2"])
def test_the_q_k_norms_and_rope_are_one_kernel_a_layer_in_every_pass(interpreted, model_dirs,
                                                                      monkeypatch, shape):
    # A GPU's q and k heads (Qwen3's norms, then rope; Qwen2's rope alone) in one kernel a
    # layer, reading the q/k/v product where it lies: a decode step launches it once a layer
    # and neither the norm kernel for them nor the rope kernel (six launches a layer before:
    # two norms, two copies of the strided heads, two ropes); a prefill and the training
    # layer launch the same kernel, and the decode step's logits are the training forward's
    # bit for bit. The kernel's numbers are those of the norm and rope kernels one after the
    # other (the interpreter's), rows alike alone or in a batch, and its gradient autograd's
    # of the eager operations to fp16's rounding.
    from slimen_torch.config import read_config
    from slimen_torch.model import Transformer, apply_rope, block_forward, rms_norm
    from slimen_torch.weights import load_weights
    monkeypatch.setattr(bi, "FORCE_TRITON", True)
    cfg, _ = read_config(model_dirs[shape])
    model = Transformer(cfg, dtype=torch.float16)
    load_weights(model, model_dirs[shape])
    g = torch.Generator().manual_seed(23)
    with torch.no_grad():  # norms away from their ones
        for n, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn(p.shape, generator=g).half() * 0.3)
    calls = _count_kernels(monkeypatch, ["_qk_rope_kernel", "_rope_kernel", "_rms_kernel",
                                         "_add_rms_kernel", "_add_kernel"])
    L, B = cfg.layers, 3
    shape_c = (B, cfg.kv_heads, 16, cfg.head_dim)
    ks = [torch.zeros(shape_c).half() for _ in range(L)]
    vs = [torch.zeros(shape_c).half() for _ in range(L)]
    tok, pos = torch.tensor([5, 9, 11]), torch.tensor([0, 0, 0])
    with torch.no_grad(), bi.mode():
        step = model.logits(decode_step(model, decode_layer, tok, pos, ks, vs, 1))
    # (and the residual add after the attention with the MLP's norm: one kernel)
    assert calls == {"_qk_rope_kernel": L, "_rope_kernel": 0, "_rms_kernel": L + 1,
                     "_add_rms_kernel": L, "_add_kernel": L}
    with torch.no_grad(), bi.mode():  # a prefill of one token each: the decode step's logits
        full = model.logits(model(tok[:, None])[:, 0])
    assert torch.equal(full, step)
    assert calls["_qk_rope_kernel"] == 2 * L and calls["_rope_kernel"] == 0
    # The training layer (one autograd node) launches it forward, rope's kernel backward.
    w = tuple(t.detach().clone().requires_grad_() if t is not None else None
              for t in model.layers[0].weights())
    x = (torch.randn(2, 5, cfg.hidden, generator=g) * 2).half().requires_grad_()
    with bi.mode():
        y = block_forward(cfg, x, w, model.cos[:5], model.sin[:5])[0]
    assert calls["_qk_rope_kernel"] == 2 * L + 1 and calls["_rope_kernel"] == 0
    assert calls["_add_rms_kernel"] == 2 * L + 1
    assert type(y.grad_fn).__name__ == "_LayerBackward"
    # The kernel alone: the norm and rope kernels' numbers; a row alike alone; the gradient.
    HQ, HK, D = cfg.heads, cfg.kv_heads, cfg.head_dim
    qkv = (torch.randn(2, 5, (HQ + 2 * HK) * D, generator=g) * 3).half()
    q = qkv[..., :HQ * D].unflatten(-1, (HQ, D))
    k = qkv[..., HQ * D:(HQ + HK) * D].unflatten(-1, (HK, D))
    wq, wk = (model.layers[1].q_norm, model.layers[1].k_norm) if cfg.qk_norm else (None, None)
    cos, sin = model.cos[3:8], model.sin[3:8]
    yq, yk = bi.qk_rope(q, k, wq, wk, cos, sin, cfg.rms_eps)
    nq, nk = (bi.rms_norm_triton(q, wq, cfg.rms_eps), bi.rms_norm_triton(k, wk, cfg.rms_eps)) \
        if cfg.qk_norm else (q, k)
    assert torch.equal(yq, bi._rope_launch(nq, cos, sin, 1))
    assert torch.equal(yk, bi._rope_launch(nk, cos, sin, 1))
    one = bi.qk_rope(q[1:, 2:3], k[1:, 2:3], wq, wk, cos[2:3], sin[2:3], cfg.rms_eps)
    assert torch.equal(one[0], yq[1:, 2:3]) and torch.equal(one[1], yk[1:, 2:3])
    ws = [t.detach().clone().requires_grad_() for t in (wq, wk) if t is not None]
    gq = torch.randn(yq.shape, generator=g).half()
    gk = torch.randn(yk.shape, generator=g).half()
    grads = []
    for fused in (True, False):
        xq = qkv.clone().requires_grad_()
        q = xq[..., :HQ * D].unflatten(-1, (HQ, D))
        k = xq[..., HQ * D:(HQ + HK) * D].unflatten(-1, (HK, D))
        a, b = (ws + [None, None])[:2]
        if fused:
            oq, ok = bi.qk_rope(q, k, a, b, cos, sin, cfg.rms_eps)
            assert "QKRope" in type(oq.grad_fn).__name__
        else:
            if a is not None:
                q, k = rms_norm(q, a, cfg.rms_eps), rms_norm(k, b, cfg.rms_eps)
            oq, ok = (apply_rope(t, cos.half(), sin.half()) for t in (q, k))
        loss = (oq.float() * gq.float()).sum() + (ok.float() * gk.float()).sum()
        grads.append(torch.autograd.grad(loss, [xq] + ws))
    for a, b in zip(*grads):
        scale = b.float().abs().max().item()
        assert scale > 0 and (a.float() - b.float()).abs().max().item() <= 2e-2 * scale
    monkeypatch.setattr(bi, "FUSED_QK", False)
    assert bi.qk_rope(q, k, wq, wk, cos, sin, cfg.rms_eps) is None


def test_the_residual_add_and_the_mlp_norm_in_one_kernel(interpreted, monkeypatch):
    # The sum x + y as the add kernel rounds it and its norm as the norm kernel computes it
    # (bit for bit), a row alike alone; the gradients (x's, y's, the weight's) autograd's of
    # the eager operations to fp16's rounding; FUSED_ADD_NORM off: the caller's operations.
    from slimen_torch.model import rms_norm
    monkeypatch.setattr(bi, "FORCE_TRITON", True)
    g = torch.Generator().manual_seed(24)
    x = (torch.randn(2, 3, 40, generator=g) * 3).half()
    y = (torch.randn(2, 3, 40, generator=g) * 3).half()
    w = (torch.randn(40, generator=g) + 1).half()
    s, h = bi.add_rms_norm(x, y, w, 1e-6)
    assert torch.equal(s, bi._add_launch(x, y)) and torch.equal(s, (y.float() + x).half())
    assert torch.equal(h, bi.rms_norm_triton(s, w, 1e-6))
    s1, h1 = bi.add_rms_norm(x[1, 2:], y[1, 2:], w, 1e-6)
    assert torch.equal(s1, s[1, 2:]) and torch.equal(h1, h[1, 2:])
    gs, gh = torch.randn(s.shape, generator=g).half(), torch.randn(s.shape, generator=g).half()
    grads = []
    for fused in (True, False):
        ins = [t.clone().requires_grad_() for t in (x, y, w)]
        if fused:
            a, b = bi.add_rms_norm(*ins, 1e-6)
            assert "AddRMS" in type(a.grad_fn).__name__
        else:
            a = (ins[1].float() + ins[0]).half()
            b = rms_norm(a, ins[2], 1e-6)
        loss = (a.float() * gs.float()).sum() + (b.float() * gh.float()).sum()
        grads.append(torch.autograd.grad(loss, ins))
    for a, b in zip(*grads):
        scale = b.float().abs().max().item()
        assert scale > 0 and (a.float() - b.float()).abs().max().item() <= 2e-2 * scale
    monkeypatch.setattr(bi, "FUSED_ADD_NORM", False)
    assert bi.add_rms_norm(x, y, w, 1e-6) is None


def _half_full(full):
    """torch.full making fp16 tensors where it would make fp32 ones (decode_logits' caches)."""
    def f(*a, **kw):
        t = full(*a, **kw)
        return t.half() if t.dtype == torch.float32 else t
    return f


def test_the_triton_attention_groups_heads_alike(interpreted, monkeypatch):
    # A program's rows as the query heads of one key head (the default) or as one head's
    # queries: both SDPA's attention, and a query decoded alone gets what the whole sequence
    # gave it, with 4 heads on 2 key heads and with 8 on 1. (Queries whose rows start a block in
    # both: the interpreter's NumPy product rounds a row by its place in the block, which the
    # GPU's matrix instruction does not, as determinism.py checks on the device.)
    g = torch.Generator().manual_seed(11)
    for H, KV in ((4, 2), (8, 1)):
        B, T, D = 2, 40, 16
        q = torch.randn(B, T, H, D, generator=g)
        k = torch.randn(B, KV, T, D, generator=g)
        v = torch.randn(B, KV, T, D, generator=g)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k, v, is_causal=True, scale=0.25, enable_gqa=True).transpose(1, 2)
        pos = torch.arange(T).expand(B, T)
        for grouped in (True, False):
            monkeypatch.setattr(bi, "ATTN_GROUPED", grouped)
            o = bi.attention_triton(q, k, v, pos, 0.25)
            assert torch.allclose(o, ref, atol=1e-5)
            for t in (0, 16, 32):
                one = bi.attention_triton(q[:, t:t + 1].contiguous(), k, v, pos[:, t:t + 1], 0.25)
                assert torch.equal(one, o[:, t:t + 1])
        # The experiment's larger block for long passes (--attn-large): still the attention.
        monkeypatch.setattr(bi, "ATTN_LARGE", (32, 4))
        monkeypatch.setattr(bi, "ATTN_LARGE_Q", 32)
        assert torch.allclose(bi.attention_triton(q, k, v, pos, 0.25), ref, atol=1e-5)
        monkeypatch.setattr(bi, "ATTN_LARGE", None)


def test_a_training_step_through_the_gpu_kernels_is_the_cpu_step(interpreted, model_dirs,
                                                                 monkeypatch):
    # The deterministic mode's training step with every Triton kernel a GPU runs (products,
    # attention and its backward pass, RMSNorm and its backward, the log-prob head's backward
    # with the entropy's gradient, the residual add), on the tiny Qwen3 under the interpreter:
    # the loss and gradient norm of the CPU's operations, to fp32 rounding.
    for name in ("ATTN_BWD_DQ", "ATTN_BWD_DQ_F32"):
        monkeypatch.setattr(bi, name, (16, 16, 4, 1))
    for name in ("ATTN_BWD_DKDV", "ATTN_BWD_DKDV_F32"):
        monkeypatch.setattr(bi, name, (16, 32, 4, 1))
    # 16 and 23 tokens: the second sample's queries past the first 16-row block
    ss = [Sample(list(range(3, 13 + 7 * i)), list(range(40, 46)), [1.0] * 6, [-5.0] * 6,
                 [1.0 if i else -1.0] * 6, group="g") for i in range(2)]
    got = []
    for force in (False, True):
        monkeypatch.setattr(bi, "FORCE_TRITON", force)
        e = Engine(str(model_dirs["tiny-qwen3"]), Options(device="cpu", deterministic=True))
        try:
            got.append(e.train(Batch(samples=ss, loss=LossConfig(lr=1e-3, max_grad_norm=0.0,
                                                                 entropy_coef=0.01))))
        finally:
            e.close()
    assert got[1].grad_norm > 0
    assert abs(got[1].loss - got[0].loss) <= 1e-6 * max(1.0, abs(got[0].loss))
    assert abs(got[1].grad_norm - got[0].grad_norm) <= 1e-5 * got[0].grad_norm


def _graph_nodes(t: torch.Tensor) -> list[str]:
    """The names of the autograd nodes t's gradient runs through (AccumulateGrad aside)."""
    seen, todo, names = set(), [t.grad_fn], []
    while todo:
        f = todo.pop()
        if f is None or f in seen:
            continue
        seen.add(f)
        if type(f).__name__ != "AccumulateGrad":
            names.append(type(f).__name__)
        todo.extend(g for g, _ in f.next_functions)
    return names


@pytest.mark.parametrize("shape,bwd", [("tiny-qwen3", "triton"), ("tiny-qwen2", "triton"),
                                       ("tiny-qwen3", "triton2")])
def test_the_layer_in_one_node_is_the_layer(interpreted, model_dirs, monkeypatch, shape, bwd):
    # The deterministic training layer as one autograd node (LAYER_FN): the forward of the
    # operations one node each, bit for bit (the same kernels on the same inputs), for Qwen3's
    # q/k norms and Qwen2's biases, in fp16 (the rope kernel's 16-bit; the interpreter's bf16
    # products are not the GPU's); its gradients (input, every weight, and the keys' and
    # values' where they are used too) autograd's of those operations to fp16's rounding, and
    # the same bit for bit twice (the backward pass run again on the same graph: the forward's
    # numbers are the operations' above); one node a layer instead of about twenty. With the
    # attention's second backward form (ATTN_BWD "triton2", causal in both) likewise.
    from slimen_torch.config import read_config
    from slimen_torch.model import Transformer, block_forward
    from slimen_torch.weights import load_weights
    monkeypatch.setattr(bi, "FORCE_TRITON", True)
    monkeypatch.setattr(bi, "ATTN_BWD", bwd)
    for name in ("ATTN_BWD_DQ", "ATTN_BWD_DQ_F32", "ATTN_BWD2_DQ", "ATTN_BWD2_DQ_F32"):
        monkeypatch.setattr(bi, name, (16, 16, 4, 1))
    for name in ("ATTN_BWD_DKDV", "ATTN_BWD_DKDV_F32", "ATTN_BWD2_DKDV", "ATTN_BWD2_DKDV_F32"):
        monkeypatch.setattr(bi, name, (16, 32, 4, 1))
    cfg, _ = read_config(model_dirs[shape])
    model = Transformer(cfg, dtype=torch.float16)
    load_weights(model, model_dirs[shape])
    g = torch.Generator().manual_seed(21)
    with torch.no_grad():  # biases and norms away from their zeros and ones
        for n, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn(p.shape, generator=g).half() * 0.3)
    monkeypatch.setattr(bi, "RMS_BWD_PROGRAMS", 1)  # few programs (the interpreter's cost)
    B, T = 2, 17
    x0 = (torch.randn(B, T, cfg.hidden, generator=g) * 2).half()
    gy = torch.randn(B, T, cfg.hidden, generator=g).half()
    gk = torch.randn(B, cfg.kv_heads, T, cfg.head_dim, generator=g).half()
    cos, sin = model.cos[:T], model.sin[:T]

    def run(one_node, kv_uses):
        monkeypatch.setattr(bi, "LAYER_FN", one_node)
        ws = [t.detach().clone().requires_grad_() if t is not None else None
              for t in model.layers[0].weights()]
        x = x0.clone().requires_grad_()
        with bi.mode():
            y, k, v = block_forward(cfg, x, tuple(ws), cos, sin)
            y2 = block_forward(cfg, y, tuple(ws), cos, sin)[0]  # a second layer on the first
        ins = [x] + [t for t in ws if t is not None]
        grads = []
        for use_kv in kv_uses:  # the keys and values unused (training), and used too
            loss = (y2.float() * gy.float()).sum()
            if use_kv:
                loss = loss + (k.float() * gk.float()).sum() + (v.float() * gk.float()).sum()
            grads.append(torch.autograd.grad(loss, ins, retain_graph=True))
        return y2.detach(), grads, _graph_nodes(y2)

    y_new, g_new, nodes_new = run(True, (False, True, True))
    y_old, g_old, nodes_old = run(False, (False, True))
    assert torch.equal(y_new, y_old)
    assert nodes_new.count("_LayerBackward") == 2 and len(nodes_new) <= 4
    assert len(nodes_old) >= 30
    assert all(torch.equal(a, b) for a, b in zip(g_new[2], g_new[1]))
    for gn, go in zip(g_new, g_old):
        for a, b in zip(gn, go):
            assert a.dtype == b.dtype and a.shape == b.shape
            scale = b.float().abs().max().item()
            assert scale > 0 and (a.float() - b.float()).abs().max().item() <= 2e-2 * scale


def test_a_training_step_with_the_layer_in_one_node(interpreted, model_dirs, monkeypatch):
    # The engine's deterministic training step through the GPU's kernels (fp16, under the
    # interpreter), its layers one node each (LAYER_FN) or an operation a node: the same loss
    # and log-probs bit for bit (the same forward), the gradient norm to fp16's rounding.
    monkeypatch.setattr(bi, "FORCE_TRITON", True)
    monkeypatch.setattr(bi, "RMS_BWD_PROGRAMS", 1)
    for name in ("ATTN_BWD_DQ", "ATTN_BWD_DQ_F32"):
        monkeypatch.setattr(bi, name, (16, 16, 4, 1))
    for name in ("ATTN_BWD_DKDV", "ATTN_BWD_DKDV_F32"):
        monkeypatch.setattr(bi, name, (16, 32, 4, 1))
    # 11 and 18 tokens: the second sample's queries past the first 16-row block
    ss = [Sample(list(range(3, 8 + 7 * i)), list(range(40, 46)), [1.0] * 6, [-5.0] * 6,
                 [1.0 if i else -1.0] * 6, group="g") for i in range(2)]
    e = Engine(str(model_dirs["tiny-qwen3"]), Options(device="cpu", deterministic=True,
                                                      dtype="float16"))
    used, layer = [], bi.layer

    def counted(*a):
        out = layer(*a)
        used.append(out is not None)
        return out
    monkeypatch.setattr(bi, "layer", counted)
    try:
        got = []
        for one_node in (True, False):
            monkeypatch.setattr(bi, "LAYER_FN", one_node)
            got.append(e.train(Batch(samples=ss, loss=LossConfig(lr=0.0, max_grad_norm=0.0,
                                                                 entropy_coef=0.01))))
    finally:
        e.close()
    assert used == [True, True, False, False]  # the two layers of a micro-batch, each way
    assert got[0].grad_norm > 0
    assert (got[0].loss, got[0].logprob_diff_max) == (got[1].loss, got[1].logprob_diff_max)
    assert abs(got[0].grad_norm - got[1].grad_norm) <= 1e-2 * got[1].grad_norm


def test_the_products_tile_is_chosen_by_the_shape_alone(monkeypatch):
    # On a GPU: decode steps' narrow long-K products and the head take their own tiles, passes of
    # LARGE_M rows or more TILE_LARGE, whatever the rows hold; the interpreter always TILE.
    monkeypatch.setattr(bi, "INTERPRET", False)
    assert bi._tile(256, 1024, 3072) == bi.TILE_NARROW
    assert bi._tile(1, 1024, 2048) == bi.TILE_NARROW
    assert bi._tile(256, 151936, 1024) == bi.TILE_WIDE
    assert bi._tile(256, 4096, 1024) == bi.TILE
    assert bi._tile(bi.LARGE_M, 1024, 3072) == bi.TILE_LARGE
    monkeypatch.setattr(bi, "TILE_BY_SHAPE", False)
    assert bi._tile(256, 1024, 3072) == bi.TILE
    monkeypatch.setattr(bi, "TILE_LARGE", None)
    assert bi._tile(4096, 1024, 3072) == bi.TILE
    monkeypatch.setattr(bi, "INTERPRET", True)
    monkeypatch.setattr(bi, "TILE_BY_SHAPE", True)
    assert bi._tile(256, 1024, 3072) == bi.TILE
