"""Training on the CPU: a step lowers the loss, micro-batching does not change the step, the KL
reference, skipped steps, and optimizer state that survives save and load."""

import math
import pathlib

import pytest
import torch

from slimen_torch.engine import Engine, Options
from slimen_torch.train import token_logprobs
from slimen_torch.types import Batch, LossConfig, Sample, ScoreRequest


def fixed_batch(e: Engine, lc: LossConfig, seed=0) -> Batch:
    """Four samples in two groups, with rollout log-probs equal to the model's own."""
    g = torch.Generator().manual_seed(seed)
    V = e.cfg.vocab_size
    samples = []
    for i in range(4):
        prompt = torch.randint(0, V, (5 + i,), generator=g).tolist()
        response = torch.randint(0, V, (6 + 2 * i,), generator=g).tolist()
        old = e.score([ScoreRequest(tokens=response, prompt_tokens=prompt)])[0]
        adv = 1.0 if i % 2 == 0 else -1.0
        mask = [1.0] * len(response)
        mask[0] = 0.0  # an injected token: not trained
        samples.append(Sample(prompt, response, mask, old, [adv] * len(response),
                              group=f"g{i // 2}"))
    return Batch(samples=samples, loss=lc)


def weights(e: Engine):
    return [p.detach().clone() for p in e.model.parameters()]


def test_train_step_lowers_the_loss(model_dirs):
    e = Engine(str(model_dirs["tiny-qwen3"]))
    try:
        # group_token_mean: the default per-sample mean is 0 here (advantages ±1 alternate).
        lc = LossConfig(lr=1e-2, eps_clip=0.2, eps_clip_high=0.28, aggregation="group_token_mean")
        batch = fixed_batch(e, lc)
        first = e.train(batch)
        assert not first.skipped
        assert first.tokens == sum(len(s.response) - 1 for s in batch.samples)
        # At the rollout policy the ratio is 1: loss = −(mean over groups of the token-mean
        # advantage), and nothing is clipped. g0: (5·1 − 7·1)/12; g1: (9·1 − 11·1)/20.
        assert first.loss == pytest.approx(-((-2 / 12) + (-2 / 20)) / 2, abs=1e-5)
        assert first.clip_frac == 0.0 and first.grad_norm > 0
        # Each step reports the loss before its update: the second reports the first's effect.
        second = e.train(batch)
        assert second.loss < first.loss - 1e-2
        assert second.clip_frac > 0  # the ratios moved, some past the clip range
    finally:
        e.close()


def test_micro_batches_give_the_same_step(model_dirs):
    lc = LossConfig(lr=1e-2, kl_loss_coef=0.1, entropy_coef=0.01)
    results = []
    for budget in (4096, 16):  # one micro-batch, or one sample per micro-batch
        e = Engine(str(model_dirs["tiny"]), Options(micro_batch_tokens=budget))
        try:
            start = weights(e)
            batch = fixed_batch(e, lc)
            s1 = e.train(batch)
            s2 = e.train(batch)
            results.append((s1, s2, [w - w0 for w, w0 in zip(weights(e), start)]))
        finally:
            e.close()
    (a1, a2, da), (b1, b2, db) = results
    for x, y in ((a1, b1), (a2, b2)):
        for f in ("loss", "pg_loss", "kl", "entropy", "clip_frac", "grad_norm"):
            assert getattr(x, f) == pytest.approx(getattr(y, f), rel=1e-5, abs=1e-7), f
    assert a2.kl > 0  # the policy moved away from the reference
    # The same update up to summation order (Adam magnifies rounding on near-zero gradients, so
    # compare the whole update, not each entry).
    diff = torch.cat([(p - q).flatten() for p, q in zip(da, db)]).norm()
    assert diff <= 1e-3 * torch.cat([p.flatten() for p in da]).norm()


def test_non_finite_loss_skips_the_step(model_dirs):
    e = Engine(str(model_dirs["tiny"]))
    try:
        batch = fixed_batch(e, LossConfig(lr=1e-2))
        batch.samples[0].advantages = [math.nan] * len(batch.samples[0].response)
        before = weights(e)
        st = e.train(batch)
        assert st.skipped and "non-finite loss" in st.reason
        assert all(torch.equal(p, q) for p, q in zip(before, weights(e)))
    finally:
        e.close()


