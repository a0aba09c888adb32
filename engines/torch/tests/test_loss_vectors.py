"""The policy loss reproduces testdata/slime/loss_vectors.json, computed by THUDM/slime's own loss
code (testdata/slime/make_vectors.py) and shared with the Go engine: the reduced loss and
statistics and the gradients with respect to every token's log-prob and entropy, for every case
(ppo/gspo, each KL type, entropy bonus, each aggregation, samples without trained tokens). slime
computes KL terms in float32, hence the tolerances. testdata/slime/tis_vectors.json does the same
for the off-policy correction (TIS and IcePop, slime's vanilla_tis_function and icepop_function),
adding the share of clipped or masked tokens and the mean weight."""

import json
import pathlib

import pytest
import torch

from slimen_torch import loss as L
from slimen_torch.types import LossConfig

VECTORS = pathlib.Path(__file__).resolve().parents[3] / "testdata" / "slime" / "loss_vectors.json"
CASES = json.loads(VECTORS.read_text())["cases"]
TIS_CASES = json.loads((VECTORS.parent / "tis_vectors.json").read_text())["cases"]


def evaluate(case):
    samples = case["samples"]
    c = case["config"]
    cfg = L.resolve(LossConfig(eps_clip=c["eps_clip"], eps_clip_high=c["eps_clip_high"],
                               kl_loss_coef=c["kl_loss_coef"], kl_loss_type=c["kl_loss_type"],
                               entropy_coef=c["entropy_coef"], policy_loss=c["policy_loss"],
                               aggregation=c["aggregation"], use_tis=c.get("use_tis", False),
                               tis_mode=c.get("tis_mode", ""), tis_clip=c.get("tis_clip", 0.0),
                               tis_clip_low=c.get("tis_clip_low", 0.0)))
    weights = L.token_weights([s["group"] for s in samples], [s["loss_mask"] for s in samples],
                              cfg.aggregation)

    def flat(key):
        return torch.tensor([x for s in samples for x in s[key]], dtype=torch.float64)

    logp = flat("logprobs").requires_grad_()
    entropy = flat("entropy").requires_grad_()
    seq = torch.tensor([i for i, s in enumerate(samples) for _ in s["logprobs"]])
    out = L.policy_loss(cfg, logp, flat("old_logprobs"), flat("advantages"), flat("loss_mask"),
                        torch.tensor([w for ws in weights for w in ws], dtype=torch.float64),
                        entropy=entropy, ref_logp=flat("ref_logprobs"), seq=seq,
                        n_seqs=len(samples),
                        rollout_logp=flat("rollout_logprobs") if cfg.use_tis else None)
    out["loss"].backward()
    lengths = [len(s["logprobs"]) for s in samples]
    return out, logp.grad.split(lengths), entropy.grad.split(lengths)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_loss_vector(case):
    out, g_logp, g_ent = evaluate(case)
    want = case["expected"]
    tol = dict(rel=1e-6, abs=1e-7)
    assert out["loss"].item() == pytest.approx(want["loss"], **tol)
    assert out["pg"].item() == pytest.approx(want["pg_loss"], **tol)
    assert out["kl"].item() == pytest.approx(want["kl"], **tol)
    assert out["entropy"].item() == pytest.approx(want["entropy"], **tol)
    assert int(out["tokens"]) == want["tokens"]
    tokens = max(want["tokens"], 1)
    assert out["clipped"].item() / tokens == pytest.approx(want["clip_frac"], **tol)
    for got, exp in zip(g_logp, want["grad_logprobs"]):
        assert got.tolist() == pytest.approx(exp, **tol)
    for got, exp in zip(g_ent, want["grad_entropy"]):
        assert got.tolist() == pytest.approx(exp, **tol)


@pytest.mark.parametrize("case", TIS_CASES, ids=lambda c: c["name"])
def test_tis_vector(case):
    test_loss_vector(case)
    out = evaluate(case)[0]
    want = case["expected"]
    tokens = max(want["tokens"], 1)
    tol = dict(rel=1e-6, abs=1e-7)
    assert out["tis_clipped"].item() / tokens == pytest.approx(want["tis_clip_frac"], **tol)
    assert out["tis_weight"].item() / tokens == pytest.approx(want["tis_weight"], **tol)


