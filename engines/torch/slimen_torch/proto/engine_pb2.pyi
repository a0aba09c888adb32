from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InfoRequest(_message.Message):
    __slots__ = ("protocol_version",)
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    def __init__(self, protocol_version: _Optional[int] = ...) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("protocol_version", "instance", "info")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    instance: str
    info: Info
    def __init__(self, protocol_version: _Optional[int] = ..., instance: _Optional[str] = ..., info: _Optional[_Union[Info, _Mapping]] = ...) -> None: ...

class Info(_message.Message):
    __slots__ = ("model", "architecture", "vocab_size", "max_seq_len", "chat_template", "eos_tokens", "params", "devices", "capabilities")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    model: str
    architecture: str
    vocab_size: int
    max_seq_len: int
    chat_template: str
    eos_tokens: _containers.RepeatedScalarFieldContainer[int]
    params: int
    devices: _containers.RepeatedScalarFieldContainer[str]
    capabilities: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model: _Optional[str] = ..., architecture: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_seq_len: _Optional[int] = ..., chat_template: _Optional[str] = ..., eos_tokens: _Optional[_Iterable[int]] = ..., params: _Optional[int] = ..., devices: _Optional[_Iterable[str]] = ..., capabilities: _Optional[_Iterable[str]] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("status", "protocol_version", "instance")
    class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATUS_UNSPECIFIED: _ClassVar[HealthResponse.Status]
        SERVING: _ClassVar[HealthResponse.Status]
        NOT_SERVING: _ClassVar[HealthResponse.Status]
    STATUS_UNSPECIFIED: HealthResponse.Status
    SERVING: HealthResponse.Status
    NOT_SERVING: HealthResponse.Status
    STATUS_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    status: HealthResponse.Status
    protocol_version: int
    instance: str
    def __init__(self, status: _Optional[_Union[HealthResponse.Status, str]] = ..., protocol_version: _Optional[int] = ..., instance: _Optional[str] = ...) -> None: ...

class Message(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class Sampling(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "stop", "seed", "constraint")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    stop: _containers.RepeatedScalarFieldContainer[str]
    seed: int
    constraint: str
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., stop: _Optional[_Iterable[str]] = ..., seed: _Optional[int] = ..., constraint: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("id", "messages", "prompt_tokens", "n", "sampling", "adapter", "version")
    ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    id: str
    messages: _containers.RepeatedCompositeFieldContainer[Message]
    prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    n: int
    sampling: Sampling
    adapter: str
    version: int
    def __init__(self, id: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[Message, _Mapping]]] = ..., prompt_tokens: _Optional[_Iterable[int]] = ..., n: _Optional[int] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., adapter: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class GenerateStreamRequest(_message.Message):
    __slots__ = ("requests", "cancel")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[GenerateRequest]
    cancel: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, requests: _Optional[_Iterable[_Union[GenerateRequest, _Mapping]]] = ..., cancel: _Optional[_Iterable[str]] = ...) -> None: ...

