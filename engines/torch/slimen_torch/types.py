"""The engine's request and result types, field for field those of engines/engine.go.

The engine works on these; server.py converts them to and from the protocol messages, so the
engine can be used (and tested) in-process without gRPC.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Sampling:
    max_tokens: int = 0  # ≥ 1; the caller sets it (the engine refuses 0)
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # (0, 1]; 0 is read as 1
    stop: list[str] = dataclasses.field(default_factory=list)
    seed: int = 0  # a response is a function of (seed, prompt, sample index)
    constraint: str = ""  # what the response must follow (engines/constrain's Spec as JSON; constrain.py)


@dataclasses.dataclass
class GenerateRequest:
    id: str = ""
    messages: list[dict] | None = None  # [{"role", "content"}], rendered with the chat template
    prompt_tokens: list[int] | None = None  # used as they are
    n: int = 1
    sampling: Sampling = dataclasses.field(default_factory=Sampling)
    adapter: str = ""  # the LoRA adapter that generates it; "": the base


@dataclasses.dataclass
class Completion:
    request_id: str
    index: int
    prompt_tokens: list[int]
    tokens: list[int]  # including a final EOS token when one was sampled
    logprobs: list[float]  # under the temperature-1 distribution
    text: str  # without EOS and stop string
    finish_reason: str  # "stop" or "length"


@dataclasses.dataclass
class ScoreRequest:
    tokens: list[int]
    messages: list[dict] | None = None
    prompt_tokens: list[int] | None = None
    reference: bool = False  # score with the frozen KL reference, not the current weights
    adapter: str = ""  # score with this LoRA adapter (its reference: the base without it)


@dataclasses.dataclass
class Sample:
    prompt: list[int]
    response: list[int]
    loss_mask: list[float]
    old_logprobs: list[float]
    advantages: list[float]
    group: str = ""  # "" is a group of its own
    # PPO critic: the value target of each token and the values at rollout time. A sample with
    # returns trains the value head (the policy fields are ignored).
    returns: list[float] = dataclasses.field(default_factory=list)
    old_values: list[float] = dataclasses.field(default_factory=list)
    # With LossConfig.use_tis: the trainer's log-probs before the rollout step's first optimizer
    # step (empty: the engine's own before this step, detached); old_logprobs then only divide
    # the TIS ratio.
    train_logprobs: list[float] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class LossConfig:
    lr: float = 1e-6
    beta1: float = 0.0  # 0 is read as 0.9
    beta2: float = 0.0  # 0 is read as 0.999
    adam_eps: float = 0.0  # 0 is read as 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float = 0.0  # 0: no clipping
    eps_clip: float = 0.2
    eps_clip_high: float = 0.2  # as given: 0 clips the ratio at exactly 1
    kl_loss_coef: float = 0.0
    kl_loss_type: str = ""  # "" is read as low_var_kl
    entropy_coef: float = 0.0
    policy_loss: str = ""  # "" is read as ppo
    aggregation: str = ""  # "" is read as sample_mean
    value_clip: float = 0.0  # critic: V clipped to old_values ± value_clip; 0: no clipping
    # Off-policy correction (slime's --use-tis; loss.py): tis_mode "tis" or "icepop", the weight
    # band [tis_clip_low, tis_clip].
    use_tis: bool = False
    tis_mode: str = ""  # "" is read as tis
    tis_clip: float = 0.0  # 0 is read as 2 (slime's default)
    tis_clip_low: float = 0.0


@dataclasses.dataclass
class Batch:
    samples: list[Sample]
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    id: str = ""
    adapter: str = ""  # train this LoRA adapter (the base stays frozen); "": the full weights


@dataclasses.dataclass
class TrainStats:
    loss: float = 0.0
    pg_loss: float = 0.0
    kl: float = 0.0
    clip_frac: float = 0.0
    entropy: float = 0.0
    grad_norm: float = 0.0
    tokens: int = 0
    value_loss: float = 0.0  # a critic's value loss
    tis_clip_frac: float = 0.0  # use_tis: share of trained tokens whose weight was clipped/masked
    tis_weight: float = 0.0  # use_tis: mean weight over trained tokens
    # The rollout/trainer log-prob mismatch |trainer − rollout| over trained tokens (a policy
    # step): its mean, its largest, and slime's train_rollout_logprob_abs_diff (reduced like the
    # loss). The trainer's side is the step's forward before its update (with use_tis, the
    # trainer's old log-probs), the rollout's the sample's old_logprobs.
    logprob_diff_mean: float = 0.0
    logprob_diff_max: float = 0.0
    logprob_abs_diff: float = 0.0
    skipped: bool = False
    reason: str = ""


class RequestError(Exception):
    """A request the engine refuses; code is a gRPC status code name (e.g. INVALID_ARGUMENT)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