def test_tis_vectors_cover_both_modes():
    seen = {(c["config"]["tis_mode"], c["config"]["policy_loss"]) for c in TIS_CASES
            if c["expected"]["tis_clip_frac"] > 0}
    assert seen == {(m, p) for m in L.TIS_MODES for p in L.POLICY_LOSSES}


def test_tis_band_is_checked():
    with pytest.raises(ValueError, match="tis_mode"):
        L.resolve(LossConfig(use_tis=True, tis_mode="rs"))
    with pytest.raises(ValueError, match="tis_clip_low"):
        L.resolve(LossConfig(use_tis=True, tis_clip=1.5, tis_clip_low=2.0))
    assert L.resolve(LossConfig(use_tis=True)).tis_high == 2.0  # slime's default


def test_vectors_cover_every_option():
    # The test above is only as strong as the file: make sure it exercises every choice.
    seen = {(k, c["config"][k]) for c in CASES for k in ("kl_loss_type", "policy_loss", "aggregation")}
    for k, values in [("kl_loss_type", L.KL_TYPES), ("policy_loss", L.POLICY_LOSSES),
                      ("aggregation", L.AGGREGATIONS)]:
        for v in values:
            assert (k, v) in seen, f"loss_vectors.json has no case with {k}={v}"
    empty = {c["config"]["aggregation"] for c in CASES
             if any(not any(s["loss_mask"]) for s in c["samples"])}
    assert {"sample_mean", "token_mean"} <= empty, "no case has a sample without trained tokens"


def test_eps_clip_high_zero_clips_at_one():
    # slime: an explicit eps_clip_high of 0 is an upper bound of exactly 1, not "same as eps_clip".
    cfg = L.resolve(LossConfig(eps_clip=0.2, eps_clip_high=0.0))
    assert (cfg.eps_lo, cfg.eps_hi) == (0.2, 0.0)
    logp = torch.tensor([0.1], dtype=torch.float64, requires_grad=True)
    out = L.policy_loss(cfg, logp, torch.zeros(1, dtype=torch.float64),
                        torch.ones(1, dtype=torch.float64), torch.ones(1, dtype=torch.float64),
                        torch.ones(1, dtype=torch.float64))
    assert out["pg"].item() == pytest.approx(-1.0)
    assert int(out["clipped"]) == 1


def test_bad_names_are_refused():
    with pytest.raises(ValueError, match="kl_loss_type"):
        L.resolve(LossConfig(kl_loss_type="k4"))
    with pytest.raises(ValueError, match="aggregation"):
        L.resolve(LossConfig(aggregation="seq_mean"))


@pytest.mark.parametrize("aggregation", L.AGGREGATIONS)
def test_weights_of_some_samples_are_theirs_among_all(aggregation):
    """A sharded trainer's rank asks for its own samples' weights (only=): the arrays of those
    samples among all, bit for bit, their reductions still counting every sample (an empty group
    name, a sample without trained tokens, a group of mass 0)."""
    import numpy as np

    groups = ["a", "", "b", "a", "", "b", "c"]
    masks = [[1.0, 0.0, 1.0], [1.0] * 5, [0.0, 0.0], [0.5, 1.0], [], [1.0], [0.0]]
    every = L.token_weights(groups, masks, aggregation)
    assert len(every) == len(masks)
    # The definition in the docstring, sample by sample.
    mass = {g: sum(sum(m) for h, m in zip(groups, masks) if h == g) for g in groups if g}
    n_groups = sum(1 for v in mass.values() if v > 0) + sum(
        1 for g, m in zip(groups, masks) if not g and sum(m) > 0)
    tokens = sum(max(sum(m), 1.0) for m in masks)
    for g, m, w in zip(groups, masks, every):
        d = {"token_sum": 1.0, "token_mean": tokens, "sample_mean": len(masks) * max(sum(m), 1.0),
             "group_token_mean": n_groups * (mass[g] if g else sum(m))}[aggregation]
        assert w.dtype == np.float64
        assert w.tolist() == [x / d if x else 0.0 for x in m]
    for only in ([], [6, 0, 3], [4], list(range(len(masks)))):
        some = L.token_weights(groups, masks, aggregation, only=only)
        assert len(some) == len(only)
        for i, w in zip(only, some):
            assert np.array_equal(w, every[i]) and w.dtype == np.float64, (only, i)