def test_bad_batches_are_refused(engine):
    from slimen_torch.types import RequestError
    bad = Batch(samples=[Sample([1], [2, 3], [1.0], [0.0, 0.0], [1.0, 1.0])])
    with pytest.raises(RequestError, match="loss_mask"):
        engine.train(bad)
    with pytest.raises(ValueError, match="kl_loss_type"):
        engine.train(Batch(samples=[], loss=LossConfig(kl_loss_type="k9")))


def test_optimizer_state_survives_save_and_load(model_dirs, tmp_path):
    lc = LossConfig(lr=5e-3)
    a = Engine(str(model_dirs["tiny-qwen2"]))
    try:
        batch = fixed_batch(a, lc)
        a.train(batch)
        a.save(str(tmp_path / "ck"))
        b = Engine(str(tmp_path / "ck"))
        try:
            sa, sb = a.train(batch), b.train(batch)
            assert sa.loss == pytest.approx(sb.loss, rel=1e-6)
            for p, q in zip(weights(a), weights(b)):
                assert torch.allclose(p, q, atol=1e-7)
            # Load in place replaces weights and optimizer state, in the engine's own trainer.
            trainer = a.trainer
            a.load(str(tmp_path / "ck"))
            assert a.trainer is trainer
            b.load(str(tmp_path / "ck"))
            assert a.train(batch).loss == pytest.approx(b.train(batch).loss, rel=1e-6)
        finally:
            b.close()
    finally:
        a.close()


def test_info_names_the_start_model_and_loading_it_resets(model_dirs, tmp_path):
    """info() reports the folder the engine started from, even after a load; loading it puts
    back the start weights and a fresh optimizer (how a host resets a served engine it trains)."""
    lc = LossConfig(lr=5e-3)
    start = pathlib.Path(model_dirs["tiny-qwen2"]).absolute()
    a, fresh = Engine(str(model_dirs["tiny-qwen2"])), Engine(str(start))
    try:
        batch = fixed_batch(a, lc)
        a.train(batch)
        a.save(str(tmp_path / "ck"))
        a.load(str(tmp_path / "ck"))
        assert a.info()["model"] == str(start)
        a.load(a.info()["model"])
        assert a.train(batch).loss == pytest.approx(fresh.train(batch).loss, rel=1e-6)
        for p, q in zip(weights(a), weights(fresh)):
            assert torch.allclose(p, q, atol=1e-7)
    finally:
        a.close()
        fresh.close()


def test_sft_learns_a_response(model_dirs, tmp_path):
    """The supervised warm-up: the NLL of the taught pairs falls."""
    e = Engine(str(model_dirs["tiny"]))
    try:
        pairs = [(e.tokenizer.encode_chat([{"role": "user", "content": f"{i}+1?"}]),
                  e.tokenizer.encode(f"\\boxed{{{i + 1}}}") + [e.eos[0]]) for i in range(8)]
        lc = LossConfig(lr=1e-2)
        losses = [e.sft_step(pairs, lc).loss for _ in range(15)]
        assert losses[-1] < 0.7 * losses[0], losses
    finally:
        e.close()


def test_sft_command_stops_at_max_seconds(model_dirs, tmp_path):
    """`sft --max-seconds` ends early and still saves a model folder."""
    from slimen_torch.__main__ import main
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1?", "label": "2"}\n{"prompt": "2+1?", "response": "3"}\n')
    out = tmp_path / "out"
    main(["sft", "--model", str(model_dirs["tiny"]), "--data", str(data), "--out", str(out),
          "--steps", "100000", "--batch-size", "2", "--max-seconds", "0.5", "--device", "cpu",
          "--compile-train", "off"])
    assert (out / "model.safetensors").exists() and (out / "optimizer.pt").exists()
    assert torch.load(out / "optimizer.pt")["steps"] < 100000


def test_activation_checkpointing_gives_the_same_step(model_dirs):
    lc = LossConfig(lr=1e-2, entropy_coef=0.01)
    stats = []
    for ckpt in (False, True):
        e = Engine(str(model_dirs["tiny-qwen3"]), Options(grad_checkpointing=ckpt))
        try:
            batch = fixed_batch(e, lc)
            e.train(batch)
            stats.append(e.train(batch))
        finally:
            e.close()
    for f in ("loss", "pg_loss", "entropy", "grad_norm", "clip_frac"):
        assert getattr(stats[0], f) == pytest.approx(getattr(stats[1], f), rel=1e-5, abs=1e-7), f


