"""Writes loss_vectors.json, tis_vectors.json and advantage_vectors.json next to this file by running
THUDM/slime's own functions on generated inputs: slime is the oracle, the vectors are its answers.

    git -C <slime clone> archive HEAD slime | tar -x -C /tmp/slime
    $(scripts/pyenv.sh)/bin/python testdata/slime/make_vectors.py --slime /tmp/slime \
        --commit $(git -C <slime clone> rev-parse HEAD)

What runs is slime's code, unchanged, on one CPU process:

* the policy loss: slime.backends.megatron_utils.loss.loss_function (which builds the reduction
  with cp_utils.get_sum_of_sample_mean and calls policy_loss_function, compute_policy_loss,
  compute_gspo_kl and compute_approx_kl). The current log-probs and entropies are handed to it as
  leaf tensors (its get_log_probs_and_entropy is replaced, as there are no logits), and its result
  is divided by the normalizer it returns, which Megatron divides by. Gradients are torch's.
  Two reductions are slimen's own (group_token_mean, token_sum): for those cases the reducer that
  get_sum_of_sample_mean would return is replaced by slimen's token weights (group_weights
  below); every per-token number is still slime's.
* off-policy correction (tis_vectors.json): the same loss_function with --use-tis, the batch's
  log_probs being the trainer's old log-probs and rollout_log_probs the rollout's, through
  slime's vanilla_tis_function (tis) or, as --custom-tis-function-path names it, icepop_function
  (icepop). The per-token tis_clipfrac and weight are read off slime's function (called a second
  time with a pg_loss of ones for the weight); they are reported as shares and means over
  trained tokens, as slimen reports clip_frac.
* advantages: ray/rollout.py's RolloutManager._post_process_rewards (the group normalisation,
  taken out of the class with ast as its module needs ray and sglang) and then
  loss.compute_advantages_and_returns (grpo/gspo returns, REINFORCE++ returns with
  discounting, REINFORCE++-baseline, GAE for ppo, the reward-side KL and the masked whitening of
  distributed_masked_whiten on a one-process gloo group).

Megatron is replaced by a stand-in for one rank (no context, data or pipeline parallelism) and
torch.compile by the identity, so slime's functions run eagerly. Note slime computes KL terms in
float32 (compute_approx_kl calls .float()) and whitening statistics in float32; the readers'
tolerances allow for that.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import pathlib
import random
import sys
import tempfile
import types
from argparse import Namespace


def load_slime(root: str):
    sys.path.insert(0, root)
    import torch

    torch.compile = lambda *a, **k: (a[0] if a and callable(a[0]) else (lambda f: f))
    mpu = types.ModuleType("megatron.core.mpu")
    mpu.get_context_parallel_world_size = lambda: 1
    mpu.get_context_parallel_rank = lambda: 0
    mpu.get_data_parallel_world_size = lambda with_context_parallel=False: 1
    mpu.is_pipeline_last_stage = lambda: True
    mpu.get_data_parallel_group = lambda with_context_parallel=False: None
    mpu.get_context_parallel_group = lambda: None
    core = types.ModuleType("megatron.core")
    core.mpu = mpu
    meg = types.ModuleType("megatron")
    meg.core = core
    sys.modules.update({"megatron": meg, "megatron.core": core, "megatron.core.mpu": mpu})
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0,
                                world_size=1)
    import slime.backends.megatron_utils.loss as loss_mod

    src = pathlib.Path(root, "slime", "ray", "rollout.py").read_text()
    fn = next(n for n in ast.walk(ast.parse(src))
              if isinstance(n, ast.FunctionDef) and n.name == "_post_process_rewards")
    ns = {"torch": torch}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "slime/ray/rollout.py", "exec"), ns)
    return torch, loss_mod, ns["_post_process_rewards"]


def r6(x: float) -> float:
    return round(x, 6)


# ---------------------------------------------------------------------------- loss


def group_weights(groups, masks, aggregation):
    """slimen's own reductions (not slime's): group_token_mean, w = mask/(G·group mask sum) with G
    the groups that have a trained token ("" is a group of its own); token_sum, w = mask."""
    keys = [g if g else ("", i) for i, g in enumerate(groups)]
    mass = {}
    for k, m in zip(keys, masks):
        mass[k] = mass.get(k, 0.0) + sum(m)
    g = sum(1 for v in mass.values() if v > 0)
    if aggregation == "token_sum":
        return [[float(x) for x in m] for m in masks]
    return [[x / (g * mass[k]) if x else 0.0 for x in m] for k, m in zip(keys, masks)]


def loss_inputs(rng: random.Random, cfg: dict, n_samples: int, empty: int, interior: bool):
    samples = []
    groups = ["g0", "g0", "g0", "g1", "g2", "g2", "", "", "g3", "g3", "", "g1"][:n_samples]
    for k, g in enumerate(groups):
        n = rng.randint(1, 7)
        adv = rng.gauss(0, 1)
        s = {"group": g, "logprobs": [], "old_logprobs": [], "ref_logprobs": [], "entropy": [],
             "advantages": [], "loss_mask": []}
        for t in range(n):
            lp = -3 * rng.random()
            ref = lp + 0.3 * rng.gauss(0, 1)
            if cfg["kl_loss_type"] == "low_var_kl" and rng.random() < 0.25:
                ref = lp + 3 + rng.random()  # exp(-d) - 1 + d > 10: the clamp
            mask = 1.0
            if interior and 0 < t < n - 1 and rng.random() < 0.3:
                mask = 0.0
            elif rng.random() < 0.1:
                mask = 0.0
            s["logprobs"].append(r6(lp))
            s["old_logprobs"].append(r6(lp + 0.8 * (rng.random() - 0.5)))
            s["ref_logprobs"].append(r6(ref))
            s["entropy"].append(r6(0.1 + 2 * rng.random()))
            s["advantages"].append(r6(adv if rng.random() < 0.7 else adv + 0.5 * rng.gauss(0, 1)))
            s["loss_mask"].append(mask)
        if k < empty:
            s["loss_mask"] = [0.0] * n
        samples.append(s)
    rng.shuffle(samples)
    return samples


def slime_loss(torch, L, cfg: dict, samples: list[dict]) -> dict:
    """slime's loss on the samples; with cfg["use_tis"] also its TIS/IcePop correction."""
    f64 = torch.float64
    n = len(samples)
    logp = [torch.tensor(s["logprobs"], dtype=f64, requires_grad=True) for s in samples]
    ent = [torch.tensor(s["entropy"], dtype=f64, requires_grad=True) for s in samples]
    masks = [torch.tensor(s["loss_mask"], dtype=f64) for s in samples]
    batch = {
        "advantages": [torch.tensor(s["advantages"], dtype=f64) for s in samples],
        "log_probs": [torch.tensor(s["old_logprobs"], dtype=f64) for s in samples],
        "ref_log_probs": [torch.tensor(s["ref_logprobs"], dtype=f64) for s in samples],
        "loss_masks": masks,
        "response_lengths": [len(s["logprobs"]) for s in samples],
        "total_lengths": [len(s["logprobs"]) + 3 for s in samples],
        "unconcat_tokens": [None] * n,
        # every sample its own rollout (slime's default): the per-sample mask sums
        "rollout_mask_sums": torch.tensor([sum(s["loss_mask"]) for s in samples], dtype=f64),
    }
    use_tis = cfg.get("use_tis", False)
    if use_tis:
        batch["rollout_log_probs"] = [torch.tensor(s["rollout_logprobs"], dtype=f64)
                                      for s in samples]
    agg = cfg["aggregation"]
    args = Namespace(
        loss_type="policy_loss", calculate_per_token_loss=(agg != "sample_mean"),
        recompute_loss_function=False, allgather_cp=False, rollout_top_p=1.0,
        advantage_estimator="gspo" if cfg["policy_loss"] == "gspo" else "grpo",
        use_rollout_logprobs=False, use_opsm=False, eps_clip=cfg["eps_clip"],
        eps_clip_high=cfg["eps_clip_high"], eps_clip_c=None, get_mismatch_metrics=False,
        use_tis=use_tis, tis_clip=cfg.get("tis_clip", 2.0), tis_clip_low=cfg.get("tis_clip_low", 0.0),
        custom_tis_function_path=("slime.backends.megatron_utils.loss.icepop_function"
                                  if cfg.get("tis_mode") == "icepop" else None),
        entropy_coef=cfg["entropy_coef"], use_kl_loss=cfg["kl_loss_coef"] > 0,
        kl_loss_coef=cfg["kl_loss_coef"], kl_loss_type=cfg["kl_loss_type"],
        use_unbiased_kl=False)
    captured = {}
    saved = L.get_log_probs_and_entropy, L.compute_policy_loss, L.get_sum_of_sample_mean
    saved_tis = L.vanilla_tis_function, L.icepop_function

    def tis_spy(fn):
        def run(args, **kw):
            pg, masks, metrics = fn(args, **kw)
            weight, _, _ = fn(args, **{**kw, "pg_loss": torch.ones_like(kw["pg_loss"])})
            captured["tis_clipfrac"], captured["tis_weight"] = metrics["tis_clipfrac"], weight
            return pg, masks, metrics
        return run

    def policy_loss(*a, **k):
        pg, clipfrac = saved[1](*a, **k)
        captured["clipfrac"] = clipfrac
        return pg, clipfrac

    L.get_log_probs_and_entropy = lambda logits, **kw: (None, {"log_probs": logp, "entropy": ent})
    L.compute_policy_loss = policy_loss
    L.vanilla_tis_function, L.icepop_function = tis_spy(saved_tis[0]), tis_spy(saved_tis[1])
    # slime's load_function is functools.cache'd: without this it would hand out the spy of the
    # first call, which writes into that call's `captured`.
    clear = getattr(L.load_function, "cache_clear", lambda: None)
    clear()
    if agg in ("group_token_mean", "token_sum"):
        w = torch.tensor([x for ws in group_weights([s["group"] for s in samples],
                                                    [s["loss_mask"] for s in samples], agg)
                          for x in ws], dtype=f64)
        L.get_sum_of_sample_mean = lambda *a, **k: (lambda x: (w * x).sum())
    try:
        loss, normalizer, log = L.loss_function(args, batch, 1, n, torch.zeros(1, 1, 1))
    finally:
        L.get_log_probs_and_entropy, L.compute_policy_loss, L.get_sum_of_sample_mean = saved
        L.vanilla_tis_function, L.icepop_function = saved_tis
        clear()
    if agg in ("group_token_mean", "token_sum"):
        normalizer = torch.ones(())
    obj = loss / normalizer
    obj.backward()
    values = dict(zip(log["keys"], log["values"][1:].tolist()))
    # The reported numbers are sums that slime's train step divides by the step's sample count
    # (per-sample mean) or its token count (the normalizer, per-token).
    d = float(n) if agg == "sample_mean" else float(normalizer)
    mask = torch.cat(masks)
    trained = mask != 0
    tokens = int(trained.sum())
    clipped = captured["clipfrac"][trained].sum().item()
    out = {
        "loss": obj.item(),
        "pg_loss": values["pg_loss"] / d,
        "kl": values.get("kl_loss", 0.0) / d,
        "entropy": values["entropy_loss"] / d,
        "clip_frac": clipped / tokens if tokens else 0.0,
        "tokens": tokens,
        "grad_logprobs": [g.grad.tolist() for g in logp],
        "grad_entropy": [g.grad.tolist() for g in ent],
    }
    if use_tis:
        assert "tis_clipfrac" in captured, "slime did not call the TIS function"
        out["tis_clip_frac"] = (captured["tis_clipfrac"][trained].sum().item() / tokens
                                if tokens else 0.0)
        out["tis_weight"] = (captured["tis_weight"][trained].sum().item() / tokens
                             if tokens else 0.0)
    return out


