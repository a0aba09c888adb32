"""LoRA adapters in the torch worker: the Go tiny engine's adapter (testdata/lora_peft, a PEFT
folder the Go engine saved, with the logits it computes) gives the same log-probs here; a batch
mixing adapters gives each row its own adapter's results; one training step of an adapter equals
a step computed on the folded weights W + s·B·A; peft loads what the worker saves."""

import json

import pytest
import torch
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_pre_hook

from conftest import REPO
from slimen_torch import lora
from slimen_torch import loss as L
from slimen_torch.engine import Engine, Options
from slimen_torch.types import Batch, GenerateRequest, LossConfig, Sample, Sampling, ScoreRequest

FIXTURE = REPO / "testdata" / "lora_peft"
BUILTIN = REPO / "engines" / "tiny" / "builtin" / "tiny-arith"


@pytest.fixture(scope="module")
def eng():
    e = Engine(str(BUILTIN), Options(device="cpu"))
    e.load_adapter(str(FIXTURE / "adapter"), "go")
    yield e
    e.close()


@pytest.fixture(scope="module")
def want():
    return json.loads((FIXTURE / "expected.json").read_text())


def expected_logprobs(want):
    lsm = torch.log_softmax(torch.tensor(want["logits"], dtype=torch.float64), -1)
    ids = want["ids"]
    return [lsm[i - 1, ids[i]].item() for i in range(1, len(ids))]


def test_adapter_of_the_go_engine_gives_its_logprobs(eng, want):
    ids = want["ids"]
    exp = expected_logprobs(want)
    got, base = eng.score([ScoreRequest(tokens=ids[1:], prompt_tokens=ids[:1], adapter="go"),
                           ScoreRequest(tokens=ids[1:], prompt_tokens=ids[:1])])
    assert max(abs(a - b) for a, b in zip(got, exp)) < 1e-4
    assert max(abs(a - b) for a, b in zip(base, exp)) > 1e-2, "the base must differ"
    # The KL reference of an adapter is the base without it.
    ref = eng.score([ScoreRequest(tokens=ids[1:], prompt_tokens=ids[:1], adapter="go",
                                  reference=True)])[0]
    assert ref == base


def test_generation_with_an_adapter_matches_its_scores(eng, want):
    prompt = want["ids"][:12]
    c = eng.generate([GenerateRequest(id="g", prompt_tokens=prompt, n=2, adapter="go",
                                      sampling=Sampling(max_tokens=6, temperature=1.0, seed=5))])
    for x in c:
        lp = eng.score([ScoreRequest(tokens=x.tokens, prompt_tokens=prompt, adapter="go")])[0]
        assert max(abs(a - b) for a, b in zip(lp, x.logprobs)) < 1e-4


def _random_adapter(e, name, seed, targets=("q_proj", "v_proj", "up_proj", "down_proj"), rank=2,
                    alpha=4.0, std=0.2):
    """An adapter with B drawn too (a new one computes what the base does): every parameter
    normal with standard deviation std."""
    e.add_adapter(name, lora.LoRAConfig(rank=rank, alpha=alpha, targets=targets), seed)
    ad = e.bank.adapters[name]
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ad.params():
            p.copy_(torch.randn(p.shape, generator=g) * std)
    e.bank.changed()
    return ad


def test_mixed_batch_gives_each_row_its_adapter(eng, want):
    _random_adapter(eng, "mix", 11)
    try:
        ids = want["ids"]
        rows = [("go", ids[:20], ids[20:30]), ("", ids[:15], ids[15:40]),
                ("mix", ids[:9], ids[9:25]), ("go", ids[:30], ids[30:33])]
        mixed = eng.score([ScoreRequest(tokens=t, prompt_tokens=p, adapter=a) for a, p, t in rows])
        for (a, p, t), got in zip(rows, mixed):
            alone = eng.score([ScoreRequest(tokens=t, prompt_tokens=p, adapter=a)])[0]
            assert max(abs(x - y) for x, y in zip(got, alone)) < 1e-5
        assert max(abs(x - y) for x, y in zip(mixed[0], eng.score(
            [ScoreRequest(tokens=rows[0][2], prompt_tokens=rows[0][1], adapter="mix")])[0])) > 1e-3
        # Generation: one batch of three adapters and the base, each row as when alone.
        greedy = Sampling(max_tokens=5, temperature=0.0)
        reqs = [GenerateRequest(id=f"r{i}", prompt_tokens=p, adapter=a, sampling=greedy)
                for i, (a, p, _) in enumerate(rows)]
        together = eng.generate(reqs)
        for r, c in zip(reqs, together):
            alone = eng.generate([GenerateRequest(id=r.id + "x", prompt_tokens=r.prompt_tokens,
                                                  adapter=r.adapter, sampling=greedy)])[0]
            assert c.tokens == alone.tokens
            assert max(abs(x - y) for x, y in zip(c.logprobs, alone.logprobs)) < 1e-5
    finally:
        eng.remove_adapter("mix")


