"""The Triton kernels (kernels.py) against the PyTorch code they replace, on the CPU under Triton's
interpreter (conftest sets TRITON_INTERPRET=1 when there is no GPU): decode attention with and
without splits, the sampler and its state update, the batch-1 fused matrix-vector products and
rope, the chunked log-prob/entropy head with its gradients, and whole engines using them.

In fp32, so a difference is a bug and not rounding (bf16 is checked on the GPU by bench.py; the
interpreter's own fp32 → bf16 cast truncates, which kernels.py replaces by PyTorch's rounding to
nearest even under the interpreter). The optimizer step's kernel is tested in test_train.py."""

import pytest
import torch
import torch.nn.functional as F

from slimen_torch import kernels as K
from slimen_torch import server
from slimen_torch.__main__ import main
from slimen_torch import sampling as S
from slimen_torch.engine import Engine, Options
from slimen_torch.generate import Request
from slimen_torch.model import apply_rope, rms_norm
from slimen_torch.train import token_logprobs
from slimen_torch.types import Batch, GenerateRequest, LossConfig, Sample, Sampling, ScoreRequest

pytestmark = [
    pytest.mark.skipif(not K.available("cpu"),
                       reason="Triton (interpreter) not available on this machine"),
    # Masked lanes compute -inf − -inf before a where() drops them; the interpreter warns.
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("D,H,KV", [(16, 4, 2), (8, 4, 4)])
@pytest.mark.parametrize("L,nsplit", [(100, 0), (300, 4)])
def test_decode_attention(D, H, KV, L, nsplit):
    g = torch.Generator().manual_seed(D + L)
    B, slots, max_len = 3, 5, 320
    kc = torch.randn(slots, KV, max_len, D, generator=g)
    vc = torch.randn(slots, KV, max_len, D, generator=g)
    kc2, vc2 = kc.clone(), vc.clone()
    q = torch.randn(B, H, D, generator=g)
    kn, vn = torch.randn(B, KV, D, generator=g), torch.randn(B, KV, D, generator=g)
    pos = torch.tensor([L - 1, 0, L // 2])
    if nsplit:  # 300 positions in 128-position splits: three programs per row and head
        assert -(-L // (-(-(-(-L // nsplit)) // 64) * 64)) == 3
    o = K.decode_attention(q, kn, vn, kc, vc, pos, L, D ** -0.5, nsplit=nsplit)
    want = K.decode_attention_reference(q, kn, vn, kc2, vc2, pos, L, D ** -0.5)
    assert rel(o, want) < 1e-6
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)  # the new keys and values written



@pytest.mark.parametrize("D,H,KV,nmax", [(16, 4, 2, 4), (8, 4, 4, 2)])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("rope", [False, True])
def test_decode_attention_reads_a_shared_prefix_once(D, H, KV, nmax, fp8, rope):
    """Rows that hold the same prompt (the samples of one request) read its positions once, from
    the lead's row: the same output and cache as each row reading its own. Groups of three (lead
    1), two (lead 4, members listed in any order) and a row alone; the followers' own copies of
    the prompt are overwritten with noise, which the shared pass must not read; a group of more
    than nmax rows is split by the caller, so here the first group's length fits nmax. With
    rope=… both kernels normalise and rotate the raw q (and k) at each row's position."""
    g = torch.Generator().manual_seed(D + H + fp8 + 2 * rope)
    B, slots, L = 6, 7, 96
    dt = torch.float8_e4m3fn if fp8 else torch.float32
    kc = torch.randn(slots, KV, L, D, generator=g).to(dt)
    vc = torch.randn(slots, KV, L, D, generator=g).to(dt)
    groups = {1: ([1, 0, 3][:nmax], 40), 4: ([4, 5], 17)}
    for lead, (rows, plen) in groups.items():
        for r in rows:  # the members' copies of the prompt
            kc[r, :, :plen], vc[r, :, :plen] = kc[lead, :, :plen], vc[lead, :, :plen]
    kc2, vc2 = kc.clone(), vc.clone()
    q = torch.randn(B, H, D, generator=g)
    kn, vn = torch.randn(B, KV, D, generator=g), torch.randn(B, KV, D, generator=g)
    pos = torch.tensor([50, 41, 70, 44, 17, 30])
    grp = torch.full((slots, nmax), -1, dtype=torch.long)
    plen = torch.zeros(slots, dtype=torch.long)
    for lead, (rows, n) in groups.items():
        grp[lead, :len(rows)] = torch.tensor(rows)
        plen[rows] = n
    for lead, (rows, n) in groups.items():
        for r in rows:
            if r != lead:  # a follower's own copy is not read
                kc[r, :, :n] = torch.randn(KV, n, D, generator=g).to(dt)
    args = ()
    if rope:
        qn, kw = 1 + 0.1 * torch.randn(D, generator=g), 1 + 0.1 * torch.randn(D, generator=g)
        ang = torch.arange(float(L))[:, None] / 10000 ** (torch.arange(0, D, 2).float() / D)
        cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
        args = ((qn, kw, cos, sin, 1e-6),)
    # (One split: this few rows would otherwise be split, which reads every row's own copy.)
    o = K.decode_attention(q, kn, vn, kc, vc, pos, L, D ** -0.5, 1, *args, shared=(grp, plen))
    if rope:
        c, s_ = cos[pos], sin[pos]
        q, kn = apply_rope(rms_norm(q, qn, 1e-6), c, s_), apply_rope(rms_norm(kn, kw, 1e-6), c, s_)
    want = K.decode_attention_reference(q, kn, vn, kc2, vc2, pos, L, D ** -0.5)
    assert rel(o, want) < 1e-6
    rows = torch.arange(B)
    close = torch.allclose if rope else torch.equal  # (roped keys: rounded as the reference's)
    assert close(kc[rows, :, pos].float(), kc2[rows, :, pos].float())
    assert torch.equal(vc[rows, :, pos].float(), vc2[rows, :, pos].float())

def test_attention_splits():
    assert K.attention_splits(256, 8, 4096) == 1  # rows × heads fill the GPU
    assert K.attention_splits(1, 8, 64) == 1  # one tile
    assert K.attention_splits(1, 8, 384) == 6  # tiles of 64 positions in parallel
    assert K.attention_splits(1, 8, 4096) == 16  # at most 16 splits
    assert K.attention_splits(8, 8, 4096) == 4  # ~256 programs


@pytest.mark.parametrize("V,chunk", [(1000, 256), (4096, 1024)])
def test_sampler_equals_torch(V, chunk):
    g = torch.Generator().manual_seed(V)
    B = 8
    logits = torch.randn(B, V, generator=g) * 3
    temp = torch.tensor([1.0, 0.7, 0.0, 1.3, 1.0, 0.5, 0.0, 2.0])
    key = torch.tensor([S.row_key(s, i) for s, i in zip(range(100, 108), range(B))])
    step = torch.randint(0, 1000, (B,), generator=g)
    want_tok, want_lp = S.sample(logits, temp, torch.ones(B), S.uniform(key, step), False)
    active = torch.tensor([True, False] * 4)
    pos = torch.randint(0, 50, (B,), generator=g)
    tok, out_tok, out_lp = torch.zeros(B, dtype=torch.long), torch.zeros(B, dtype=torch.long), \
        torch.zeros(B)
    pos0, step0 = pos.clone(), step.clone()
    K.sample_and_advance(logits, temp, key, step, active, pos, tok, out_tok, out_lp, max_pos=40,
                         chunk=chunk)
    assert out_tok.tolist() == want_tok.tolist() == tok.tolist()
    assert torch.allclose(out_lp, want_lp, atol=1e-5)
    assert pos.tolist() == torch.where(active, (pos0 + 1).clamp(max=40), pos0).tolist()
    assert step.tolist() == (step0 + active.long()).tolist()


def test_sampler_frequencies_and_zero_weights():
    # As test_sampling: four tokens with mass in different chunks, the rest -inf (whole chunks
    # of -inf too); evenly spread uniforms draw each token in proportion to its probability.
    where, values = [3, 700, 1100, 2040], torch.tensor([0.0, 1.0, 2.0, -1.0])
    logits = torch.full((1, 2048), float("-inf"))
    logits[0, where] = values
    n = 64
    u = (torch.arange(n) + 0.5) / n
    L = logits.expand(n, -1).contiguous()
    zeros = torch.zeros(n, dtype=torch.long)
    toks, lp = K.sample_and_advance(L, torch.ones(n), zeros, zeros, u=u, chunk=512)
    want, want_lp = S.sample(L, torch.ones(n), torch.ones(n), u, False)
    assert toks.tolist() == want.tolist()
    assert torch.allclose(lp, want_lp, atol=1e-6)
    freq = torch.tensor([(toks == w).float().mean().item() for w in where])
    assert torch.allclose(freq, torch.softmax(values, 0), atol=1 / n)


def test_sampler_stays_in_a_partial_vocabulary():
    # A vocabulary smaller than a chunk (qwen3-50m's 624 tokens in one chunk of 2048) and
    # uniforms at the top of (0, 1): the target lands at the chunk's total, where the sums of the
    # chunk's weights in different orders disagree in the last bits. Capped by another sum than
    # the running sum's own, the draw ran past the running total and took the chunk's last
    # entry, 2047: outside the vocabulary (the H200's 2048-row exam swarm, a device-side
    # assertion in the next step's embedding). Every draw must be a token with weight.
    g = torch.Generator().manual_seed(0)
    n, V = 64, 624
    logits = torch.randn(n, V, generator=g) * 0.5
    u = ((2 ** 24 - 1 - torch.arange(n) % 16).double() + 0.5).div(2 ** 24).float()
    zeros = torch.zeros(n, dtype=torch.long)
    toks, lp = K.sample_and_advance(logits, torch.ones(n), zeros, zeros, u=u)
    assert toks.max().item() < V
    # There: the vocabulary's last token (every weight is positive), as the PyTorch sampler draws.
    want, want_lp = S.sample(logits, torch.ones(n), torch.ones(n), u, False)
    assert toks.tolist() == want.tolist() == [V - 1] * n
    assert torch.allclose(lp, want_lp, atol=1e-5)


@pytest.mark.parametrize("K_,N", [(32, 64), (100, 37)])
def test_gemv(K_, N):
    g = torch.Generator().manual_seed(N)
    x = torch.randn(K_, generator=g)
    w = torch.randn(N, K_, generator=g) * 0.1
    nw = 1 + 0.1 * torch.randn(K_, generator=g)
    bias, res = torch.randn(N, generator=g), torch.randn(N, generator=g)
    out = torch.empty(N)
    K.gemv(x, w, out, bias=bias, norm_w=nw, eps=1e-6)
    assert rel(out, F.linear(rms_norm(x[None], nw, 1e-6), w, bias)[0]) < 1e-6
    K.gemv(x, w, out, res=res)
    assert rel(out, res + F.linear(x, w)) < 1e-6
    w13 = torch.randn(2 * N, K_, generator=g) * 0.1
    K.gemv(x, w13, out, norm_w=nw, eps=1e-6, swiglu=True)
    gate, up = F.linear(rms_norm(x[None], nw, 1e-6), w13).chunk(2, -1)
    assert rel(out, (F.silu(gate) * up)[0]) < 1e-6


@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("nsplit", [1, 3])
def test_decode_attention_with_rope(qk_norm, nsplit):
    """rope=…: the kernel normalises and rotates the raw q and k itself (the batch-1 step)."""
    g = torch.Generator().manual_seed(nsplit + 2 * qk_norm)
    B, H, KV, D, L, slots = 2, 4, 2, 16, 300, 3
    kc, vc = torch.randn(slots, KV, L, D, generator=g), torch.randn(slots, KV, L, D, generator=g)
    kc2, vc2 = kc.clone(), vc.clone()
    qkv = torch.randn(B, (H + 2 * KV) * D, generator=g)
    q, k, v = qkv.split([H * D, KV * D, KV * D], -1)
    q, k, v = q.view(B, H, D), k.view(B, KV, D), v.view(B, KV, D)
    qn, kn = 1 + 0.1 * torch.randn(D, generator=g), 1 + 0.1 * torch.randn(D, generator=g)
    ang = torch.arange(float(L))[:, None] / 10000 ** (torch.arange(0, D, 2).float() / D)
    ang = torch.cat((ang, ang), -1)
    cos, sin = ang.cos(), ang.sin()
    pos = torch.tensor([L - 1, 40])
    rope = (qn if qk_norm else None, kn if qk_norm else None, cos, sin, 1e-6)
    o = K.decode_attention(q, k, v, kc, vc, pos, L, D ** -0.5, nsplit=nsplit, rope=rope)
    if qk_norm:
        q, k = rms_norm(q, qn, 1e-6), rms_norm(k, kn, 1e-6)
    c, s_ = cos[pos], sin[pos]
    want = K.decode_attention_reference(apply_rope(q, c, s_), apply_rope(k, c, s_), v, kc2, vc2,
                                        pos, L, D ** -0.5)
    assert rel(o, want) < 1e-6
    assert torch.allclose(kc, kc2, atol=1e-6) and torch.equal(vc, vc2)


@pytest.mark.parametrize("use_triton", [False, True])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_linear_logprobs(use_triton, entropy_grad):
    g = torch.Generator().manual_seed(int(use_triton) + 2 * int(entropy_grad))
    N, H, V = 37, 16, 300
    # One chunk, kept or recomputed in the backward pass; four chunks, two kept or none.
    for budget, keep in ((1 << 20, 1 << 20), (1 << 20, 0), (10 * V, 20 * V), (10 * V, 0)):
        h = torch.randn(N, H, generator=g).requires_grad_()
        W = torch.randn(V, H, generator=g).requires_grad_()
        tg = torch.randint(0, V, (N,), generator=g)
        a, b = torch.randn(N, generator=g), torch.randn(N, generator=g)
        lp, ent = token_logprobs(h @ W.t(), tg, entropy_grad=entropy_grad)
        loss = (lp * a).sum() + ((ent * b).sum() if entropy_grad else 0)
        want = torch.autograd.grad(loss, (h, W))
        lp2, ent2 = K.linear_logprobs(h, W, tg, entropy_grad=entropy_grad,
                                      use_triton=use_triton, budget=budget, keep=keep)
        assert ent2.requires_grad == entropy_grad
        loss2 = (lp2 * a).sum() + ((ent2 * b).sum() if entropy_grad else 0)
        got = torch.autograd.grad(loss2, (h, W))
        assert rel(lp2, lp) < 1e-6 and rel(ent2, ent) < 1e-5
        assert rel(got[0], want[0]) < 1e-5 and rel(got[1], want[1]) < 1e-5


def test_linear_logprobs_keeps_the_forward_logits():
    """With keep covering every chunk, the backward pass multiplies twice a chunk (the two
    gradients), not three times (the logits again); with keep 0 it recomputes them."""
    from torch.utils.flop_counter import FlopCounterMode
    g = torch.Generator().manual_seed(9)
    N, H, V = 40, 16, 300
    flops = []
    for keep in (1 << 20, 0):
        h = torch.randn(N, H, generator=g).requires_grad_()
        W = torch.randn(V, H, generator=g).requires_grad_()
        lp, _ = K.linear_logprobs(h, W, torch.randint(0, V, (N,), generator=g),
                                  use_triton=False, budget=10 * V, keep=keep)
        with FlopCounterMode(display=False) as fc:
            lp.sum().backward()
        flops.append(fc.get_total_flops())
    assert flops[1] - flops[0] == 2 * N * H * V  # the logits' product, not made again


def requests():
    user = [{"role": "user", "content": "Ann has 12 pens and gets 7 more. How many pens?"}]
    return [GenerateRequest(id="one", messages=user, n=1,
                            sampling=Sampling(seed=5, max_tokens=6)),
            GenerateRequest(id="two", messages=user, n=2,
                            sampling=Sampling(seed=6, max_tokens=5, temperature=0.8)),
            GenerateRequest(id="greedy", messages=user, n=1,
                            sampling=Sampling(seed=1, max_tokens=4, temperature=0.0))]


def test_engine_with_kernels_generates_the_same(noeos_dir):
    """Whole engines: batch-1 steps (the all-Triton step), several rows (Triton attention between
    eager layer halves), the Triton sampler (the first token too) and the bucketed prefill give
    the tokens and log-probs of the PyTorch engine."""
    ref = Engine(str(noeos_dir), Options(device="cpu"))
    fast = Engine(str(noeos_dir), Options(device="cpu", kernels=True, fused_b1=True,
                                          prefill_graph_max=128))
    try:
        assert fast.gen.triton and fast.gen.fused_b1
        for alone in (True, False):
            reqs = requests()[:1] if alone else requests()
            a, b = ref.generate(reqs), fast.generate(reqs)
            assert [c.tokens for c in a] == [c.tokens for c in b]
            for x, y in zip(a, b):
                assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs),
                                      atol=1e-5)
        # Log-probs still equal Score (the full forward pass).
        c = b[1]
        s = fast.score([ScoreRequest(tokens=c.tokens, prompt_tokens=c.prompt_tokens)])[0]
        assert torch.allclose(torch.tensor(c.logprobs), torch.tensor(s), atol=1e-5)
    finally:
        ref.close()
        fast.close()


def test_fused_head_trains_the_same(model_dirs):
    """A training step with the chunked head (Triton passes) moves the weights as the step on
    the whole logits does (Adam's ε = 1 makes the update linear in the gradient, so a rounding
    difference in a tiny gradient cannot become a full step)."""
    lc = LossConfig(lr=1.0, kl_loss_coef=0.1, entropy_coef=0.01, adam_eps=1.0)
    out = []
    for fused in (False, True):
        e = Engine(str(model_dirs["tiny"]), Options(device="cpu", fused_head=fused))
        e.trainer.head_triton = fused
        try:
            g = torch.Generator().manual_seed(0)
            V = e.cfg.vocab_size
            samples = []
            for i in range(3):
                p = torch.randint(0, V, (4 + i,), generator=g).tolist()
                r = torch.randint(0, V, (5 + i,), generator=g).tolist()
                old = e.score([ScoreRequest(tokens=r, prompt_tokens=p)])[0]
                samples.append(Sample(p, r, [1.0] * len(r), [x - 0.1 for x in old],
                                      [1.0 - i] * len(r), group=f"g{i % 2}"))
            st = e.train(Batch(samples=samples, loss=lc))
            out.append((st, [q.detach().clone() for q in e.model.parameters()]))
        finally:
            e.close()
    (a, wa), (b, wb) = out
    for k in ("loss", "pg_loss", "kl", "entropy", "grad_norm"):
        assert getattr(b, k) == pytest.approx(getattr(a, k), rel=1e-4, abs=1e-6), k
    for x, y in zip(wa, wb):
        assert torch.allclose(x, y, atol=1e-6)


def test_top_p_neighbour_leaves_other_rows_alone(noeos_dir):
    """With the Triton sampler, a request's tokens are the same alone and beside a top-p one
    (three draws a sample: the prefill's and two interpreted decode steps')."""
    fast = Engine(str(noeos_dir), Options(device="cpu", kernels=True))
    try:
        user = [{"role": "user", "content": "Ann has 3 pens."}]
        plain = GenerateRequest(id="plain", messages=user, n=2,
                                sampling=Sampling(seed=3, max_tokens=3, temperature=1.0))
        nucleus = GenerateRequest(id="nucleus", messages=[{"role": "user", "content": "Bo has 9 eggs."}], n=2,
                                  sampling=Sampling(seed=4, max_tokens=3, temperature=1.0,
                                                    top_p=0.8))
        alone = fast.generate([plain])
        both = fast.generate([GenerateRequest(id="plain2", messages=user, n=2,
                                              sampling=plain.sampling), nucleus])
        assert [c.tokens for c in alone] == [c.tokens for c in both[:2]]
    finally:
        fast.close()


def shared_generator(eng, share: bool, grouped: list | None = None):
    """A new generator of eng with shared prompts on or off; grouped, when given, records the rows
    in groups after each admission."""
    eng.opts.shared_prompts = share
    gen = eng.new_generator(eng.model)
    gen.bank = eng.bank
    if grouped is not None:
        group = gen._group

        def counting(keyed):
            group(keyed)
            grouped.append(gen.n_grouped)

        gen._group = counting
    return gen


def assert_same_completions(a: dict, b: dict, skip=()):
    """The completions of two runs, by key: the same tokens, log-probs within 1e-5."""
    assert a.keys() == b.keys()
    for key in a:
        if key in skip:
            continue
        assert a[key].tokens == b[key].tokens
        assert max(abs(x - y) for x, y in zip(a[key].logprobs, b[key].logprobs)) < 1e-5


def test_shared_prompt_groups_generate_the_same(noeos_dir, monkeypatch):
    """A request's samples admitted together read their prompt once as a group (Options
    shared_prompts, on by default): 3 requests × 4 samples and one × 10 (groups of 8 and 2) give
    the tokens and log-probs of a generator whose rows each read their own. After the first step
    the lead of one group leaves it (as a finished or idle row does) and its row's keys and values
    are overwritten: the group's other samples, now led by another row, are unaffected; and the
    followers of another group read the prompt from its lead's row, not from their own copies,
    which are zeroed. (Rows are
    never split here: on a GPU this few rows would be, and a split attention reads every row's
    own copy.)"""
    monkeypatch.setattr(K, "attention_splits", lambda *a, **k: 1)
    eng = Engine(str(noeos_dir), Options(device="cpu", kernels=True, slots=24))

    def run(share):
        gen = shared_generator(eng, share)
        got = {}
        for i, n in enumerate((4, 10, 4, 4)):
            prompt = [(7 * i + 3 * j) % 50 + 1 for j in range(5 + 2 * i)]
            # 3 tokens: the decode step after the rows' caches are changed below reads them.
            gen.add(Request(f"r{i}", prompt, n, Sampling(seed=i, max_tokens=3),
                            lambda c: got.__setitem__((c.request_id, c.index), c)))
        gen.step()  # admits all 22 samples and launches the first decode step
        rows = [s.slot for s in gen.slots if s is not None and s.req.id == "r2"]
        if share:
            assert gen.share and sum(x >= 0 for x in gen.lead) == 22
            big = [s.slot for s in gen.slots if s is not None and s.req.id == "r1"]
            assert gen.grp[big[0]].tolist() == big[:8] and gen.grp[big[8], :2].tolist() == big[8:]
            assert gen.lead[rows[0]] == rows[0]
        gen._ungroup([rows[0]])
        if share:
            assert gen.lead[rows[0]] == -1 and all(gen.lead[r] == rows[1] for r in rows[1:])
            assert gen.plen[rows[0]].item() == 0 and gen.grp[rows[1], :3].tolist() == rows[1:]
        for kc, vc in zip(gen.k, gen.v):
            kc[rows[0]].normal_()
            vc[rows[0]].normal_()
        if share:  # r0's followers' own copies of its 5-token prompt are not read
            r0 = [s.slot for s in gen.slots if s is not None and s.req.id == "r0"]
            for kc, vc in zip(gen.k, gen.v):
                kc[r0[1:], :, :5] = 0.0
                vc[r0[1:], :, :5] = 0.0
        while gen.busy():
            gen.step()
        return got

    try:
        a, b = run(True), run(False)
    finally:
        eng.close()
    assert len(a) == 22
    assert_same_completions(a, b, skip=[("r2", 0)])


def test_shared_prompts_flag(noeos_dir, monkeypatch):
    """--no-shared-prompts turns the grouping off (the default is on)."""
    seen = []
    monkeypatch.setattr(server, "serve", seen.append)
    for flags, want in (([], True), (["--no-shared-prompts"], False)):
        main(["serve", "--model", str(noeos_dir), "--device", "cpu"] + flags)
        assert server._options(seen[-1]).shared_prompts is want


def test_separate_requests_of_one_prompt_share_it(noeos_dir, monkeypatch):
    """slime's n_samples_per_prompt sends a prompt's samples as separate requests: admitted
    together they are prefilled once and read the prompt as one group, and give the tokens and
    log-probs of a generator that prefills and reads each on its own. (Two tokens: the prefill's
    and one interpreted decode step, which reads the prompt as the group.)"""
    monkeypatch.setattr(K, "attention_splits", lambda *a, **k: 1)
    eng = Engine(str(noeos_dir), Options(device="cpu", kernels=True, slots=16))
    grouped = []

    def run(share):
        gen = shared_generator(eng, share, grouped)
        got = {}
        prompts = [[5, 9, 13, 2, 7, 30, 4], [8, 1, 44, 6]]
        for i in range(10):  # 6 requests of the first prompt, 4 of the second, interleaved
            p = prompts[0] if i % 5 < 3 else prompts[1]
            gen.add(Request(f"r{i}", p, 1, Sampling(seed=i, max_tokens=2),
                            lambda c: got.__setitem__(c.request_id, c)))
        while gen.busy():
            gen.step()
        return got

    try:
        a, b = run(True), run(False)
    finally:
        eng.close()
    assert grouped == [10]  # one admission: groups of 6 and 4
    assert len(a) == 10
    assert_same_completions(a, b)