def loss_cases(rng: random.Random):
    base = dict(eps_clip=0.2, eps_clip_high=0.28, kl_loss_coef=0.0, kl_loss_type="low_var_kl",
                entropy_coef=0.0, policy_loss="ppo", aggregation="sample_mean")

    def w(**k):
        return {**base, **k}

    named = [
        ("ppo_sample_mean", w(), 0, False),
        ("ppo_token_mean", w(aggregation="token_mean"), 0, False),
        ("ppo_group_token_mean", w(aggregation="group_token_mean"), 0, False),
        ("ppo_token_sum", w(aggregation="token_sum"), 0, False),
        ("ppo_symmetric_clip", w(eps_clip_high=0.2), 0, False),
        ("ppo_eps_clip_high_zero", w(eps_clip_high=0.0), 0, False),
        ("sample_mean_empty_samples", w(), 2, True),
        ("token_mean_empty_samples", w(aggregation="token_mean"), 2, True),
        ("group_token_mean_empty_samples", w(aggregation="group_token_mean"), 2, True),
        ("kl_k1", w(kl_loss_coef=0.1, kl_loss_type="k1"), 0, False),
        ("kl_k2", w(kl_loss_coef=0.1, kl_loss_type="k2"), 0, False),
        ("kl_k3", w(kl_loss_coef=0.1, kl_loss_type="k3"), 0, False),
        ("kl_low_var_kl_clamped", w(kl_loss_coef=0.1, kl_loss_type="low_var_kl"), 0, False),
        ("entropy_bonus", w(entropy_coef=0.01), 0, False),
        ("token_mean_kl_entropy", w(aggregation="token_mean", kl_loss_coef=0.05, entropy_coef=0.02), 1,
         True),
        ("gspo", w(policy_loss="gspo", eps_clip=0.05, eps_clip_high=0.08), 0, False),
        ("gspo_token_mean_kl", w(policy_loss="gspo", aggregation="token_mean", kl_loss_coef=0.2,
                                 kl_loss_type="k2", eps_clip=0.05, eps_clip_high=0.08), 1, True),
        ("gspo_interior_mask", w(policy_loss="gspo", eps_clip=0.1, eps_clip_high=0.1), 1, True),
    ]
    out = [(name, cfg, rng.randint(6, 12), empty, interior) for name, cfg, empty, interior in named]
    for i in range(80):
        cfg = w(eps_clip=rng.choice([0.1, 0.2, 0.3]),
                eps_clip_high=rng.choice([0.0, 0.1, 0.2, 0.28, 0.4]),
                kl_loss_coef=rng.choice([0.0, 0.0, 0.01, 0.1, 0.5]),
                kl_loss_type=rng.choice(["k1", "k2", "k3", "low_var_kl"]),
                entropy_coef=rng.choice([0.0, 0.0, 0.001, 0.05]),
                policy_loss=rng.choice(["ppo", "ppo", "gspo"]),
                aggregation=rng.choice(["sample_mean", "sample_mean", "token_mean",
                                        "group_token_mean", "token_sum"]))
        out.append((f"random_{i:02d}", cfg, rng.randint(1, 12), rng.choice([0, 0, 1, 2]),
                    rng.random() < 0.5))
    return out