def _folded_logprobs(model, ad, pairs):
    """Log-probs of the response tokens with each target weight replaced by W + s·B·A, A and B
    the adapter's parameters (gradients reach them through the sum)."""
    s = ad.cfg.scale
    params = dict(model.named_parameters())
    for i in range(model.cfg.layers):
        for attr, targets in lora.FUSED.items():
            parts = []
            for t in targets:
                out, inp = lora.proj_shape(model.cfg, t)
                if t in ad.a[i]:
                    parts.append(s * ad.b[i][t] @ ad.a[i][t])
                else:
                    parts.append(torch.zeros(out, inp))
            params[f"layers.{i}.{attr}"] = params[f"layers.{i}.{attr}"] + torch.cat(parts, 0)
    T = max(len(p) + len(r) for p, r in pairs)
    tokens = torch.zeros(len(pairs), T, dtype=torch.long)
    idx, targets = [], []
    for row, (p, r) in enumerate(pairs):
        tokens[row, :len(p) + len(r)] = torch.tensor(p + r)
        idx += range(row * T + len(p) - 1, row * T + len(p) - 1 + len(r))
        targets += r
    hidden = torch.func.functional_call(model, params, (tokens,)).flatten(0, 1)[torch.tensor(idx)]
    logits = F.linear(hidden, params["embed"] if model.lm_head is None else params["lm_head"])
    return torch.log_softmax(logits.double(), -1).gather(1, torch.tensor(targets)[:, None]).squeeze(1)


# float32's unit roundoff.
EPS32 = torch.finfo(torch.float32).eps


