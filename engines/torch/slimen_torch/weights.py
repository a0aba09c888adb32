"""Hugging Face checkpoint names ↔ the fused parameters of model.Transformer.

A checkpoint is model.safetensors or shards listed in model.safetensors.index.json. Reading fills
the fused matrices (q/k/v, gate/up) from their parts; writing splits them again, so a saved folder
is an ordinary checkpoint that transformers loads.
"""

from __future__ import annotations

import json
import pathlib

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .model import Transformer

# Our per-layer parameter → the checkpoint tensors it is the concatenation of (along dim 0).
_LAYER_PARTS = {
    "attn_norm": ["input_layernorm.weight"],
    "wqkv": ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
    "bqkv": ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"],
    "q_norm": ["self_attn.q_norm.weight"],
    "k_norm": ["self_attn.k_norm.weight"],
    "wo": ["self_attn.o_proj.weight"],
    "bo": ["self_attn.o_proj.bias"],
    "mlp_norm": ["post_attention_layernorm.weight"],
    "w13": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
    "w2": ["mlp.down_proj.weight"],
}

# Checkpoint tensors that carry no weights of their own.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _parts(model: Transformer):
    """Yields (parameter, [checkpoint names], [row counts]) for every parameter."""
    cfg = model.cfg
    yield model.embed, ["model.embed_tokens.weight"], None
    yield model.norm, ["model.norm.weight"], None
    if model.lm_head is not None:
        yield model.lm_head, ["lm_head.weight"], None
    if model.score is not None:
        yield model.score, ["score.weight"], None
        yield model.score_bias, ["score.bias"], None
    splits = {"wqkv": [cfg.q_dim, cfg.kv_dim, cfg.kv_dim], "bqkv": [cfg.q_dim, cfg.kv_dim, cfg.kv_dim],
              "w13": [cfg.intermediate, cfg.intermediate]}
    for i, layer in enumerate(model.layers):
        for attr, names in _LAYER_PARTS.items():
            p = getattr(layer, attr)
            if p is not None:
                yield p, [f"model.layers.{i}.{n}" for n in names], splits.get(attr)


def _files(model_dir: pathlib.Path) -> list[pathlib.Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    raise ValueError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")


def load_weights(model: Transformer, model_dir: str | pathlib.Path) -> None:
    """Copies the checkpoint in model_dir into model's parameters (converting the dtype)."""
    model_dir = pathlib.Path(model_dir)
    handles = {}
    where = {}
    for f in _files(model_dir):
        h = safe_open(str(f), framework="pt")
        handles[f] = h
        for k in h.keys():
            where[k] = h
    if "score.weight" in where and model.score is None:
        model.add_value_head()  # a critic's checkpoint
    used = set()
    with torch.no_grad():
        for p, names, _ in _parts(model):
            missing = [n for n in names if n not in where]
            if missing and names[0].startswith("score."):
                p.zero_()  # a plain language model loaded into a critic: a fresh value head
                continue
            if missing:
                raise ValueError(f"{model_dir}: checkpoint has no tensor {missing[0]}")
            parts = [where[n].get_tensor(n) for n in names]
            t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"{model_dir}: {names[0]} has shape {tuple(parts[0].shape)}, "
                                 f"config.json implies {tuple(p.shape)} for {len(names)} part(s)")
            p.copy_(t)
            used.update(names)
    extra = [k for k in where if k not in used and not k.endswith(_IGNORED_SUFFIXES)
             and not (k == "lm_head.weight" and model.lm_head is None)]
    if extra:
        raise ValueError(f"{model_dir}: checkpoint tensors the config does not explain: "
                         f"{', '.join(sorted(extra)[:5])}")


def hf_state_dict(model: Transformer, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The model's weights under checkpoint names, unfused, on the CPU."""
    out = {}
    for p, names, splits in _parts(model):
        t = p.detach().to("cpu", dtype or p.dtype)
        pieces = [t] if splits is None else t.split(splits, dim=0)
        for n, piece in zip(names, pieces):
            out[n] = piece.contiguous()
    return out


def save_weights(model: Transformer, model_dir: str | pathlib.Path,
                 dtype: torch.dtype | None = None) -> None:
    path = pathlib.Path(model_dir) / "model.safetensors"
    save_file(hf_state_dict(model, dtype), str(path), metadata={"format": "pt"})
