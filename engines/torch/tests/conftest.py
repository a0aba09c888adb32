"""Shared fixtures: tiny random model folders (made once per session) and CPU engines."""

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import threading

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


def _patch_triton_language_once():
    """Triton's interpreter replaces triton.language's builtins by interpreted ones at every kernel
    launch and every call of a @triton.jit helper inside a kernel (tl.sum, tl.max, ... each
    program instance), and puts them back after a launch: inspect.getmembers over the language's
    modules each time, a sixth of an interpreted test's time. Here the replacement is made once
    per module set and kept. Nothing outside a kernel uses the builtins in this process (the
    sm_90 compiles run in a child without TRITON_INTERPRET), the interpreter already leaves
    tl.core replaced after a helper's call, and it no longer swaps them while another thread's
    kernel runs. The replacement is made again if a module (kernels.py) changes how it is made."""
    try:
        import inspect

        import triton.language as tl
        from triton.runtime import interpreter as ti

        patch_lang, scope = ti._patch_lang, ti._LangPatchScope
    except (ImportError, AttributeError):  # pragma: no cover - no Triton, or another version
        return
    helpers = ("_patch_builtin", "_patch_lang_tensor", "_patch_lang_core", "_patch_reduce_scan")
    done = {"langs": set(), "helpers": None}

    def _patch_lang(fn):
        langs = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}
        now = tuple(getattr(ti, h, None) for h in helpers)
        if now != done["helpers"]:
            done["langs"], done["helpers"] = set(), now
        if not langs or not langs <= done["langs"]:
            patch_lang(fn)  # the interpreter's own, which asserts tl is visible from fn
            done["langs"] |= langs
        return scope()  # nothing to restore

    ti._patch_lang = _patch_lang


def _cache_triton_interpreter_types():
    """The interpreter builds a dict of NumPy dtypes at every _get_np_dtype call and a new
    block_type at every get_block_ty: a few hundred thousand times in a test through a model's
    layers (a third of its time: test_the_layer_in_one_node_is_the_layer). Both depend on their arguments alone (a block_type is
    not changed after it is made), so they are kept here: the same dict, the same block_type
    for a dtype and a shape of ints (anything else is made as before)."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter as ti

        get_np_dtype, builder = ti._get_np_dtype, ti.InterpreterBuilder
        get_block_ty = builder.get_block_ty
    except (ImportError, AttributeError):  # pragma: no cover - no Triton, or another version
        return
    np_dtypes, block_types = {}, {}

    def _get_np_dtype(tt_dtype):
        # A block's is its element's; pointers' (not hashable) are made as before.
        if isinstance(tt_dtype, tl.block_type):
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, tl.pointer_type):
            return get_np_dtype(tt_dtype)
        d = np_dtypes.get(tt_dtype)
        if d is None:
            np_dtypes[tt_dtype] = d = get_np_dtype(tt_dtype)
        return d

    def _key(d):  # what dtype.__eq__ and pointer_type.__eq__ compare
        if type(d) is tl.dtype:
            return d.name
        if type(d) is tl.pointer_type:
            k = _key(d.element_ty)
            return k and ("pointer", k, d.address_space, d.const)
        return None

    def _get_block_ty(self, dtype, shape):
        k = _key(dtype)
        if k is None or not all(type(n) is int for n in shape):
            return get_block_ty(self, dtype, shape)
        key = (k, tuple(shape))
        t = block_types.get(key)
        if t is None:
            block_types[key] = t = get_block_ty(self, dtype, shape)
        return t

    ti._get_np_dtype = _get_np_dtype
    builder.get_block_ty = _get_block_ty


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_triton_language_once()
    _cache_triton_interpreter_types()

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


@pytest.fixture(scope="session")
def slimen(tmp_path_factory):
    """The slimen binary, built once for the tests that run it."""
    go = shutil.which("go")
    if go is None:
        pytest.skip("Go is not installed: the slimen binary cannot be built for this test")
    binary = tmp_path_factory.mktemp("bin") / "slimen"
    subprocess.run([go, "build", "-o", str(binary), "./cmd/slimen"], cwd=REPO, check=True)
    return binary


def start_serve(binary, key, *args):
    """Starts `slimen serve ARGS --openai` with bearer token key; returns the process and the
    API's base URL. The server's log is drained in the background, so it never blocks on a full
    pipe."""
    proc = subprocess.Popen([str(binary), "serve", *args, "--listen", "127.0.0.1:0", "--openai", "127.0.0.1:0",
                             "--token-env", "SLIMEN_TEST_KEY"],
                            env=dict(os.environ, SLIMEN_TEST_KEY=key), stderr=subprocess.PIPE, text=True)
    url, lines = None, []
    for line in proc.stderr:  # the address is in the log line that says the API is up
        lines.append(line)
        m = re.search(r"serving the OpenAI API at (http://\S+)", line)
        if m:
            url = m.group(1)
            break
    assert url, "slimen serve did not announce the OpenAI API:\n" + "".join(lines)
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
    return proc, url
