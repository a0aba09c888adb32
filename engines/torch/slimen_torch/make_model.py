"""Randomly initialised Hugging Face model folders (no hub is reachable from the GPU machines).

`python -m slimen_torch make-model --shape NAME --out DIR` writes config.json, model.safetensors,
tokenizer.json, tokenizer_config.json (with a ChatML chat template) and generation_config.json.
The tokenizer is a byte-level BPE trained with the `tokenizers` library on synthetic arithmetic
text like the host's synthetic:arith tasks, so any text can be encoded and the common words of
those tasks are single tokens. Everything is a function of --seed.

`make-model --like DIR` takes instead DIR's tokenizer files as they are (tokenizer.json, its config
with the chat template) and, unless --shape is given too, DIR's config.json: a new random model that
reads and writes the same tokens, e.g. a larger model of builtin:tiny-chat's form
(`--like engines/tiny/builtin/tiny-chat --hidden 256 --layers 4`) or a Qwen3-shaped one with its
tokenizer and chat template (`--like engines/tiny/builtin/tiny-chat --shape qwen3-50m`). --hidden,
--intermediate, --layers, --heads, --kv-heads, --head-dim and --positions change the shape; a new
hidden size or head count without --head-dim gives head_dim = hidden / heads, and a new hidden size
without --intermediate keeps the MLP's ratio. The vocabulary and the special token ids stay DIR's.
"""

from __future__ import annotations

import json
import pathlib
import random
import shutil

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


# --like's size options → config.json fields.
SIZE_FIELDS = {"hidden": "hidden_size", "intermediate": "intermediate_size",
               "layers": "num_hidden_layers", "heads": "num_attention_heads",
               "kv_heads": "num_key_value_heads", "head_dim": "head_dim",
               "positions": "max_position_embeddings"}

# The tokenizer files --like copies (what tokenizer.Tokenizer reads).
LIKE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "chat_template.jinja", "generation_config.json")


def like_config(like: str | pathlib.Path, shape: str = "", **sizes: int) -> dict:
    """The config.json of a new model with the vocabulary of the model folder like: like's config
    (or, with shape, that shape's) with the sizes given (hidden=…, layers=…: SIZE_FIELDS)."""
    like = pathlib.Path(like)
    try:
        base = json.loads((like / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--like {like}: no readable config.json ({e})") from None
    unknown = set(sizes) - set(SIZE_FIELDS)
    if unknown:
        raise ValueError(f"unknown sizes {sorted(unknown)}; known: {', '.join(SIZE_FIELDS)}")
    for k, v in sizes.items():
        if v is not None and v <= 0:
            raise ValueError(f"--{k.replace('_', '-')} {v}: must be positive")
    vocab = base.get("vocab_size")
    if not isinstance(vocab, int) or vocab <= 0:
        raise ValueError(f"--like {like}: config.json has no vocab_size")
    if shape:
        if shape not in SHAPES:
            raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
        raw = config_dict(shape, vocab, base.get("eos_token_id"), base.get("pad_token_id"),
                          "float32")
        raw["vocab_size"] = vocab  # the like folder's vocabulary, not the shape's own
    else:
        raw = dict(base)
    old_hidden, old_mlp = raw["hidden_size"], raw["intermediate_size"]
    for k, v in sizes.items():
        if v is not None:
            raw[SIZE_FIELDS[k]] = v
    if sizes.get("head_dim") is None and (sizes.get("hidden") or sizes.get("heads")):
        raw["head_dim"] = raw["hidden_size"] // raw["num_attention_heads"]
    if sizes.get("intermediate") is None and sizes.get("hidden"):
        raw["intermediate_size"] = round(raw["hidden_size"] * old_mlp / old_hidden)
    if sizes.get("heads") and not sizes.get("kv_heads") and \
            raw["num_attention_heads"] % raw["num_key_value_heads"]:
        raw["num_key_value_heads"] = raw["num_attention_heads"]
    raw["dtype"] = "float32"
    raw.pop("torch_dtype", None)
    return raw


def make_like(like: str | pathlib.Path, out: str | pathlib.Path, shape: str = "", seed: int = 0,
              dtype: str = "", **sizes: int) -> pathlib.Path:
    """A random model folder with like's tokenizer files and like_config's config."""
    like, out = pathlib.Path(like), pathlib.Path(out)
    raw = like_config(like, shape, **sizes)
    cfg = parse_config(raw, f"the config made --like {like}")
    if not (like / "tokenizer.json").is_file():
        raise ValueError(f"--like {like}: no tokenizer.json")
    dtype = dtype or ("float32" if cfg.params() < 100_000_000 else "bfloat16")
    raw["dtype"] = dtype
    out.mkdir(parents=True, exist_ok=True)
    model = Transformer(cfg, dtype=torch.float32)
    model.init_weights(torch.Generator().manual_seed(seed))
    save_weights(model, out, dtype={"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype])
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    for name in LIKE_FILES:
        if (like / name).is_file():
            shutil.copyfile(like / name, out / name)
    if sizes.get("positions"):
        tc = out / "tokenizer_config.json"
        if tc.is_file():
            t = json.loads(tc.read_text())
            t["model_max_length"] = sizes["positions"]
            tc.write_text(json.dumps(t, indent=2) + "\n")
    return out