class Completion(_message.Message):
    __slots__ = ("request_id", "index", "prompt_tokens", "tokens", "logprobs", "text", "finish_reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    index: int
    prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    text: str
    finish_reason: str
    def __init__(self, request_id: _Optional[str] = ..., index: _Optional[int] = ..., prompt_tokens: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ...) -> None: ...

class RequestError(_message.Message):
    __slots__ = ("request_id", "code", "message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    code: int
    message: str
    def __init__(self, request_id: _Optional[str] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class GenerateStreamResponse(_message.Message):
    __slots__ = ("completions", "errors")
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    completions: _containers.RepeatedCompositeFieldContainer[Completion]
    errors: _containers.RepeatedCompositeFieldContainer[RequestError]
    def __init__(self, completions: _Optional[_Iterable[_Union[Completion, _Mapping]]] = ..., errors: _Optional[_Iterable[_Union[RequestError, _Mapping]]] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("messages", "prompt_tokens", "tokens", "reference", "adapter")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[Message]
    prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    reference: bool
    adapter: str
    def __init__(self, messages: _Optional[_Iterable[_Union[Message, _Mapping]]] = ..., prompt_tokens: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[int]] = ..., reference: _Optional[bool] = ..., adapter: _Optional[str] = ...) -> None: ...

class Scores(_message.Message):
    __slots__ = ("logprobs",)
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class ScoreBatchRequest(_message.Message):
    __slots__ = ("requests", "version")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[ScoreRequest]
    version: int
    def __init__(self, requests: _Optional[_Iterable[_Union[ScoreRequest, _Mapping]]] = ..., version: _Optional[int] = ...) -> None: ...

class ScoreBatchResponse(_message.Message):
    __slots__ = ("scores",)
    SCORES_FIELD_NUMBER: _ClassVar[int]
    scores: _containers.RepeatedCompositeFieldContainer[Scores]
    def __init__(self, scores: _Optional[_Iterable[_Union[Scores, _Mapping]]] = ...) -> None: ...

class ValuesResponse(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedCompositeFieldContainer[Scores]
    def __init__(self, values: _Optional[_Iterable[_Union[Scores, _Mapping]]] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("prompt", "response", "loss_mask", "old_logprobs", "advantages", "group", "returns", "old_values", "train_logprobs")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    OLD_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGES_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    RETURNS_FIELD_NUMBER: _ClassVar[int]
    OLD_VALUES_FIELD_NUMBER: _ClassVar[int]
    TRAIN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    prompt: _containers.RepeatedScalarFieldContainer[int]
    response: _containers.RepeatedScalarFieldContainer[int]
    loss_mask: _containers.RepeatedScalarFieldContainer[float]
    old_logprobs: _containers.RepeatedScalarFieldContainer[float]
    advantages: _containers.RepeatedScalarFieldContainer[float]
    group: str
    returns: _containers.RepeatedScalarFieldContainer[float]
    old_values: _containers.RepeatedScalarFieldContainer[float]
    train_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, prompt: _Optional[_Iterable[int]] = ..., response: _Optional[_Iterable[int]] = ..., loss_mask: _Optional[_Iterable[float]] = ..., old_logprobs: _Optional[_Iterable[float]] = ..., advantages: _Optional[_Iterable[float]] = ..., group: _Optional[str] = ..., returns: _Optional[_Iterable[float]] = ..., old_values: _Optional[_Iterable[float]] = ..., train_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class LossConfig(_message.Message):
    __slots__ = ("lr", "beta1", "beta2", "adam_eps", "weight_decay", "max_grad_norm", "eps_clip", "eps_clip_high", "kl_loss_coef", "kl_loss_type", "entropy_coef", "policy_loss", "aggregation", "value_clip", "use_tis", "tis_mode", "tis_clip", "tis_clip_low")
    LR_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    ADAM_EPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    MAX_GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    EPS_CLIP_FIELD_NUMBER: _ClassVar[int]
    EPS_CLIP_HIGH_FIELD_NUMBER: _ClassVar[int]
    KL_LOSS_COEF_FIELD_NUMBER: _ClassVar[int]
    KL_LOSS_TYPE_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_COEF_FIELD_NUMBER: _ClassVar[int]
    POLICY_LOSS_FIELD_NUMBER: _ClassVar[int]
    AGGREGATION_FIELD_NUMBER: _ClassVar[int]
    VALUE_CLIP_FIELD_NUMBER: _ClassVar[int]
    USE_TIS_FIELD_NUMBER: _ClassVar[int]
    TIS_MODE_FIELD_NUMBER: _ClassVar[int]
    TIS_CLIP_FIELD_NUMBER: _ClassVar[int]
    TIS_CLIP_LOW_FIELD_NUMBER: _ClassVar[int]
    lr: float
    beta1: float
    beta2: float
    adam_eps: float
    weight_decay: float
    max_grad_norm: float
    eps_clip: float
    eps_clip_high: float
    kl_loss_coef: float
    kl_loss_type: str
    entropy_coef: float
    policy_loss: str
    aggregation: str
    value_clip: float
    use_tis: bool
    tis_mode: str
    tis_clip: float
    tis_clip_low: float
    def __init__(self, lr: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., adam_eps: _Optional[float] = ..., weight_decay: _Optional[float] = ..., max_grad_norm: _Optional[float] = ..., eps_clip: _Optional[float] = ..., eps_clip_high: _Optional[float] = ..., kl_loss_coef: _Optional[float] = ..., kl_loss_type: _Optional[str] = ..., entropy_coef: _Optional[float] = ..., policy_loss: _Optional[str] = ..., aggregation: _Optional[str] = ..., value_clip: _Optional[float] = ..., use_tis: _Optional[bool] = ..., tis_mode: _Optional[str] = ..., tis_clip: _Optional[float] = ..., tis_clip_low: _Optional[float] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("id", "samples", "loss")
    ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    id: str
    samples: _containers.RepeatedCompositeFieldContainer[Sample]
    loss: LossConfig
    def __init__(self, id: _Optional[str] = ..., samples: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ..., loss: _Optional[_Union[LossConfig, _Mapping]] = ...) -> None: ...

class TrainStats(_message.Message):
    __slots__ = ("loss", "pg_loss", "kl", "clip_frac", "entropy", "grad_norm", "tokens", "skipped", "reason", "value_loss", "tis_clip_frac", "tis_weight", "logprob_diff_mean", "logprob_diff_max", "logprob_abs_diff")
    LOSS_FIELD_NUMBER: _ClassVar[int]
    PG_LOSS_FIELD_NUMBER: _ClassVar[int]
    KL_FIELD_NUMBER: _ClassVar[int]
    CLIP_FRAC_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    VALUE_LOSS_FIELD_NUMBER: _ClassVar[int]
    TIS_CLIP_FRAC_FIELD_NUMBER: _ClassVar[int]
    TIS_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_DIFF_MEAN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_DIFF_MAX_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_ABS_DIFF_FIELD_NUMBER: _ClassVar[int]
    loss: float
    pg_loss: float
    kl: float
    clip_frac: float
    entropy: float
    grad_norm: float
    tokens: int
    skipped: bool
    reason: str
    value_loss: float
    tis_clip_frac: float
    tis_weight: float
    logprob_diff_mean: float
    logprob_diff_max: float
    logprob_abs_diff: float
    def __init__(self, loss: _Optional[float] = ..., pg_loss: _Optional[float] = ..., kl: _Optional[float] = ..., clip_frac: _Optional[float] = ..., entropy: _Optional[float] = ..., grad_norm: _Optional[float] = ..., tokens: _Optional[int] = ..., skipped: _Optional[bool] = ..., reason: _Optional[str] = ..., value_loss: _Optional[float] = ..., tis_clip_frac: _Optional[float] = ..., tis_weight: _Optional[float] = ..., logprob_diff_mean: _Optional[float] = ..., logprob_diff_max: _Optional[float] = ..., logprob_abs_diff: _Optional[float] = ...) -> None: ...

class TrainRequest(_message.Message):
    __slots__ = ("batch", "adapter")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    batch: Batch
    adapter: str
    def __init__(self, batch: _Optional[_Union[Batch, _Mapping]] = ..., adapter: _Optional[str] = ...) -> None: ...

class TrainResponse(_message.Message):
    __slots__ = ("stats", "duplicate")
    STATS_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    stats: TrainStats
    duplicate: bool
    def __init__(self, stats: _Optional[_Union[TrainStats, _Mapping]] = ..., duplicate: _Optional[bool] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("texts",)
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    texts: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, texts: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[TokenIds]
    def __init__(self, tokens: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ...) -> None: ...

class RenderRequest(_message.Message):
    __slots__ = ("messages", "tools", "add_generation_prompt")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[Message]
    tools: _containers.RepeatedScalarFieldContainer[str]
    add_generation_prompt: bool
    def __init__(self, messages: _Optional[_Iterable[_Union[Message, _Mapping]]] = ..., tools: _Optional[_Iterable[str]] = ..., add_generation_prompt: _Optional[bool] = ...) -> None: ...

class RenderBatchRequest(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[RenderRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[RenderRequest, _Mapping]]] = ...) -> None: ...

class RenderResponse(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[TokenIds]
    def __init__(self, tokens: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ...) -> None: ...

class SaveRequest(_message.Message):
    __slots__ = ("dir", "adapter", "version")
    DIR_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    dir: str
    adapter: str
    version: int
    def __init__(self, dir: _Optional[str] = ..., adapter: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class SaveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ("dir", "adapter")
    DIR_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    dir: str
    adapter: str
    def __init__(self, dir: _Optional[str] = ..., adapter: _Optional[str] = ...) -> None: ...

class LoadResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AddAdapterRequest(_message.Message):
    __slots__ = ("name", "rank", "alpha", "dropout", "targets", "seed")
    NAME_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    DROPOUT_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    name: str
    rank: int
    alpha: float
    dropout: float
    targets: _containers.RepeatedScalarFieldContainer[str]
    seed: int
    def __init__(self, name: _Optional[str] = ..., rank: _Optional[int] = ..., alpha: _Optional[float] = ..., dropout: _Optional[float] = ..., targets: _Optional[_Iterable[str]] = ..., seed: _Optional[int] = ...) -> None: ...

class AddAdapterResponse(_message.Message):
    __slots__ = ("params",)
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    params: int
    def __init__(self, params: _Optional[int] = ...) -> None: ...

class RemoveAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class RemoveAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VersionRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class VersionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PushGroupRequest(_message.Message):
    __slots__ = ("init_method", "rank", "world", "group", "timeout_s")
    INIT_METHOD_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    init_method: str
    rank: int
    world: int
    group: str
    timeout_s: float
    def __init__(self, init_method: _Optional[str] = ..., rank: _Optional[int] = ..., world: _Optional[int] = ..., group: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class PushGroupResponse(_message.Message):
    __slots__ = ("links",)
    LINKS_FIELD_NUMBER: _ClassVar[int]
    links: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, links: _Optional[_Iterable[str]] = ...) -> None: ...

class PushWeightsRequest(_message.Message):
    __slots__ = ("group", "peer", "version")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    group: str
    peer: int
    version: int
    def __init__(self, group: _Optional[str] = ..., peer: _Optional[int] = ..., version: _Optional[int] = ...) -> None: ...

class PushWeightsResponse(_message.Message):
    __slots__ = ("bytes", "seconds", "link")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    LINK_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    seconds: float
    link: str
    def __init__(self, bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., link: _Optional[str] = ...) -> None: ...
