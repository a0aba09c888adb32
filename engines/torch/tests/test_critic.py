"""A PPO critic: the value head (created on first use, saved as score.*), Values, and the clipped
value loss Σ w·max((V − R)², (clip(V, V_old ± c) − R)²)."""

import pytest
import torch
from safetensors import safe_open

from slimen_torch import loss as L
from slimen_torch.engine import Engine
from slimen_torch.types import Batch, LossConfig, Sample, ScoreRequest


def critic_batch(e, returns_value, old_values=None, clip=0.0, lr=1e-2):
    g = torch.Generator().manual_seed(3)
    V = e.cfg.vocab_size
    samples = []
    for i in range(3):
        prompt = torch.randint(0, V, (4 + i,), generator=g).tolist()
        response = torch.randint(0, V, (5 + i,), generator=g).tolist()
        n = len(response)
        mask = [1.0] * n
        mask[-1] = 0.0
        samples.append(Sample(prompt, response, mask, [0.0] * n, [0.0] * n, group=f"g{i % 2}",
                              returns=[returns_value + 0.1 * t for t in range(n)],
                              old_values=old_values[i] if old_values else []))
    return Batch(samples=samples, loss=LossConfig(lr=lr, value_clip=clip))


def values_of(e, batch):
    return e.values([ScoreRequest(prompt_tokens=s.prompt, tokens=s.response) for s in batch.samples])


def expected_loss(batch, values, clip):
    w = L.token_weights([s.group for s in batch.samples], [s.loss_mask for s in batch.samples],
                        "sample_mean")  # the default reduction
    total = 0.0
    for s, v, ws in zip(batch.samples, values, w):
        for t, r in enumerate(s.returns):
            l1 = (v[t] - r) ** 2
            if clip > 0:
                o = s.old_values[t]
                l1 = max(l1, (o + min(max(v[t] - o, -clip), clip) - r) ** 2)
            total += ws[t] * l1
    return total


def test_critic_learns_the_returns(model_dirs, tmp_path):
    e = Engine(str(model_dirs["tiny-qwen3"]))
    try:
        batch = critic_batch(e, 2.0)
        v0 = values_of(e, batch)
        assert all(x == 0.0 for v in v0 for x in v)  # a fresh head values everything at 0
        first = e.train(batch)
        assert first.value_loss == pytest.approx(expected_loss(batch, v0, 0.0), rel=1e-5)
        assert first.tokens == sum(len(s.response) - 1 for s in batch.samples)
        for _ in range(5):
            last = e.train(batch)
        assert last.value_loss < 0.5 * first.value_loss
        v1 = values_of(e, batch)
        # (Each step reports the loss before its update; after the last one it is lower still.)
        assert expected_loss(batch, v1, 0.0) < last.value_loss
        # The head is saved under transformers' token-classification names and loaded back.
        e.save(str(tmp_path / "critic"))
        with safe_open(str(tmp_path / "critic" / "model.safetensors"), "pt") as f:
            assert f.get_tensor("score.weight").shape == (1, e.cfg.hidden)
        back = Engine(str(tmp_path / "critic"))
        try:
            for got, want in zip(values_of(back, batch), v1):
                assert got == pytest.approx(want, abs=1e-6)
        finally:
            back.close()
    finally:
        e.close()


def test_value_clipping(model_dirs):
    e = Engine(str(model_dirs["tiny"]))
    try:
        e.train(critic_batch(e, 3.0, lr=5e-2))  # move the values away from 0
        batch = critic_batch(e, 3.0, clip=0.05)
        v = values_of(e, batch)
        # Old values 0.2 below the current ones: the clipped term is larger wherever V moved
        # more than 0.05 towards the return.
        batch = critic_batch(e, 3.0, old_values=[[x - 0.2 for x in vi] for vi in v], clip=0.05)
        st = e.train(batch)
        assert st.value_loss == pytest.approx(expected_loss(batch, v, 0.05), rel=1e-5)
        assert st.clip_frac > 0
    finally:
        e.close()


def test_critic_batch_needs_returns_everywhere(model_dirs):
    e = Engine(str(model_dirs["tiny"]))
    try:
        batch = critic_batch(e, 1.0)
        batch.samples[1].returns = []
        from slimen_torch.types import RequestError
        with pytest.raises(RequestError, match="returns"):
            e.train(batch)
        with pytest.raises(RequestError, match="old_values"):
            e.train(critic_batch(e, 1.0, clip=0.2))
    finally:
        e.close()


def test_critic_batch_as_the_host_sends_it(model_dirs):
    # The host's critic samples carry returns, old values and the loss mask, but no old
    # log-probs or advantages (host/run.go): the critic must train on them.
    e = Engine(str(model_dirs["tiny"]))
    try:
        batch = critic_batch(e, 1.0)
        for s in batch.samples:
            s.old_logprobs, s.advantages = [], []
        st = e.train(batch)
        assert st.value_loss > 0 and not st.skipped
    finally:
        e.close()


def test_head_created_after_the_optimizer_survives_save_and_load(model_dirs, tmp_path):
    """An engine that trained as an actor before its value head existed keeps the head's optimizer
    state in a parameter group of its own; its save loads back (a new engine and in place)."""
    e = Engine(str(model_dirs["tiny-qwen3"]))
    try:
        actor = critic_batch(e, 0.0)
        for s in actor.samples:
            s.returns, s.advantages = [], [1.0] * len(s.response)
        e.train(actor)  # the optimizer exists now, without the head
        batch = critic_batch(e, 2.0)
        values_of(e, batch)  # creates the head: a second parameter group
        e.train(batch)
        e.save(str(tmp_path / "c"))
        want = values_of(e, batch)
        again = e.train(batch)
        for engine in (Engine(str(tmp_path / "c")), e):
            if engine is e:
                e.load(str(tmp_path / "c"))
            try:
                for got, w in zip(values_of(engine, batch), want):
                    assert got == pytest.approx(w, abs=1e-6)
                # The optimizer state came back too: the same next step as before the save.
                assert engine.train(batch).value_loss == pytest.approx(again.value_loss, rel=1e-5)
            finally:
                if engine is not e:
                    engine.close()
    finally:
        e.close()


def test_a_critics_checkpoint_loaded_into_an_actor_trains_its_head(model_dirs, tmp_path):
    """A load starts the engine's own trainer over (Trainer.reset), not a new one: a critic's
    checkpoint loaded into an engine that has no value head gives it the head, whose weights and
    optimizer state train on as in an engine started from the checkpoint."""
    model = str(model_dirs["tiny-qwen3"])
    critic, actor = Engine(model), Engine(model)
    try:
        batch = critic_batch(critic, 2.0)
        critic.train(batch)
        critic.save(str(tmp_path / "c"))
        trainer = actor.trainer
        assert actor.model.score is None
        actor.load(str(tmp_path / "c"))
        assert actor.trainer is trainer and trainer.steps == 1
        assert any(p is actor.model.score for p in trainer.params)
        back = Engine(str(tmp_path / "c"))
        try:
            want, head = back.train(batch), back.model.score.detach().clone()
        finally:
            back.close()
        got = actor.train(batch)
        assert got.value_loss == pytest.approx(want.value_loss, rel=1e-6)
        assert not torch.equal(actor.model.score, critic.model.score)  # the head trained
        torch.testing.assert_close(actor.model.score.detach(), head, rtol=1e-6, atol=1e-7)
    finally:
        critic.close()
        actor.close()