def tis_inputs(rng: random.Random, cfg: dict, n_samples: int, empty: int, interior: bool,
               on_step: bool):
    """loss_inputs plus rollout log-probs whose ratios reach past both ends of the band. on_step:
    the trainer's old log-probs are the current ones (one optimizer step per rollout step, what a
    slimen engine computes itself)."""
    samples = loss_inputs(rng, cfg, n_samples, empty, interior)
    for s in samples:
        if on_step:
            s["old_logprobs"] = list(s["logprobs"])
        s["rollout_logprobs"] = [r6(x + rng.choice([0.05, 0.4, 1.0]) * rng.gauss(0, 1))
                                 for x in s["old_logprobs"]]
    return samples


def tis_cases(rng: random.Random):
    base = dict(eps_clip=0.2, eps_clip_high=0.28, kl_loss_coef=0.0, kl_loss_type="low_var_kl",
                entropy_coef=0.0, policy_loss="ppo", aggregation="sample_mean", use_tis=True,
                tis_mode="tis", tis_clip=2.0, tis_clip_low=0.0)

    def w(**k):
        return {**base, **k}

    named = [
        ("tis_default", w(), 0, False, False),
        ("tis_on_step", w(), 0, False, True),
        ("tis_band", w(tis_clip=1.5, tis_clip_low=0.5), 0, False, False),
        ("tis_token_mean_empty", w(aggregation="token_mean", tis_clip_low=0.2), 2, True, False),
        ("tis_group_token_mean", w(aggregation="group_token_mean"), 1, True, False),
        ("tis_token_sum_kl_entropy", w(aggregation="token_sum", kl_loss_coef=0.1, kl_loss_type="k3",
                                       entropy_coef=0.01), 0, False, False),
        ("tis_gspo", w(policy_loss="gspo", eps_clip=0.05, eps_clip_high=0.08), 0, False, False),
        ("tis_gspo_on_step", w(policy_loss="gspo", tis_clip_low=0.5), 1, True, True),
        ("icepop", w(tis_mode="icepop", tis_clip_low=0.5), 0, False, False),
        ("icepop_on_step", w(tis_mode="icepop", tis_clip_low=0.5), 0, False, True),
        ("icepop_narrow", w(tis_mode="icepop", tis_clip=1.25, tis_clip_low=0.8), 0, False, False),
        ("icepop_token_mean_empty", w(tis_mode="icepop", tis_clip_low=0.5, aggregation="token_mean"),
         2, True, False),
        ("icepop_gspo", w(tis_mode="icepop", policy_loss="gspo", tis_clip_low=0.5, eps_clip=0.1,
                          eps_clip_high=0.1), 0, False, False),
        ("icepop_gspo_kl", w(tis_mode="icepop", policy_loss="gspo", aggregation="token_mean",
                             tis_clip=1.5, tis_clip_low=0.6, kl_loss_coef=0.2, kl_loss_type="k2"),
         1, True, False),
    ]
    out = [(name, cfg, rng.randint(6, 12), empty, interior, on_step)
           for name, cfg, empty, interior, on_step in named]
    for i in range(40):
        lo = rng.choice([0.0, 0.0, 0.2, 0.5, 0.8])
        cfg = w(eps_clip=rng.choice([0.1, 0.2, 0.3]), eps_clip_high=rng.choice([0.0, 0.2, 0.28]),
                kl_loss_coef=rng.choice([0.0, 0.0, 0.1]),
                kl_loss_type=rng.choice(["k1", "k2", "k3", "low_var_kl"]),
                entropy_coef=rng.choice([0.0, 0.0, 0.05]),
                policy_loss=rng.choice(["ppo", "ppo", "gspo"]),
                aggregation=rng.choice(["sample_mean", "token_mean", "group_token_mean",
                                        "token_sum"]),
                tis_mode=rng.choice(["tis", "icepop"]), tis_clip_low=lo,
                tis_clip=rng.choice([1.2, 1.5, 2.0, 5.0]))
        out.append((f"random_{i:02d}", cfg, rng.randint(1, 12), rng.choice([0, 0, 1]),
                    rng.random() < 0.5, rng.random() < 0.3))
    return out