def test_one_training_step_matches_the_folded_reference(want):
    """One training step of an adapter takes the gradient of the same loss on the folded weights
    W + s·B·A, and AdamW's step of that gradient.

    The two are compared separately because AdamW's first step is lr·g/(|g| + eps), eps = 1e-8:
    about lr·sign(g) for any gradient well above eps, and for a gradient near eps it moves with
    g at a slope of up to lr/(4·eps) = 2.5e5 (lr = 1e-2). The engine (x·Wᵀ + s·(x·Aᵀ)·Bᵀ) and
    the folded reference sum the same products in other orders, so their float32 gradients
    differ by rounding; an entry whose gradient is itself a few times 1e-8 turns that rounding
    into a weight difference of 1e-5 and more, on whichever entry the CPU's BLAS kernel happens
    to round differently. Comparing the weights after the step with a fixed atol tests rounding.
    """
    e = Engine(str(BUILTIN), Options(device="cpu"))
    try:
        ad = _random_adapter(e, "t", 3, targets=lora.TARGETS, rank=3)
        ids = want["ids"]
        pairs = [(ids[:10], ids[10:20]), (ids[:25], ids[25:31])]
        old = e.score([ScoreRequest(tokens=r, prompt_tokens=p, adapter="t") for p, r in pairs])
        adv = [[1.0] * len(pairs[0][1]), [-0.5] * len(pairs[1][1])]
        lc = LossConfig(lr=1e-2, eps_clip=0.2, eps_clip_high=0.2, max_grad_norm=0.0)
        batch = Batch(samples=[Sample(prompt=p, response=r, loss_mask=[1.0] * len(r),
                                      old_logprobs=o, advantages=a)
                               for (p, r), o, a in zip(pairs, old, adv)], loss=lc, adapter="t")
        # The reference: the same loss on the folded weights, its gradient on clones of A and B.
        ref = lora.Adapter("ref", ad.cfg, e.cfg, "cpu", torch.float32)
        with torch.no_grad():
            for p, q in zip(ref.params(), ad.params()):
                p.copy_(q)
        model = e.model
        lp = _folded_logprobs(model, ref, pairs).float()
        cfg = L.resolve(lc)
        w = L.token_weights(["", ""], [s.loss_mask for s in batch.samples], cfg.aggregation)
        flat = lambda vs: torch.tensor([x for v in vs for x in v], dtype=torch.float32)  # noqa: E731
        seq = torch.repeat_interleave(torch.arange(2), torch.tensor([len(r) for _, r in pairs]))
        out = L.policy_loss(cfg, lp, flat(old), flat(adv), flat(s.loss_mask for s in batch.samples),
                            flat(w), entropy=torch.zeros_like(lp), ref_logp=None, seq=seq, n_seqs=2)
        out["loss"].backward()
        want_grads = [q.grad.detach().clone() for q in ref.params()]
        # The gradients the engine's optimizer steps with, read as its step begins.
        mine = {id(p): i for i, p in enumerate(ad.params())}
        got_grads = [None] * len(mine)

        def seen(opt, args, kwargs):
            for g in opt.param_groups:
                for p in g["params"]:
                    if id(p) in mine:
                        got_grads[mine[id(p)]] = p.grad.detach().clone()

        hook = register_optimizer_step_pre_hook(seen)
        before = [p.detach().clone() for p in ad.params()]
        try:
            stats = e.train(batch)
        finally:
            hook.remove()
        assert not stats.skipped
        assert abs(stats.loss - out["loss"].item()) < 1e-5
        # 1. The gradients. Each entry is float32 sums of products over at most 192 terms (the
        # MLP's width) in each of the forward and backward passes' dozen reductions; in two
        # summation orders they agree to about 2 · 12 · 192 · EPS32 ≈ 2^-10 of the tensor's
        # largest gradient (rounding is about 2^-18 of it here). A gradient that is wrong (the
        # scale s, a target's slice of a fused matrix, a missing target) is off by O(max |g|).
        for (n, _), g, r in zip(ad.named(), got_grads, want_grads):
            assert g is not None, f"{n}: the engine's optimizer had no gradient for it"
            tol = 2 * 12 * 192 * EPS32 * r.abs().max().item()
            assert torch.allclose(g, r, rtol=0.0, atol=tol), \
                f"{n}: gradient off the folded reference's by {(g - r).abs().max().item():.3g} > {tol:.3g}"
        # 2. The step: AdamW's (weight decay 0) of the engine's own gradient, to a few float32
        # roundings of the weights (the update itself is computed in float32 too).
        step = [b.clone().requires_grad_() for b in before]
        for s, g in zip(step, got_grads):
            s.grad = g.clone()
        torch.optim.AdamW(step, lr=lc.lr, weight_decay=0.0).step()
        for (n, p), s, b in zip(ad.named(), step, before):
            tol = 4 * EPS32 * (b.abs().max().item() + lc.lr)
            assert torch.allclose(p, s, rtol=0.0, atol=tol), \
                f"{n}: not AdamW's step of its gradient (off by {(p - s).abs().max().item():.3g})"
            assert not torch.equal(p, b), f"{n} did not move"
        # The base did not change and has no gradients.
        assert all(p.grad is None and not p.requires_grad for p in e.model.parameters())
    finally:
        e.close()