def test_score_with_the_reference(model_dirs):
    # reference=True scores with the frozen KL reference: after a step it still gives the
    # starting log-probs, while a plain request gives the trained model's.
    e = Engine(str(model_dirs["tiny-qwen3"]))
    try:
        batch = fixed_batch(e, LossConfig(lr=1e-2))
        reqs = [ScoreRequest(tokens=s.response, prompt_tokens=s.prompt) for s in batch.samples]
        before = e.score(reqs)
        assert "reference" in e.info()["capabilities"]
        assert not e.train(batch).skipped
        mixed = [ScoreRequest(tokens=r.tokens, prompt_tokens=r.prompt_tokens, reference=i % 2 == 0)
                 for i, r in enumerate(reqs)]
        now, got = e.score(reqs), e.score(mixed)
        for i, (b, n, g) in enumerate(zip(before, now, got)):
            assert g == pytest.approx(b if i % 2 == 0 else n, abs=1e-5)
            assert max(abs(x - y) for x, y in zip(b, n)) > 1e-3
    finally:
        e.close()


@pytest.mark.parametrize("mode", ["tis", "icepop"])
def test_tis_weights_the_step_by_the_rollout_ratio(model_dirs, mode):
    # Rollout log-probs off the trainer's by log 3, 0 and −log 3 in turn: ratios ρ of 3, 1 and
    # 1/3 against the band [0.5, 2]. The trainer's old log-probs are the model's own (computed by
    # the engine, or sent as train_logprobs), so the PPO ratio is 1 and the loss is
    # −mean(A·w) with w = clamp(ρ) (tis: 2, 1, 0.5) or ρ in the band, else 0 (icepop: 0, 1, 0).
    d = [math.log(3), 0.0, -math.log(3)]
    w = {"tis": [2.0, 1.0, 0.5], "icepop": [0.0, 1.0, 0.0]}[mode]
    results = []
    for send in (False, True):
        e = Engine(str(model_dirs["tiny-qwen3"]))
        try:
            lc = LossConfig(lr=1e-2, aggregation="token_sum", use_tis=True, tis_mode=mode,
                            tis_clip=2.0, tis_clip_low=0.5)
            batch = fixed_batch(e, lc)
            want_loss, want_w, changed, tokens = 0.0, 0.0, 0, 0
            for s in batch.samples:
                if send:
                    s.train_logprobs = list(s.old_logprobs)
                s.old_logprobs = [x - d[t % 3] for t, x in enumerate(s.old_logprobs)]
                for t, m in enumerate(s.loss_mask):
                    if m:
                        tokens += 1
                        want_loss += -s.advantages[t] * w[t % 3]
                        want_w += w[t % 3]
                        changed += t % 3 != 1
            st = e.train(batch)
            assert not st.skipped and st.tokens == tokens
            assert st.loss == pytest.approx(want_loss, abs=1e-4)
            assert st.tis_clip_frac == pytest.approx(changed / tokens)
            assert st.tis_weight == pytest.approx(want_w / tokens, abs=1e-5)
            results.append(weights(e))
        finally:
            e.close()
    # The engine's own old log-probs and the same ones sent by the host give the same step.
    for a, b in zip(*results):
        assert torch.allclose(a, b, atol=1e-6)


def test_max_grad_norm_clips(model_dirs):
    """max_grad_norm scales the gradients down to that norm (with a large Adam epsilon the update
    is about proportional to the gradient, so a clipped step moves the weights less)."""
    moved = []
    for clip in (0.0, 1e-3):
        e = Engine(str(model_dirs["tiny"]))
        try:
            before = weights(e)
            lc = LossConfig(lr=1e-2, adam_eps=1.0, max_grad_norm=clip,
                            aggregation="group_token_mean")
            s = e.train(fixed_batch(e, lc))
            assert s.grad_norm > 1e-2  # the norm before the clip, well above it
            moved.append(sum((a - b).abs().sum().item() for a, b in zip(weights(e), before)))
        finally:
            e.close()
    assert moved[1] < moved[0] / 5