# ---------------------------------------------------------------------------- advantages


def slime_advantages(torch, L, post_process, est: dict, samples: list[dict]) -> dict:
    """Groups are contiguous and of one size, as slime's rollouts are."""
    groups = []
    for s in samples:
        if not groups or groups[-1] != s["group"]:
            groups.append(s["group"])
    n_per = len(samples) // len(groups)
    args = Namespace(
        advantage_estimator=est["name"], rewards_normalization=est["rewards_normalization"],
        grpo_std_normalization=est["grpo_std_normalization"], n_samples_per_prompt=n_per,
        rollout_batch_size=len(groups), reward_key=None, use_rollout_logprobs=False,
        kl_coef=est["kl_coef"], kl_loss_type=est["kl_loss_type"],
        custom_advantage_function_path=None, gamma=est["gamma"], lambd=est["lambda"],
        use_opd=False,
        normalize_advantages=est["name"] in ("reinforce_plus_plus", "reinforce_plus_plus_baseline"))
    fake = Namespace(custom_reward_post_process_func=None, args=args)
    rollout_samples = [Namespace(reward=s["reward"], get_reward_value=(lambda a, r=s["reward"]: r))
                       for s in samples]
    _, rewards = post_process(fake, rollout_samples)
    f32 = torch.float32
    data = {
        "log_probs": [torch.tensor(s["logprobs"], dtype=f32) for s in samples],
        "ref_log_probs": [torch.tensor(s["ref_logprobs"], dtype=f32) for s in samples],
        "rewards": rewards,
        "values": [torch.tensor(s["values"], dtype=f32) for s in samples] if est["name"] == "ppo"
        else None,
        "response_lengths": [len(s["logprobs"]) for s in samples],
        "loss_masks": [torch.tensor(s["loss_mask"], dtype=torch.int) for s in samples],
        "total_lengths": [len(s["logprobs"]) + 5 for s in samples],
    }
    L.compute_advantages_and_returns(args, data)
    out = {"advantages": [a.tolist() for a in data["advantages"]]}
    if est["name"] == "ppo":
        out["returns"] = [r.tolist() for r in data["returns"]]
    return out