def test_peft_loads_the_saved_adapter_and_resume(tmp_path, want):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM
    e = Engine(str(BUILTIN), Options(device="cpu"))
    try:
        _random_adapter(e, "p", 8, targets=("q_proj", "k_proj", "o_proj", "gate_proj"), rank=4)
        ids = want["ids"]
        pairs = [(ids[:10], ids[10:20])]
        old = e.score([ScoreRequest(tokens=r, prompt_tokens=p, adapter="p") for p, r in pairs])
        batch = Batch(samples=[Sample(prompt=p, response=r, loss_mask=[1.0] * len(r),
                                      old_logprobs=o, advantages=[1.0] * len(r))
                               for (p, r), o in zip(pairs, old)], loss=LossConfig(lr=1e-2), adapter="p")
        e.train(batch)
        e.save(str(tmp_path / "a"), adapter="p")
        assert {f.name for f in (tmp_path / "a").iterdir()} >= {lora.CONFIG_FILE, lora.WEIGHTS_FILE,
                                                               lora.OPT_FILE, lora.OPT_STATE_FILE}
        got = e.score([ScoreRequest(tokens=ids[1:], prompt_tokens=ids[:1], adapter="p")])[0]
        base = AutoModelForCausalLM.from_pretrained(BUILTIN, dtype=torch.float32)
        m = peft.PeftModel.from_pretrained(base, tmp_path / "a").eval()
        with torch.no_grad():
            logits = m(torch.tensor([ids])).logits[0].double()
        lsm = torch.log_softmax(logits, -1)
        ref = [lsm[i - 1, ids[i]].item() for i in range(1, len(ids))]
        assert max(abs(a - b) for a, b in zip(got, ref)) < 1e-4
        # Resume: the folder loaded into another adapter scores and trains on alike.
        e.load_adapter(str(tmp_path / "a"), "q")
        again = e.score([ScoreRequest(tokens=ids[1:], prompt_tokens=ids[:1], adapter="q")])[0]
        assert again == got
        s1 = e.train(Batch(samples=batch.samples, loss=batch.loss, adapter="p"))
        s2 = e.train(Batch(samples=batch.samples, loss=batch.loss, adapter="q"))
        assert s1.loss == s2.loss and s1.grad_norm == s2.grad_norm
        for p, q in zip(e.bank.adapters["p"].params(), e.bank.adapters["q"].params()):
            assert torch.equal(p, q)
    finally:
        e.close()


def test_errors_name_the_adapter(eng):
    from slimen_torch.types import RequestError
    with pytest.raises(RequestError, match="no adapter 'nope'"):
        eng.score([ScoreRequest(tokens=[1], prompt_tokens=[2], adapter="nope")])
    with pytest.raises(RequestError, match="name the adapter"):
        eng.train(Batch(samples=[], loss=LossConfig()))
    with pytest.raises(ValueError, match="lora target 'x_proj'"):
        eng.add_adapter("bad", lora.LoRAConfig(rank=2, alpha=2, targets=("x_proj",)), 1)


def test_adapters_over_grpc(tmp_path, want):
    """AddAdapter, Load/Save of an adapter, and the adapter field of Score, Generate (one stream
    message mixing adapters) and Train, through the server."""
    import shutil

    import grpc

    from slimen_torch.proto import engine_pb2 as pb
    from slimen_torch.proto import engine_pb2_grpc as pb_grpc
    from slimen_torch.server import make_server

    e = Engine(str(BUILTIN), Options(device="cpu"))
    server, service, port = make_server("127.0.0.1:0", roots=[str(tmp_path)])
    service.engine, service.loading = e, False
    ch = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.EngineStub(ch)
    try:
        assert stub.AddAdapter(pb.AddAdapterRequest(name="a", rank=2, alpha=4, targets=["q_proj", "v_proj"],
                                                    seed=1)).params > 0
        shutil.copytree(FIXTURE / "adapter", tmp_path / "go")
        stub.Load(pb.LoadRequest(dir=str(tmp_path / "go"), adapter="go"))
        ids = want["ids"]
        got = stub.Score(pb.ScoreBatchRequest(requests=[
            pb.ScoreRequest(prompt_tokens=ids[:1], tokens=ids[1:], adapter="go")])).scores[0].logprobs
        assert max(abs(a - b) for a, b in zip(got, expected_logprobs(want))) < 1e-4
        greedy = pb.Sampling(max_tokens=5, temperature=0.0)
        msg = pb.GenerateStreamRequest(requests=[
            pb.GenerateRequest(id="x", prompt_tokens=ids[:12], sampling=greedy, adapter="go"),
            pb.GenerateRequest(id="y", prompt_tokens=ids[:12], sampling=greedy)])
        comps = {c.request_id: c for r in stub.Generate(iter([msg]), timeout=60) for c in r.completions}
        for rid, ad in (("x", "go"), ("y", "")):
            direct = e.generate([GenerateRequest(id=rid + "d", prompt_tokens=ids[:12], adapter=ad,
                                                 sampling=Sampling(max_tokens=5, temperature=0.0))])[0]
            assert list(comps[rid].tokens) == direct.tokens
        assert list(comps["x"].tokens) != list(comps["y"].tokens) or \
            list(comps["x"].logprobs) != pytest.approx(list(comps["y"].logprobs))
        r = ids[12:20]
        b = pb.Batch(id="s1", samples=[pb.Sample(prompt=ids[:12], response=r, loss_mask=[1.0] * len(r),
                                                 old_logprobs=[-3.0] * len(r), advantages=[1.0] * len(r))],
                     loss=pb.LossConfig(lr=1e-2, eps_clip=0.2, eps_clip_high=0.2))
        first = stub.Train(pb.TrainRequest(batch=b, adapter="a"))
        again = stub.Train(pb.TrainRequest(batch=b, adapter="a"))
        other = stub.Train(pb.TrainRequest(batch=b, adapter="go"))
        assert first.stats.tokens == len(r) and again.duplicate and not other.duplicate
        stub.Save(pb.SaveRequest(dir=str(tmp_path / "saved"), adapter="a"))
        assert (tmp_path / "saved" / lora.CONFIG_FILE).exists()
        with pytest.raises(grpc.RpcError) as err:
            stub.Score(pb.ScoreBatchRequest(requests=[pb.ScoreRequest(prompt_tokens=[1], tokens=[2], adapter="no")]))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        stub.RemoveAdapter(pb.RemoveAdapterRequest(name="a"))
        assert e.adapter_names() == ["go"]
    finally:
        ch.close()
        server.stop(0).wait()
        e.close()


