"""The policy loss reproduces testdata/loss_vectors.json, the Go engine's reference (DESIGN §4):
the reduced loss and statistics and the gradients with respect to every token's log-prob and
entropy, for every case (ppo/gspo, each KL type, entropy bonus, each aggregation)."""

import json
import pathlib

import pytest
import torch

from slimen_torch import loss as L
from slimen_torch.types import LossConfig

VECTORS = pathlib.Path(__file__).resolve().parents[3] / "testdata" / "loss_vectors.json"
CASES = json.loads(VECTORS.read_text())["cases"]


def evaluate(case):
    samples = case["samples"]
    c = case["config"]
    cfg = L.resolve(LossConfig(eps_clip=c["eps_clip"], eps_clip_high=c["eps_clip_high"],
                               kl_loss_coef=c["kl_loss_coef"], kl_loss_type=c["kl_loss_type"],
                               entropy_coef=c["entropy_coef"], policy_loss=c["policy_loss"],
                               aggregation=c["aggregation"]))
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
                        n_seqs=len(samples))
    out["loss"].backward()
    lengths = [len(s["logprobs"]) for s in samples]
    return out, logp.grad.split(lengths), entropy.grad.split(lengths)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_loss_vector(case):
    out, g_logp, g_ent = evaluate(case)
    want = case["expected"]
    tol = dict(rel=1e-9, abs=1e-12)
    assert out["loss"].item() == pytest.approx(want["loss"], **tol)
    assert out["pg"].item() == pytest.approx(want["pg_loss"], **tol)
    assert out["kl"].item() == pytest.approx(want["kl"], **tol)
    assert out["entropy"].item() == pytest.approx(want["entropy"], **tol)
    assert int(out["tokens"]) == want["tokens"]
    assert out["clipped"].item() / want["tokens"] == pytest.approx(want["clip_frac"], **tol)
    for got, exp in zip(g_logp, want["grad_logprobs"]):
        assert got.tolist() == pytest.approx(exp, **tol)
    for got, exp in zip(g_ent, want["grad_entropy"]):
        assert got.tolist() == pytest.approx(exp, **tol)


def test_vectors_cover_every_option():
    # The test above is only as strong as the file: make sure it exercises every choice.
    seen = {(k, c["config"][k]) for c in CASES for k in ("kl_loss_type", "policy_loss", "aggregation")}
    for k, values in [("kl_loss_type", L.KL_TYPES), ("policy_loss", L.POLICY_LOSSES),
                      ("aggregation", L.AGGREGATIONS)]:
        for v in values:
            assert (k, v) in seen, f"loss_vectors.json has no case with {k}={v}"


def test_bad_names_are_refused():
    with pytest.raises(ValueError, match="kl_loss_type"):
        L.resolve(LossConfig(kl_loss_type="k4"))
    with pytest.raises(ValueError, match="aggregation"):
        L.resolve(LossConfig(aggregation="seq_mean"))
