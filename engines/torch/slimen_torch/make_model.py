"""Randomly initialised Hugging Face model folders (no hub is reachable from the GPU machines).

`python -m slimen_torch make-model --shape NAME --out DIR` writes config.json, model.safetensors,
tokenizer.json, tokenizer_config.json (with a ChatML chat template) and generation_config.json.
The tokenizer is a byte-level BPE trained with the `tokenizers` library on synthetic arithmetic
text like the host's synthetic:arith tasks, so any text can be encoded and the common words of
those tasks are single tokens. Everything is a function of --seed.
"""

from __future__ import annotations

import json
import pathlib
import random

import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from .config import parse_config
from .model import Transformer
from .weights import save_weights

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# name → (architecture, config fields, tokenizer vocabulary). vocab_size None: the tokenizer's.
SHAPES = {
    "tiny": ("LlamaForCausalLM", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=512, tie_word_embeddings=True,
                                      rope_theta=10000.0, vocab_size=None), 512),
    "tiny-qwen3": ("Qwen3ForCausalLM", dict(hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=2, num_attention_heads=4,
                                            num_key_value_heads=2, head_dim=16,
                                            max_position_embeddings=512, tie_word_embeddings=True,
                                            rope_theta=1e6, vocab_size=None), 512),
    "tiny-qwen2": ("Qwen2ForCausalLM", dict(hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=2, num_attention_heads=4,
                                            num_key_value_heads=2, head_dim=8,
                                            max_position_embeddings=512, tie_word_embeddings=False,
                                            rope_theta=1e6, vocab_size=None), 512),
    # About 55M parameters: the size of the end-to-end debate experiment on one GPU.
    "qwen3-50m": ("Qwen3ForCausalLM", dict(hidden_size=640, intermediate_size=1920,
                                           num_hidden_layers=10, num_attention_heads=10,
                                           num_key_value_heads=5, head_dim=64,
                                           max_position_embeddings=4096, tie_word_embeddings=True,
                                           rope_theta=1e6, vocab_size=None), 8192),
    # The shape of Qwen/Qwen3-0.6B (random weights, a small tokenizer inside its vocabulary).
    "qwen3-0.6b": ("Qwen3ForCausalLM", dict(hidden_size=1024, intermediate_size=3072,
                                            num_hidden_layers=28, num_attention_heads=16,
                                            num_key_value_heads=8, head_dim=128,
                                            max_position_embeddings=40960, tie_word_embeddings=True,
                                            rope_theta=1e6, vocab_size=151936), 8192),
}

_NAMES = ["Ann", "Bo", "Cy", "Di", "Ed", "Flo", "Gus", "Hal"]
_ITEMS = ["pens", "eggs", "cats", "cards", "coins", "books"]


def arith_problem(r: random.Random) -> tuple[str, str]:
    """An arithmetic word problem in the style of synthetic:arith and its \\boxed{} answer."""
    name, item = r.choice(_NAMES), r.choice(_ITEMS)
    x, y = r.randint(0, 99), r.randint(0, 99)
    op = r.choice("+-*")
    if op == "+":
        q, a = f"{name} has {x} {item} and gets {y} more.", x + y
    elif op == "-":
        x, y = max(x, y), min(x, y)
        q, a = f"{name} has {x} {item} and gives away {y}.", x - y
    else:
        x, y = r.randint(2, 9), r.randint(2, 9)
        q, a = f"{name} has {x} bags of {y} {item}.", x * y
    return f"{q} How many {item}?", f"\\boxed{{{a}}}"


def synthetic_corpus(n: int, seed: int) -> list[str]:
    r = random.Random(seed)
    out = []
    for _ in range(n):
        q, a = arith_problem(r)
        out.append(f"{IM_START}user\n{q}{IM_END}\n{IM_START}assistant\n{a}{IM_END}\n")
    return out


def train_tokenizer(vocab: int, seed: int) -> HFTokenizer:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[ENDOFTEXT, IM_START, IM_END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(synthetic_corpus(4000, seed), trainer=trainer)
    return tok


def config_dict(shape: str, vocab_size: int, eos: int, pad: int, dtype: str) -> dict:
    arch, fields, _ = SHAPES[shape]
    f = dict(fields)
    theta = f.pop("rope_theta")
    f["vocab_size"] = f["vocab_size"] or vocab_size
    model_type = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                  "Qwen3ForCausalLM": "qwen3"}[arch]
    return {
        "architectures": [arch], "model_type": model_type, **f, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "attention_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02,
        "bos_token_id": None, "eos_token_id": eos, "pad_token_id": pad, "dtype": dtype,
        "use_cache": True,
    }


def make_model(shape: str, out: str | pathlib.Path, seed: int = 0, dtype: str = "") -> pathlib.Path:
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(SHAPES[shape][2], seed)
    eos, pad = tok.token_to_id(IM_END), tok.token_to_id(ENDOFTEXT)
    # Vocabulary rows rounded up to a multiple of 8 (what real checkpoints do for fast kernels).
    vocab = -(-tok.get_vocab_size() // 8) * 8
    probe = config_dict(shape, vocab, eos, pad, "float32")
    cfg = parse_config(probe)
    dtype = dtype or ("float32" if cfg.params() < 100_000_000 else "bfloat16")
    raw = config_dict(shape, vocab, eos, pad, dtype)
    model = Transformer(cfg, dtype=torch.float32)
    model.init_weights(torch.Generator().manual_seed(seed))
    save_weights(model, out, dtype={"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype])
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
        "bos_token": None, "eos_token": IM_END, "pad_token": ENDOFTEXT, "unk_token": None,
        "model_max_length": cfg.max_seq_len, "clean_up_tokenization_spaces": False,
    }, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": None, "eos_token_id": [eos, pad], "pad_token_id": pad,
    }, indent=2) + "\n")
    return out
