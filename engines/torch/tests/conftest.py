"""Shared fixtures: tiny random model folders (made once per session) and CPU engines."""

import json
import os
import pathlib
import shutil
import sys

import pytest
import torch

# The Triton kernels run on the CPU under Triton's interpreter (tests/test_kernels.py); it must be
# chosen before kernels.py is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The package is used from the source tree (no install needed).
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from slimen_torch.engine import Engine, Options  # noqa: E402
from slimen_torch.make_model import make_model  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[3]

# CI machines are small and shared: a tiny model gains nothing from more threads.
torch.set_num_threads(2)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """shape → folder of a random model: tiny (Llama), tiny-qwen3, tiny-qwen2."""
    root = tmp_path_factory.mktemp("models")
    return {s: make_model(s, root / s, seed=7) for s in ("tiny", "tiny-qwen3", "tiny-qwen2")}


@pytest.fixture(scope="session")
def noeos_dir(model_dirs, tmp_path_factory):
    """The tiny Qwen3 model with no end-of-sequence token: responses end by length only, so tests
    about scheduling know how long every response is."""
    d = tmp_path_factory.mktemp("noeos") / "m"
    shutil.copytree(model_dirs["tiny-qwen3"], d)
    for name, key in (("config.json", "eos_token_id"), ("generation_config.json", "eos_token_id"),
                      ("tokenizer_config.json", "eos_token")):
        raw = json.loads((d / name).read_text())
        raw[key] = None
        (d / name).write_text(json.dumps(raw))
    return d


@pytest.fixture(scope="module")
def engine(model_dirs):
    e = Engine(str(model_dirs["tiny-qwen3"]), Options(device="cpu"))
    yield e
    e.close()