def test_mixed_precision_step_equals_the_per_parameter_casts(model_dirs):
    """bf16 parameters with fp32 masters (the GPU's layout, here on the CPU): the gradients cast
    into one flat fp32 buffer by one multi-tensor copy, the sums and the norm read back at once,
    and the masters copied back by one multi-tensor copy give bit for bit the step of a cast and
    a copy per parameter (the code before), over two steps with clipping."""
    from bench import per_parameter

    lc = LossConfig(lr=1e-2, max_grad_norm=0.05)
    runs = []
    for old in (False, True):
        e = Engine(str(model_dirs["tiny-qwen3"]), Options(dtype="bfloat16"))
        try:
            assert e.trainer.mixed
            if old:
                per_parameter(e.trainer)
            batch = fixed_batch(e, lc)
            stats = [e.train(batch) for _ in range(2)]
            runs.append(([(s.loss, s.grad_norm, s.tokens) for s in stats], weights(e),
                         [m.detach().clone() for m in e.trainer.masters]))
            assert all(m.grad is None for m in e.trainer.masters)
            assert all(p.grad is None for p in e.trainer.params)
        finally:
            e.close()
    (s_new, w_new, m_new), (s_old, w_old, m_old) = runs
    assert s_new == s_old and s_new[0][1] > 0.05  # clipped
    assert all(torch.equal(a, b) for a, b in zip(w_new, w_old))
    assert all(torch.equal(a, b) for a, b in zip(m_new, m_old))
    assert all(w.dtype == torch.bfloat16 for w in w_new)


def test_packed_pairs_equal_the_lists():
    """Packed builds what the lists gave (padded tokens, the predicting positions, the targets,
    each token's row, the per-token values rounded to fp32 as torch.tensor rounds them), for rows
    of different lengths, one with an empty response."""
    from slimen_torch.train import Packed

    g = torch.Generator().manual_seed(3)
    lens = [(5, 7), (1, 1), (9, 0), (3, 12)]
    pairs = [(torch.randint(0, 1000, (p,), generator=g).tolist(),
              torch.randint(0, 1000, (r,), generator=g).tolist()) for p, r in lens]
    vals = [[0.1 * (i + 1) * (t - 3) for t in range(len(r))] for i, (_, r) in enumerate(pairs)]
    pk = Packed(pairs, torch.device("cpu"), {"v": vals, "one": [[1] * len(r) for _, r in pairs]})
    T = max(len(p) + len(r) for p, r in pairs)
    tokens = torch.zeros(len(pairs), T, dtype=torch.long)
    idx, targets, seq = [], [], []
    for row, (p, r) in enumerate(pairs):
        tokens[row, :len(p) + len(r)] = torch.tensor(p + r)
        idx.extend(range(row * T + len(p) - 1, row * T + len(p) - 1 + len(r)))
        targets.extend(r)
        seq.extend([row] * len(r))
    assert torch.equal(pk.tokens, tokens)
    assert pk.idx.tolist() == idx and pk.targets.tolist() == targets and pk.seq.tolist() == seq
    assert torch.equal(pk.v, torch.tensor([x for v in vals for x in v], dtype=torch.float32))
    assert pk.v.dtype == torch.float32 and pk.one.tolist() == [1.0] * len(idx)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_training_step_waits_for_the_gpu_once(model_dirs):
    """On a GPU a step's host work never waits for its kernels except for the one read-back of
    the sums and the gradient norm (a tensor made from a list on the GPU waits for every kernel
    before it: made between a micro-batch's forward and its loss, they left the GPU idle)."""
    from bench import step_syncs

    e = Engine(str(model_dirs["tiny-qwen3"]), Options(device="cuda:0", dtype="bfloat16",
                                                      compile_train="", micro_batch_tokens=40))
    try:
        lc = LossConfig(lr=1e-3, max_grad_norm=1.0, use_tis=True, kl_loss_coef=0.1)
        batch = fixed_batch(e, lc)
        e.trainer.reference = lambda: e.model
        assert len(e.trainer._plan([len(s.prompt) + len(s.response)
                                    for s in batch.samples])) > 1
        e.trainer.step(batch)  # the optimizer's state and the caches made
        syncs = step_syncs(e.trainer, batch)
        assert len(syncs) == 1, syncs
    finally:
        e.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_chunked_head_in_bf16_on_the_gpu():
    """kernels.linear_logprobs in bf16 on a GPU, where each chunk's weight gradient is summed
    into the fp32 total by the GEMM itself (addmm with out_dtype): log-probs and both gradients
    against the fp32 head on the same bf16 values, in one chunk and in several."""
    from slimen_torch import kernels as K
    g = torch.Generator(device="cuda").manual_seed(3)
    N, H, V = 300, 64, 5000
    h = torch.randn(N, H, generator=g, device="cuda").bfloat16()
    W = (torch.randn(V, H, generator=g, device="cuda") * 0.2).bfloat16()
    tg = torch.randint(0, V, (N,), generator=g, device="cuda")
    a = torch.randn(N, generator=g, device="cuda")
    h32, W32 = h.float().requires_grad_(), W.float().requires_grad_()
    lp, _ = token_logprobs(h32 @ W32.t(), tg, entropy_grad=False)
    want = torch.autograd.grad((lp * a).sum(), (h32, W32))
    for budget in (1 << 24, 40 * V):  # one chunk, or eight
        hb, Wb = h.clone().requires_grad_(), W.clone().requires_grad_()
        lp2, _ = K.linear_logprobs(hb, Wb, tg, budget=budget)
        got = torch.autograd.grad((lp2 * a).sum(), (hb, Wb))
        assert got[1].dtype == torch.bfloat16
        assert ((lp2 - lp).norm() / lp.norm()).item() < 1e-2
        for x, y in zip(got, want):
            assert ((x.float() - y).norm() / y.norm()).item() < 2e-2


