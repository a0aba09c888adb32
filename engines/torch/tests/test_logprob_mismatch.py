"""The rollout/trainer log-prob mismatch every policy step reports (issue 38): the mean and the
largest |trainer − rollout| over trained tokens and slime's train_rollout_logprob_abs_diff
(reduced like the loss), on the CPU engine end to end: sampled, then trained on."""

import pytest

from slimen_torch.engine import Engine, Options
from slimen_torch.types import Batch, GenerateRequest, LossConfig, Sample, Sampling


def rollout_batch(e: Engine, lc: LossConfig) -> Batch:
    """Two prompts × three samples, sampled by the engine; advantages ±1, the first response
    token of each untrained."""
    reqs = [GenerateRequest(id=f"r{i}", prompt_tokens=[3 + i, 17, 29, 41 + i], n=3,
                            sampling=Sampling(max_tokens=10, temperature=1.0, seed=11 + i))
            for i in range(2)]
    samples = []
    for k, c in enumerate(e.generate(reqs)):
        mask = [1.0] * len(c.tokens)
        mask[0] = 0.0
        adv = 1.0 if k % 2 else -1.0
        samples.append(Sample(c.prompt_tokens, c.tokens, mask, list(c.logprobs),
                              [adv] * len(c.tokens), group=c.request_id))
    return Batch(samples=samples, loss=lc)


@pytest.fixture(scope="module")
def model_dir(model_dirs):
    return str(model_dirs["tiny-qwen3"])


def test_an_on_policy_step_reports_almost_no_mismatch(model_dir):
    e = Engine(model_dir, Options(device="cpu"))
    try:
        st = e.train(rollout_batch(e, LossConfig(lr=1e-3)))
        assert not st.skipped and st.tokens > 0
        # fp32 on the CPU: the decode path and the training forward sum in other orders, so
        # the two agree to rounding, not to the bit (deterministic mode makes them equal).
        assert 0 <= st.logprob_diff_mean <= st.logprob_diff_max < 1e-4
        assert st.logprob_abs_diff < 1e-4
    finally:
        e.close()


@pytest.mark.parametrize("use_tis", [False, True])
def test_the_mismatch_is_what_the_rollout_log_probs_are_off_by(model_dir, use_tis):
    e = Engine(model_dir, Options(device="cpu"))
    try:
        batch = rollout_batch(e, LossConfig(lr=1e-3, use_tis=use_tis))
        # Every other trained token's rollout log-prob 0.5 nats low; the untrained first token
        # 4 nats off, which must not count.
        off = tokens = 0
        sample_mean = 0.0
        for s in batch.samples:
            if use_tis:
                s.train_logprobs = list(s.old_logprobs)
            s.old_logprobs[0] -= 4.0
            n = k = 0
            for t in range(1, len(s.response)):
                n += 1
                if t % 2:
                    s.old_logprobs[t] -= 0.5
                    k += 1
            off, tokens = off + k, tokens + n
            sample_mean += 0.5 * k / max(n, 1) / len(batch.samples)
        st = e.train(batch)
        assert st.tokens == tokens
        assert st.logprob_diff_max == pytest.approx(0.5, abs=1e-4)
        assert st.logprob_diff_mean == pytest.approx(0.5 * off / tokens, abs=1e-4)
        # slime's reduction: the loss's (sample_mean: the mean over samples of their means).
        assert st.logprob_abs_diff == pytest.approx(sample_mean, abs=1e-4)
    finally:
        e.close()


def test_a_critic_step_reports_no_mismatch(model_dir):
    e = Engine(model_dir, Options(device="cpu"))
    try:
        b = rollout_batch(e, LossConfig(lr=1e-3))
        for s in b.samples:
            s.returns = [1.0] * len(s.response)
        st = e.train(b)
        assert st.logprob_diff_mean == st.logprob_diff_max == st.logprob_abs_diff == 0.0
    finally:
        e.close()


def test_the_mismatch_crosses_the_protocol(model_dir, tmp_path):
    # The worker's Train answer carries the three numbers the host writes into metrics.jsonl.
    import grpc

    from slimen_torch.proto import engine_pb2 as pb
    from slimen_torch.proto import engine_pb2_grpc as pb_grpc
    from slimen_torch.server import make_server

    engine = Engine(model_dir, Options(device="cpu"))
    server, service, port = make_server("127.0.0.1:0", roots=[str(tmp_path)])
    service.engine, service.loading = engine, False
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        b = rollout_batch(engine, LossConfig(lr=1e-3))
        samples = [pb.Sample(prompt=s.prompt, response=s.response, loss_mask=s.loss_mask,
                             old_logprobs=[x - 0.25 for x in s.old_logprobs],
                             advantages=s.advantages, group=s.group) for s in b.samples]
        got = pb_grpc.EngineStub(channel).Train(pb.TrainRequest(batch=pb.Batch(
            id="m1", samples=samples, loss=pb.LossConfig(lr=1e-3)))).stats
        assert got.tokens > 0
        assert got.logprob_diff_max == pytest.approx(0.25, abs=1e-4)
        assert got.logprob_diff_mean == pytest.approx(0.25, abs=1e-4)
        assert got.logprob_abs_diff == pytest.approx(0.25, abs=1e-4)
    finally:
        channel.close()
        server.stop(0).wait()
        engine.close()