def adv_inputs(rng: random.Random, est: dict, n_groups: int, n_per: int, interior: bool):
    samples = []
    for g in range(n_groups):
        for _ in range(n_per):
            n = rng.randint(1, 9)
            lp = [r6(-3 * rng.random()) for _ in range(n)]
            ref = [r6(x + 0.4 * rng.gauss(0, 1)) for x in lp]
            mask = [1] * n
            if interior:
                for t in range(n):
                    if rng.random() < 0.3:
                        mask[t] = 0
                if sum(mask) == 0:  # slime's REINFORCE++ refuses a fully masked sample
                    mask[rng.randrange(n)] = 1
            s = {"group": f"g{g}", "reward": rng.choice([0.0, 1.0, r6(rng.gauss(0, 1))]),
                 "logprobs": lp, "ref_logprobs": ref, "loss_mask": mask}
            if est["name"] == "ppo":
                s["values"] = [r6(rng.gauss(0, 0.5)) for _ in range(n)]
            samples.append(s)
    return samples


def adv_cases(rng: random.Random):
    def e(name, **k):
        d = dict(name=name, rewards_normalization=True, grpo_std_normalization=True, gamma=1.0,
                 **{"lambda": 1.0}, kl_coef=0.0, kl_loss_type="low_var_kl")
        d.update(k)
        return d

    named = [
        ("grpo", e("grpo"), False),
        ("grpo_no_std", e("grpo", grpo_std_normalization=False), False),
        ("grpo_raw_rewards", e("grpo", rewards_normalization=False), False),
        ("gspo", e("gspo"), False),
        ("reinforce_plus_plus", e("reinforce_plus_plus"), False),
        ("reinforce_plus_plus_gamma", e("reinforce_plus_plus", gamma=0.9), False),
        ("reinforce_plus_plus_interior_mask", e("reinforce_plus_plus", gamma=0.95), True),
        ("reinforce_plus_plus_kl_k1", e("reinforce_plus_plus", kl_coef=0.1, kl_loss_type="k1"), True),
        ("reinforce_plus_plus_kl_low_var", e("reinforce_plus_plus", kl_coef=0.05, gamma=0.9), True),
        ("reinforce_plus_plus_baseline", e("reinforce_plus_plus_baseline"), False),
        ("reinforce_plus_plus_baseline_mask", e("reinforce_plus_plus_baseline"), True),
        ("reinforce_plus_plus_baseline_kl_k3",
         e("reinforce_plus_plus_baseline", kl_coef=0.1, kl_loss_type="k3"), True),
        ("reinforce_plus_plus_baseline_raw", e("reinforce_plus_plus_baseline",
                                               rewards_normalization=False), False),
        ("ppo_gae", e("ppo"), False),
        ("ppo_gae_gamma_lambda", e("ppo", gamma=0.99, **{"lambda": 0.95}), False),
        ("ppo_kl_k2", e("ppo", kl_coef=0.1, kl_loss_type="k2", gamma=0.99, **{"lambda": 0.9}), True),
    ]
    out = [(name, est, rng.randint(2, 4), rng.randint(2, 5), interior)
           for name, est, interior in named]
    names = ["grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"]
    for i in range(60):
        name = rng.choice(names)
        est = e(name, rewards_normalization=rng.random() < 0.8,
                grpo_std_normalization=rng.random() < 0.7, gamma=rng.choice([1.0, 0.99, 0.9]),
                kl_coef=rng.choice([0.0, 0.01, 0.1]) if name not in ("grpo", "gspo") else 0.0,
                kl_loss_type=rng.choice(["k1", "k2", "k3", "low_var_kl"]),
                **{"lambda": rng.choice([1.0, 0.95])})
        out.append((f"random_{i:02d}", est, rng.randint(1, 4), rng.randint(2, 5),
                    rng.random() < 0.5 and name != "ppo"))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--slime", required=True, help="a folder holding slime's slime/ package")
    ap.add_argument("--commit", default="", help="the slime commit, recorded in the files")
    ap.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parent))
    a = ap.parse_args()
    torch, L, post_process = load_slime(a.slime)
    at = f" at commit {a.commit}" if a.commit else ""
    rng = random.Random(14)

    cases = []
    for name, cfg, n, empty, interior in loss_cases(rng):
        samples = loss_inputs(rng, cfg, n, empty, interior)
        cases.append({"name": name, "config": cfg, "samples": samples,
                      "expected": slime_loss(torch, L, cfg, samples)})
    desc = ("Policy-loss test vectors computed by THUDM/slime's own loss code" + at +
            " (testdata/slime/make_vectors.py). group_token_mean and token_sum are slimen's "
            "reductions applied to slime's per-token terms. Schema: engines/tiny/lossvectors_test.go.")
    write(pathlib.Path(a.out, "loss_vectors.json"), {"description": desc, "cases": cases})

    # Its own random stream, so that adding TIS cases leaves the other two files as they were.
    tis_rng = random.Random(21)
    cases = []
    for name, cfg, n, empty, interior, on_step in tis_cases(tis_rng):
        samples = tis_inputs(tis_rng, cfg, n, empty, interior, on_step)
        cases.append({"name": name, "config": cfg, "samples": samples,
                      "expected": slime_loss(torch, L, cfg, samples)})
    desc = ("Off-policy correction (TIS, IcePop) test vectors computed by THUDM/slime's own loss "
            "code" + at + " (testdata/slime/make_vectors.py): loss_vectors.json's schema, plus "
            "config use_tis/tis_mode/tis_clip/tis_clip_low, per-sample rollout_logprobs (old_logprobs "
            "are the trainer's) and expected tis_clip_frac and tis_weight. Readers: "
            "engines/tiny/lossvectors_test.go, engines/torch/tests/test_loss_vectors.py.")
    write(pathlib.Path(a.out, "tis_vectors.json"), {"description": desc, "cases": cases})

    cases = []
    for name, est, groups, per, interior in adv_cases(rng):
        samples = adv_inputs(rng, est, groups, per, interior)
        exp = slime_advantages(torch, L, post_process, est, samples)
        if any(math.isnan(x) for a in exp["advantages"] for x in a):
            continue
        cases.append({"name": name, "estimator": est, "samples": samples, "expected": exp})
    desc = ("Advantage test vectors computed by THUDM/slime's own code" + at +
            " (testdata/slime/make_vectors.py). Schema: host/advantage_vectors_test.go.")
    write(pathlib.Path(a.out, "advantage_vectors.json"), {"description": desc, "cases": cases})


def write(path: pathlib.Path, obj):
    """One case a line: small diffs when slime changes, and a file of a few hundred KB."""
    lines = [json.dumps(c, separators=(",", ":")) for c in obj["cases"]]
    path.write_text('{"description": ' + json.dumps(obj["description"]) + ',\n"cases": [\n' +
                    ",\n".join(lines) + "\n]}\n")
    print(f"{path}: {len(obj['cases'])} cases")


if __name__ == "__main__":
    main()