def test_a_step_decided_on_the_device_equals_the_host_decision(model_dirs):
    """The fused optimizer's step launched before the read-back (the GPU's way: the clip scaled on
    the device, a non-finite loss skipped through found_inf) gives bit for bit what the host's
    decision after the read-back gives, over a clipped step, a skipped one and a third (here on
    the CPU, with the same fused AdamW both ways; bf16 parameters with fp32 masters)."""
    runs = []
    for ahead in (True, False):
        e = Engine(str(model_dirs["tiny-qwen3"]), Options(dtype="bfloat16"))
        try:
            tr = e.trainer
            tr._optimizer()
            tr.opt = torch.optim.AdamW(tr.masters, lr=0.0, fused=True)
            tr.step_ahead = ahead
            tr.fused_step = False  # torch's fused AdamW, not the one-pass kernel (tested below)
            lc = LossConfig(lr=1e-2, max_grad_norm=0.05, weight_decay=0.1)
            good = fixed_batch(e, lc)
            bad = fixed_batch(e, lc, seed=1)
            bad.samples[1].advantages = [math.inf] * len(bad.samples[1].response)
            stats = [e.train(b) for b in (good, bad, good)]
            runs.append(([(s.loss, s.grad_norm, s.skipped, s.reason) for s in stats],
                         weights(e), [m.detach().clone() for m in tr.masters],
                         [float(st["step"]) for st in tr.opt.state.values()], tr.steps))
        finally:
            e.close()
    (s1, w1, m1, steps1, n1), (s2, w2, m2, steps2, n2) = runs
    assert s1 == s2 and s1[0][1] > 0.05 and s1[1][2] and not s1[2][2]
    assert all(torch.equal(a, b) for a, b in zip(w1, w2))
    assert all(torch.equal(a, b) for a, b in zip(m1, m2))
    assert steps1 == steps2 == [2.0] * len(steps1) and n1 == n2 == 2


def bf16_close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """bf16 tensors one unit in the last place apart at most (2⁻⁷ of the value), or 1e-6 of the
    largest value (a weight that an update all but cancels, rounded from fp32 values that agree
    to fp32 rounding of the operands)."""
    a, b = a.float(), b.float()
    return bool(((a - b).abs() <= 2 ** -7 * b.abs() + 1e-6 * b.abs().max()).all())


def trainer_state(e: Engine, stats) -> dict:
    tr = e.trainer
    return dict(stats=stats, weights=weights(e), masters=[m.detach().clone() for m in tr.masters],
                state=[{k: v.clone() for k, v in s.items()} for s in tr.opt.state.values()],
                steps=tr.steps,
                grads=[t.grad for t in tr.params + tr.masters if t.grad is not None])