def test_bf16_adapter_resumes_its_fp32_masters(tmp_path):
    """In bf16 (as on a GPU) an adapter trains fp32 master copies; its saved folder holds them, and
    a load resumes from them (not from the rounded weights): the two adapters train on alike."""
    e = Engine(str(BUILTIN), Options(device="cpu", dtype="bfloat16"))
    try:
        e.add_adapter("p", lora.LoRAConfig(rank=4, alpha=8, targets=("q_proj", "v_proj")), 3)
        ids = list(range(10, 40))
        b = Batch(samples=[Sample(prompt=ids[:10], response=ids[10:20], loss_mask=[1.0] * 10,
                                  old_logprobs=[-3.0] * 10, advantages=[1.0] * 10)],
                  loss=LossConfig(lr=1e-2), adapter="p")
        e.train(b)
        e.save(str(tmp_path / "p"), adapter="p")
        e.load_adapter(str(tmp_path / "p"), "q")
        tp, tq = e.bank.adapters["p"].trainer, e.bank.adapters["q"].trainer
        assert tp.mixed and any(not torch.equal(m.to(torch.bfloat16).float(), m) for m in tp.masters)
        assert all(torch.equal(x, y) for x, y in zip(tp.masters, tq.masters))
        s1 = e.train(Batch(samples=b.samples, loss=b.loss, adapter="p"))
        s2 = e.train(Batch(samples=b.samples, loss=b.loss, adapter="q"))
        assert s1.loss == s2.loss
        assert all(torch.equal(x, y) for x, y in zip(tp.masters, tq.masters))
    finally:
        e.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_bf16_adapter_takes_the_fused_optimizer_step_on_the_gpu():
    """On a GPU an adapter's trainer takes the one-pass optimizer step (kernels.adamw): two
    adapters alike, one with the unfused step, train alike over two steps (updates within the
    GPU's rounding), and the fused one never falls back."""
    e = Engine(str(BUILTIN), Options(device="cuda:0", dtype="bfloat16"))
    try:
        cfg = lora.LoRAConfig(rank=4, alpha=8, targets=("q_proj", "v_proj"))
        e.add_adapter("p", cfg, 3)
        e.add_adapter("q", cfg, 3)
        # The trainers as the first train step makes them, q's before it runs.
        tp, tq = (e._call(e._adapter_trainer, e.bank.adapters[n]) for n in ("p", "q"))
        tq.fused_step = False
        ids = list(range(10, 40))
        for _ in range(2):
            stats = []
            for name in ("p", "q"):
                b = Batch(samples=[Sample(prompt=ids[:10], response=ids[10:20],
                                          loss_mask=[1.0] * 10, old_logprobs=[-3.0] * 10,
                                          advantages=[1.0] * 10)],
                          loss=LossConfig(lr=1e-2, max_grad_norm=1.0), adapter=name)
                stats.append(e.train(b))
            assert stats[0].loss == pytest.approx(stats[1].loss, rel=1e-3)
            assert tp.fused_step and not tp.compile_error and tp.mixed
            for x, y in zip(tp.masters, tq.masters, strict=True):
                assert torch.allclose(x, y, rtol=2e-2, atol=2e-3 * y.abs().max().item())
    finally:
        e.close()
