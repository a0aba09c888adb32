"""The architecture of a Llama-family checkpoint, read from a Hugging Face config.json.

One config type covers Llama, Qwen2 and Qwen3: they differ only in biases on the attention
projections (Qwen2 always has q/k/v biases; Llama and Qwen3 follow `attention_bias`) and in
Qwen3's RMSNorm of every query and key head before the rotary embedding. Anything else that would
change the computation (other activations, rope scaling we do not implement, MLP biases, sliding
windows) is refused with a message, never silently ignored.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

# architectures value -> model_type, as transformers writes them.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    max_seq_len: int
    rms_eps: float
    rope_theta: float
    tie_embeddings: bool
    qkv_bias: bool = False  # biases on q, k and v (Qwen2; Llama/Qwen3 with attention_bias)
    o_bias: bool = False  # bias on the output projection (Llama/Qwen3 with attention_bias)
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim of each query and key head
    # Llama 3 rope scaling: (factor, low_freq_factor, high_freq_factor, original_max_positions).
    llama3_rope: tuple[float, float, float, int] | None = None

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def validate(self) -> None:
        positive = dict(vocab_size=self.vocab_size, hidden_size=self.hidden,
                        intermediate_size=self.intermediate, num_hidden_layers=self.layers,
                        num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
                        head_dim=self.head_dim, max_position_embeddings=self.max_seq_len)
        for name, v in positive.items():
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"config.json: {name} must be a positive integer, got {v!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"config.json: num_key_value_heads {self.kv_heads} must divide "
                             f"num_attention_heads {self.heads}")
        if self.head_dim % 2:
            raise ValueError(f"config.json: head_dim {self.head_dim} must be even (rotary "
                             "embeddings rotate pairs)")

    def params(self) -> int:
        """Number of parameters, the tied embedding counted once."""
        d = self.hidden
        attn = d * (self.q_dim + 2 * self.kv_dim) + self.q_dim * d
        if self.qkv_bias:
            attn += self.q_dim + 2 * self.kv_dim
        if self.o_bias:
            attn += d
        if self.qk_norm:
            attn += 2 * self.head_dim
        layer = attn + 3 * d * self.intermediate + 2 * d
        n = self.vocab_size * d + self.layers * layer + d
        return n if self.tie_embeddings else n + self.vocab_size * d


def parse_config(raw: dict, where: str = "config.json") -> ModelConfig:
    """Builds a ModelConfig from the dict of a config.json, refusing what we do not compute."""
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise ValueError(f"{where}: architectures {archs} is not supported; the torch engine runs "
                         f"{', '.join(ARCHITECTURES)}")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{where}: hidden_act {act!r} is not supported (silu only)")
    if raw.get("mlp_bias"):
        raise ValueError(f"{where}: mlp_bias is not supported")
    if raw.get("use_sliding_window"):
        raise ValueError(f"{where}: use_sliding_window is not supported")
    # transformers 5 writes rope_parameters; 4.x wrote rope_theta and rope_scaling.
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    llama3 = None
    if rope_type == "llama3":
        llama3 = (float(rope["factor"]), float(rope["low_freq_factor"]),
                  float(rope["high_freq_factor"]), int(rope["original_max_position_embeddings"]))
    elif rope_type != "default":
        raise ValueError(f"{where}: rope type {rope_type!r} is not supported (default, llama3)")
    heads = raw["num_attention_heads"]
    hidden = raw["hidden_size"]
    model_type = ARCHITECTURES[arch]
    bias = bool(raw.get("attention_bias", False))
    cfg = ModelConfig(
        architecture=arch,
        vocab_size=raw["vocab_size"],
        hidden=hidden,
        intermediate=raw["intermediate_size"],
        layers=raw["num_hidden_layers"],
        heads=heads,
        kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or hidden // heads,
        max_seq_len=raw.get("max_position_embeddings", 2048),
        rms_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=True if model_type == "qwen2" else bias,
        o_bias=False if model_type == "qwen2" else bias,
        qk_norm=model_type == "qwen3",
        llama3_rope=llama3,
    )
    cfg.validate()
    return cfg


def read_config(model_dir: str | pathlib.Path) -> tuple[ModelConfig, dict]:
    """Reads DIR/config.json; returns the parsed config and the raw dict (kept for saving)."""
    path = pathlib.Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{model_dir}: no config.json: not a Hugging Face model folder") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    try:
        return parse_config(raw, str(path)), raw
    except KeyError as e:
        raise ValueError(f"{path}: missing field {e}") from None


def eos_ids(raw: dict) -> list[int]:
    """The eos_token_id of a config.json (an integer or a list) as a list."""
    eos = raw.get("eos_token_id")
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, list) else [int(eos)]