def lockstep(fused: Engine, old: Engine, batches, check) -> list[dict]:
    """Trains both engines on each batch from the same state (old's weights, masters and AdamW
    state replaced by fused's before each step) and check(fused's, old's, the masters before)
    after each step; a master one fp32 ulp apart can round to another bf16 weight, and the next
    gradients differ. Returns fused's states."""
    import copy

    got = []
    before = [p.detach().float().clone() for p in fused.trainer.params]
    for i, batch in enumerate(batches):
        if i:
            with torch.no_grad():
                for p, q in zip(old.model.parameters(), fused.model.parameters(), strict=True):
                    p.copy_(q)
            old.trainer.load_state_dict(copy.deepcopy(fused.trainer.state_dict()))
            old.trainer.steps = fused.trainer.steps
        a = trainer_state(fused, [fused.train(batch(fused))])
        check(a, trainer_state(old, [old.train(batch(old))]), before)
        before = a["masters"]
        got.append(a)
    return got


def close_steps(a: dict, b: dict, _before=None) -> None:
    """The same step: stats, fp32 masters and AdamW state within fp32 rounding (torch's AdamW and
    the one-pass kernel round apart), bf16 weights within one unit in the last place."""
    def rel(x, y):
        return ((x.double() - y.double()).norm() / y.double().norm().clamp(min=1e-30)).item()

    for s, t in zip(a["stats"], b["stats"], strict=True):
        assert (s.skipped, s.reason, s.tokens, s.loss) == (t.skipped, t.reason, t.tokens, t.loss)
        assert s.grad_norm == pytest.approx(t.grad_norm, rel=1e-6)
    assert all(rel(x, y) < 1e-6 for x, y in zip(a["masters"], b["masters"], strict=True))
    assert all(bf16_close(x, y) for x, y in zip(a["weights"], b["weights"], strict=True))
    assert len(a["state"]) == len(b["state"]) == len(a["masters"])
    for x, y in zip(a["state"], b["state"]):
        assert x.keys() == y.keys() == {"step", "exp_avg", "exp_avg_sq"}
        assert float(x["step"]) == float(y["step"])
        assert rel(x["exp_avg"], y["exp_avg"]) < 1e-6
        assert rel(x["exp_avg_sq"], y["exp_avg_sq"]) < 1e-6
    assert a["steps"] == b["steps"]
    assert not a["grads"] and not b["grads"]


def optimizer_batches():
    """A clipped step with weight decay, a skipped one (a non-finite loss), the first again (a
    second count of the bias corrections) and an unclipped one with other betas and epsilon."""
    lc = LossConfig(lr=1e-2, max_grad_norm=0.05, weight_decay=0.1)
    lc2 = LossConfig(lr=3e-3, max_grad_norm=100.0, weight_decay=0.01, beta1=0.8, beta2=0.99,
                     adam_eps=1e-6)

    def bad(e):
        b = fixed_batch(e, lc, seed=1)
        b.samples[1].advantages = [math.inf] * len(b.samples[1].response)
        return b
    return [lambda e: fixed_batch(e, lc), bad, lambda e: fixed_batch(e, lc),
            lambda e: fixed_batch(e, lc2, seed=2)]


@pytest.mark.parametrize("break_at", [-1, 0, 5])
def test_the_fused_optimizer_step_equals_the_unfused_one(model_dirs, break_at):
    """The GPU's fused optimizer step (the norm of the bf16 gradients, the clip, AdamW and the
    bf16 copy in one Triton pass per parameter, here in Triton's interpreter; a non-finite step
    skipped on the device) against the masters' fp32 gradients, torch's AdamW and the copy back
    (bf16 parameters with fp32 masters, the GPU's layout), step by step from the same state over
    four steps: the same stats, masters, moments and step counts (a skipped step not counted).
    (From the same state: a master one fp32 ulp apart can round to another bf16 weight, and the
    next gradients differ.) A kernel that fails (at once, or after five parameters of a step)
    hands over to PyTorch: the same step still, the next ones unfused, the failure recorded."""
    from slimen_torch import kernels as K
    if not K.available("cpu"):
        pytest.skip("Triton (interpreter) not available on this machine")
    fused = Engine(str(model_dirs["tiny-qwen3"]), Options(dtype="bfloat16"))
    old = Engine(str(model_dirs["tiny-qwen3"]), Options(dtype="bfloat16"))
    launches, kernel = [0], K._adamw_kernel

    class Broken:
        def __getitem__(self, grid):
            launches[0] += 1
            if launches[0] > break_at:
                raise RuntimeError("no kernel today")
            return kernel[grid]
    try:
        if break_at >= 0:
            K._adamw_kernel = Broken()
        fused.trainer.fused_step = True
        assert not old.trainer.fused_step  # not on the CPU by default
        got = lockstep(fused, old, optimizer_batches(), close_steps)
    finally:
        K._adamw_kernel = kernel
        fused.close()
        old.close()
    s = [g["stats"][0] for g in got]
    assert s[0].grad_norm > 0.05 and s[1].skipped and not s[2].skipped and s[3].grad_norm < 100
    assert [float(x["step"]) for x in got[-1]["state"]] == [3.0] * len(got[-1]["state"])
    if break_at < 0:
        assert fused.trainer.fused_step and not fused.trainer.compile_error
        # The bf16 parameters are the masters rounded (to nearest even, as PyTorch rounds).
        assert all(torch.equal(w, m.to(torch.bfloat16))
                   for g in got for w, m in zip(g["weights"], g["masters"]))
    else:
        assert not fused.trainer.fused_step and "[adamw]" in fused.trainer.compile_error
        assert launches[0] == break_at + 1


