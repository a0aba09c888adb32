"""The policy loss of docs/architecture.md, on per-token tensors.

These are the definitions of the Go engine (engines/tiny/loss.go) and of slime's
ppo_utils/loss.py, pinned by testdata/slime/loss_vectors.json (computed by running slime's own
functions, testdata/slime/make_vectors.py), which tests/test_loss_vectors.py reproduces:

* ratio r = exp(logp − logp_old) per token (ppo), or for gspo one ratio per sample,
  exp(mask-weighted mean over the sample of logp − logp_old), shared by its tokens;
* pg = max(−r·A, −clip(r, 1 − eps_clip, 1 + eps_clip_high)·A); where the clipped term is strictly
  larger the token counts as clipped and passes no gradient;
* KL with Δ = logp − logp_ref: k1 = Δ, k2 = Δ²/2, k3 = e^−Δ − 1 + Δ, low_var_kl = k3 clamped to
  [−10, 10];
* off-policy correction (use_tis, slime's --use-tis, pinned by testdata/slime/tis_vectors.json):
  pg is multiplied by a constant weight of ρ = exp(logp_old − logp_rollout), where logp_old are
  the trainer's old log-probs: clamp(ρ, tis_clip_low, tis_clip) (tis_mode "tis", slime's
  vanilla_tis_function) or ρ inside that band and 0 outside (tis_mode "icepop", slime's
  icepop_function);
* loss = Σ w·(pg + kl_loss_coef·KL − entropy_coef·H) with per-token weights w that do the
  reduction (sample_mean, token_mean, group_token_mean or token_sum; see token_weights).
  Because the reduction is a weighted sum, a batch can be split into micro-batches and their
  gradients added.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import torch

from .types import LossConfig

KL_TYPES = ("k1", "k2", "k3", "low_var_kl")
POLICY_LOSSES = ("ppo", "gspo")
AGGREGATIONS = ("sample_mean", "token_mean", "group_token_mean", "token_sum")
TIS_MODES = ("tis", "icepop")


@dataclasses.dataclass(frozen=True)
class Loss:
    """A LossConfig with its defaults resolved and its names checked."""

    eps_lo: float
    eps_hi: float
    kl_coef: float
    ent_coef: float
    kl_type: str
    policy: str
    aggregation: str
    use_tis: bool = False
    tis_mode: str = "tis"
    tis_low: float = 0.0
    tis_high: float = 2.0


def resolve(c: LossConfig) -> Loss:
    r = Loss(eps_lo=c.eps_clip, eps_hi=c.eps_clip_high, kl_coef=c.kl_loss_coef,
             ent_coef=c.entropy_coef, kl_type=c.kl_loss_type or "low_var_kl",
             policy=c.policy_loss or "ppo", aggregation=c.aggregation or "sample_mean",
             use_tis=c.use_tis, tis_mode=c.tis_mode or "tis", tis_low=c.tis_clip_low,
             tis_high=c.tis_clip or 2.0)
    if r.kl_type not in KL_TYPES:
        raise ValueError(f"kl_loss_type {r.kl_type!r} is not one of {', '.join(KL_TYPES)}")
    if r.policy not in POLICY_LOSSES:
        raise ValueError(f"policy_loss {r.policy!r} is not one of {', '.join(POLICY_LOSSES)}")
    if r.aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation {r.aggregation!r} is not one of {', '.join(AGGREGATIONS)}")
    if min(r.eps_lo, r.eps_hi, r.kl_coef, r.ent_coef) < 0:
        raise ValueError("eps_clip, eps_clip_high, kl_loss_coef and entropy_coef must not be "
                         "negative")
    if r.use_tis and r.tis_mode not in TIS_MODES:
        raise ValueError(f"tis_mode {r.tis_mode!r} is not one of {', '.join(TIS_MODES)}")
    if r.use_tis and not 0 <= r.tis_low <= r.tis_high:
        raise ValueError(f"tis_clip_low {r.tis_low:g} and tis_clip {r.tis_high:g} are not a band: "
                         "need 0 ≤ tis_clip_low ≤ tis_clip")
    return r


def token_weights(groups: list[str], masks: list[list[float]], aggregation: str,
                  only: list[int] | None = None) -> list[np.ndarray]:
    """Each token's weight w in the reduced loss Σ w·ℓ over the N samples of one optimizer step,
    one float64 array per sample; only: the indices of the samples whose weights are wanted (the
    reductions still count every sample), in that order; None: all.

    With m a sample's mask sum: sample_mean (slime's default): mean over samples of each sample's
    token-mean, w = mask/(N·max(m, 1)); token_mean (slime's calculate_per_token_loss):
    w = mask/Σ max(m, 1); group_token_mean: mean over groups of each group's token-mean,
    w = mask/(G·group mask sum), G counting groups with a trained token; token_sum: w = mask.
    In the slime reductions a sample without trained tokens still counts (as a sample, or as one
    token). An empty group name is a group of its own. The sums run in order, as Python's; each
    weight is one division of its mask value (0 where the mask is 0).
    """
    idx = range(len(masks)) if only is None else only
    lens = [len(masks[i]) for i in idx]
    # The wanted masks in one array, divided at once: the weights of a rank's share of a large
    # batch (dist.py) cost a few numpy calls, not a few per sample.
    x = np.fromiter(itertools.chain.from_iterable(masks[i] for i in idx), np.float64, sum(lens))
    if aggregation == "token_sum":
        return np.split(x, np.cumsum(lens)[:-1]) if lens else []
    keys = [g if g else ("", i) for i, g in enumerate(groups)]
    sample_mass = [float(sum(m)) for m in masks]
    if aggregation == "token_mean":
        tokens = sum(max(m, 1.0) for m in sample_mass)
        d = [tokens] * len(lens)
    elif aggregation == "group_token_mean":
        mass: dict = {}
        for k, m in zip(keys, sample_mass):
            mass[k] = mass.get(k, 0.0) + m
        n_groups = sum(1 for v in mass.values() if v > 0)
        d = [n_groups * mass[keys[i]] for i in idx]
    else:
        d = [len(masks) * max(sample_mass[i], 1.0) for i in idx]
    with np.errstate(divide="ignore", invalid="ignore"):  # a group of mass 0: all masks 0
        w = np.where(x != 0, x / np.repeat(np.asarray(d, np.float64), lens), 0.0)
    return np.split(w, np.cumsum(lens)[:-1]) if lens else []


def kl_term(delta: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "k1":
        return delta
    if kind == "k2":
        return delta * delta / 2
    k3 = torch.exp(-delta) - 1 + delta
    return k3.clamp(-10, 10) if kind == "low_var_kl" else k3


def tis_weight(cfg: Loss, old_logp, rollout_logp):
    """The off-policy weight of each token and whether it differs from the ratio ρ =
    exp(old_logp − rollout_logp): clamp(ρ, low, high) (tis) or ρ inside [low, high], else 0
    (icepop). Both inputs are constants of the loss."""
    rho = torch.exp(old_logp - rollout_logp)
    inside = (rho >= cfg.tis_low) & (rho <= cfg.tis_high)
    if cfg.tis_mode == "icepop":
        w = torch.where(inside, rho, torch.zeros_like(rho))
    else:
        w = rho.clamp(cfg.tis_low, cfg.tis_high)
    return w, ~inside


def policy_loss(cfg: Loss, logp, old_logp, adv, mask, weight, entropy=None, ref_logp=None,
                seq=None, n_seqs: int = 0, rollout_logp=None) -> dict[str, torch.Tensor]:
    """Weighted sums over the given tokens (1-D tensors of one length).

    seq (gspo only): the sample index of each token, in [0, n_seqs). entropy may be None when
    entropy_coef is 0 (the statistic is then reported by the caller). With cfg.use_tis, old_logp
    are the trainer's old log-probs and rollout_logp the rollout's. Returns loss, pg, kl and
    entropy as weighted sums, and clipped and tokens as counts (with TIS also tis_clipped, a
    count, and tis_weight, the sum of the weights over trained tokens).
    """
    trained = mask != 0
    log_ratio = logp - old_logp
    if cfg.policy == "gspo":
        m = torch.where(trained, mask, torch.zeros_like(mask))
        num = torch.zeros(n_seqs, dtype=logp.dtype, device=logp.device).index_add(
            0, seq, torch.where(trained, m * log_ratio, torch.zeros_like(log_ratio)))
        den = torch.zeros(n_seqs, dtype=logp.dtype, device=logp.device).index_add(0, seq, m)
        log_ratio = (num / den.clamp_min(torch.finfo(den.dtype).tiny))[seq]
    ratio = torch.exp(log_ratio)
    l1 = -ratio * adv
    l2 = -ratio.clamp(1 - cfg.eps_lo, 1 + cfg.eps_hi) * adv
    clipped = (l2 > l1) & trained
    pg = torch.where(clipped, l2, l1)
    zero = torch.zeros_like(pg)
    tis = {}
    if cfg.use_tis:
        w_tis, changed = tis_weight(cfg, old_logp.detach(), rollout_logp)
        pg = pg * w_tis
        tis = {"tis_clipped": (changed & trained).sum(),
               "tis_weight": torch.where(trained, w_tis, torch.zeros_like(w_tis)).sum()}
    # where (not multiplication) keeps a non-finite value on an untrained token from leaking.
    pg_sum = torch.where(trained, weight * pg, zero).sum()
    loss = pg_sum
    out = {"pg": pg_sum, "clipped": clipped.sum(), "tokens": trained.sum(), **tis}
    if cfg.kl_coef > 0:
        kl_sum = torch.where(trained, weight * kl_term(logp - ref_logp, cfg.kl_type), zero).sum()
        loss = loss + cfg.kl_coef * kl_sum
        out["kl"] = kl_sum
    else:
        out["kl"] = pg_sum.new_zeros(())
    if entropy is not None:
        ent_sum = torch.where(trained, weight * entropy, zero).sum()
        loss = loss - cfg.ent_coef * ent_sum
        out["entropy"] = ent_sum
    out["loss"] = loss
    return out


def logprob_mismatch(trainer_logp, rollout_logp, mask, weight) -> dict[str, torch.Tensor]:
    """The rollout/trainer log-prob mismatch d = |trainer − rollout| of the given tokens (1-D
    tensors of one length; the trainer's detached): over trained tokens (mask ≠ 0) the sum of d
    (lp_diff), its sum with the loss's token weights (lp_diff_w: slime's
    train_rollout_logprob_abs_diff, reduced as the loss is) and its largest (lp_diff_max; 0
    without trained tokens). A non-finite d propagates into all three."""
    trained = mask != 0
    d = (trainer_logp.float() - rollout_logp.float()).abs()
    zero = torch.zeros_like(d)
    kept = torch.where(trained, d, zero)
    return {"lp_diff": kept.sum(), "lp_diff_w": torch.where(trained, weight * d, zero).sum(),
            "lp_diff_max": kept.max() if kept.numel() else zero.sum()}