def test_the_fused_optimizer_state_survives_save_and_load(model_dirs, tmp_path):
    """Checkpoints after fused steps hold torch's AdamW state: a new engine loaded from one
    (fused, or unfused) steps on as the saving engine does."""
    from slimen_torch import kernels as K
    if not K.available("cpu"):
        pytest.skip("Triton (interpreter) not available on this machine")
    lc = LossConfig(lr=5e-3, max_grad_norm=1.0, weight_decay=0.1)
    a = Engine(str(model_dirs["tiny-qwen3"]), Options(dtype="bfloat16"))
    try:
        a.trainer.fused_step = True
        batch = fixed_batch(a, lc)
        a.train(batch)
        a.train(batch)
        a.save(str(tmp_path / "ck"))
        runs = []
        for fused in (True, False):
            b = Engine(str(tmp_path / "ck"), Options(dtype="bfloat16"))
            try:
                b.trainer.fused_step = fused
                runs.append(trainer_state(b, [b.train(batch)]))
            finally:
                b.close()
        want = trainer_state(a, [a.train(batch)])
        assert want["steps"] == 3 and float(want["state"][0]["step"]) == 3.0
        # Fused after the load: bit for bit the saving engine's third step.
        s, t = runs[0]["stats"][0], want["stats"][0]
        assert (s.loss, s.grad_norm) == (t.loss, t.grad_norm)
        for k in ("masters", "weights"):
            assert all(torch.equal(x, y) for x, y in zip(runs[0][k], want[k], strict=True))
        close_steps(runs[1], want)
    finally:
        a.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_fused_optimizer_step_on_the_gpu(model_dirs):
    """On a GPU in bf16 the fused optimizer step (the default there) against the unfused one
    (fp32 gradients of the masters, torch's fused AdamW, the copy back), step by step from the
    same state: the same loss, the gradient norm and the masters within the GPU's rounding
    (the two backward passes' bf16 gradients may differ in the order of their sums), the moments
    and counts alike, and no read-back but the step's one."""
    from bench import step_syncs

    def rel(x, y):
        return ((x.double() - y.double()).norm() / y.double().norm().clamp(min=1e-30)).item()

    def check(a, b, before):
        s, t = a["stats"][0], b["stats"][0]
        assert (s.skipped, s.reason, s.tokens) == (t.skipped, t.reason, t.tokens)
        assert s.loss == pytest.approx(t.loss, rel=1e-5, abs=1e-6)
        assert s.grad_norm == pytest.approx(t.grad_norm, rel=1e-3)
        # Each master's update within 2% of the unfused one's (a bf16 gradient one unit in the
        # last place apart is 0.4–0.8% of it), a skipped step's exactly zero in both.
        for x, y, m in zip(a["masters"], b["masters"], before, strict=True):
            assert rel(x - m, y - m) < 2e-2
            assert not s.skipped or torch.equal(x, m)
        assert all(torch.equal(w, m.to(torch.bfloat16))
                   for w, m in zip(a["weights"], a["masters"]))
        for x, y in zip(a["state"], b["state"], strict=True):
            assert float(x["step"]) == float(y["step"])
            assert x["step"].device == y["step"].device  # on the GPU, as the fused AdamW's
            assert rel(x["exp_avg"], y["exp_avg"]) < 2e-2
            assert rel(x["exp_avg_sq"], y["exp_avg_sq"]) < 4e-2
        assert a["steps"] == b["steps"] and not a["grads"]

    opts = Options(device="cuda:0", dtype="bfloat16", compile_train="")
    fused = Engine(str(model_dirs["tiny-qwen3"]), opts)
    old = Engine(str(model_dirs["tiny-qwen3"]), opts)
    try:
        assert fused.trainer.fused_step
        old.trainer.fused_step = False
        a = lockstep(fused, old, optimizer_batches(), check)[-1]
        assert fused.trainer.fused_step and not fused.trainer.compile_error
        assert [float(x["step"]) for x in a["state"]] == [3.0] * len(a["state"])
        batch = fixed_batch(fused, LossConfig(lr=1e-3, max_grad_norm=1.0))
        assert len(step_syncs(fused.trainer, batch)) == 1
    finally:
        fused.close()
        old.close()


@pytest.mark.parametrize("device,use_triton", [("cpu", True), ("cpu", False), ("cuda", True)])
def test_adamw_equals_torch_adamw(device, use_triton):
    """kernels.adamw (the Triton pass, in the interpreter on the CPU, and its PyTorch form)
    against torch.optim.AdamW (fused on a GPU) fed the same gradients, clipped by the same
    coefficient, over five steps with weight decay, a skipped one (its count not advanced, as a
    fused AdamW's with found_inf), tensors whose size is no multiple of the block, a
    non-contiguous one (the PyTorch form) and an fp32 parameter that is its own master; the
    bf16 copies are the new masters rounded to nearest even."""
    from slimen_torch import kernels as K
    from slimen_torch.model import copy_tensors
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    if use_triton and not K.available(device):
        pytest.skip("Triton (interpreter) not available on this machine")

    def rel(x, y):
        return ((x.double() - y.double()).norm() / y.double().norm()).item()

    g = torch.Generator().manual_seed(5)
    shapes = [(3000,), (64, 48), (1,)]
    masters = [torch.randn(s, generator=g).to(device) for s in shapes]
    ref = [m.clone().requires_grad_() for m in masters]
    params = [m.bfloat16() for m in masters]
    params[2] = masters[2]  # fp32: the master is the parameter
    ntc = torch.zeros(48, 64, device=device).t()  # transposed storage: not contiguous
    ntc.copy_(masters[1])
    masters[1] = ntc
    hyper = dict(lr=1e-2, beta1=0.85, beta2=0.99, eps=1e-7, weight_decay=0.1)
    opt = torch.optim.AdamW(ref, lr=hyper["lr"], betas=(hyper["beta1"], hyper["beta2"]),
                            eps=hyper["eps"], weight_decay=hyper["weight_decay"],
                            fused=device == "cuda")
    ea = [torch.zeros_like(m) for m in masters]
    eas = [torch.zeros_like(m) for m in masters]
    steps = [torch.zeros((), device=device) for _ in masters]
    for i, (coef, skip) in enumerate([(0.5, False), (1.0, False), (0.3, True), (1.0, False),
                                      (0.2, False)]):
        grads = [torch.randn(s, generator=g).bfloat16().to(device) for s in shapes]
        if not skip:
            for r, gr in zip(ref, grads):
                r.grad = gr.float() * torch.tensor(coef, device=device)
            opt.step()
        sc = K.adamw_scalars(torch.tensor(coef, device=device),
                             torch.tensor(float(skip), device=device), steps,
                             hyper["lr"], hyper["beta1"], hyper["beta2"])
        for j in range(len(masters)):
            K.adamw(params[j], masters[j], grads[j], ea[j], eas[j], sc[j],
                    use_triton=use_triton, **hyper)
        copy_tensors(steps, [s + (0.0 if skip else 1.0) for s in steps])
        for j, r in enumerate(ref):
            st = opt.state[r]
            assert float(st["step"]) == float(steps[j])
            assert rel(masters[j], r.detach()) < 1e-6, (i, j)
            assert rel(ea[j], st["exp_avg"]) < 1e-6 and rel(eas[j], st["exp_avg_sq"]) < 1e-6
            assert torch.equal(params[j], masters[j].to(params[j].dtype))
    assert float(steps[0]) == 4.0
