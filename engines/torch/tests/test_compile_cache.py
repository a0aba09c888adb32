"""The compiler caches' folder: keyed by torch, Triton, GPU and source, warm only with entries,
never taking over a folder the user chose (compile_cache.py). CPU only: the GPU's properties are
faked; the GPU measurement is bench.py's first_step section."""

import collections
import os
import pathlib
import shutil
import time

import torch

from slimen_torch import compile_cache as C

Props = collections.namedtuple("Props", "name major minor multi_processor_count")
H200 = Props("NVIDIA H200", 9, 0, 132)


def fake_gpu(monkeypatch, props=H200):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)


def package_copy(tmp_path) -> pathlib.Path:
    dst = tmp_path / "pkg"
    shutil.copytree(C.PACKAGE, dst, ignore=shutil.ignore_patterns("__pycache__"))
    return dst


def test_key_changes_with_torch_triton_gpu_and_source(monkeypatch, tmp_path):
    fake_gpu(monkeypatch)
    pkg = package_copy(tmp_path)
    base = C.key(C.fingerprint("cuda:0", pkg))
    assert C.key(C.fingerprint("cuda:0", pkg)) == base  # stable within a setting
    assert C.fingerprint("cuda:0", pkg)["gpu"] == "NVIDIA H200"

    monkeypatch.setattr(torch, "__version__", "99.0.0")
    assert C.key(C.fingerprint("cuda:0", pkg)) != base
    monkeypatch.undo()
    fake_gpu(monkeypatch)

    monkeypatch.setattr(C, "_triton_version", lambda: "99.1")
    assert C.key(C.fingerprint("cuda:0", pkg)) != base
    monkeypatch.undo()

    fake_gpu(monkeypatch, Props("NVIDIA H100 80GB HBM3", 9, 0, 132))
    assert C.key(C.fingerprint("cuda:0", pkg)) != base
    fake_gpu(monkeypatch, H200._replace(major=10))
    assert C.key(C.fingerprint("cuda:0", pkg)) != base
    fake_gpu(monkeypatch)
    assert C.key(C.fingerprint("cpu", pkg)) != base

    # A changed kernel or model source, and a new source file, each give a new key.
    kernels = pkg / "kernels.py"
    kernels.write_text(kernels.read_text() + "\n# changed\n")
    k1 = C.key(C.fingerprint("cuda:0", pkg))
    assert k1 != base
    (pkg / "extra.py").write_text("X = 1\n")
    assert C.key(C.fingerprint("cuda:0", pkg)) not in (base, k1)


def test_setup_points_the_compilers_at_the_keyed_folder(monkeypatch, tmp_path):
    fake_gpu(monkeypatch)
    pkg = package_copy(tmp_path)
    env = {C.ENV: str(tmp_path / "cache")}
    st = C.setup("cuda:0", env, pkg)
    folder = tmp_path / "cache" / C.key(C.fingerprint("cuda:0", pkg))
    assert st.path == str(folder) and not st.warm
    assert "cold" in st.line()
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(folder)
    assert env["TRITON_CACHE_DIR"] == str(folder / "triton")
    assert (folder / C.MARKER).is_file()

    # A process that compiled nothing leaves the folder cold.
    assert not C.setup("cuda:0", {C.ENV: str(tmp_path / "cache")}, pkg).warm

    # Entries written, a new process (a fresh environment) finds them: warm.
    (folder / "fxgraph").mkdir()
    (folder / "fxgraph" / "entry").write_bytes(b"x" * 1000)
    env2 = {C.ENV: str(tmp_path / "cache")}
    st2 = C.setup("cuda:0", env2, pkg)
    assert st2.warm and st2.files == 1 and st2.bytes == 1000 and st2.path == str(folder)
    assert "warm (hit" in st2.line()

    # Again in the same process (an engine rebuilt), or in a child that inherited the variables:
    # still slimen's folder, not mistaken for the user's.
    assert C.setup("cuda:0", env2, pkg).path == str(folder)
    assert C.setup("cuda:0", dict(env2), pkg).path == str(folder)

    # A changed source: another folder, cold, and the variables follow it.
    (pkg / "model.py").write_text((pkg / "model.py").read_text() + "\n# changed\n")
    st3 = C.setup("cuda:0", env2, pkg)
    assert st3.path != str(folder) and not st3.warm
    assert env2["TORCHINDUCTOR_CACHE_DIR"] == st3.path
    assert env2["TRITON_CACHE_DIR"] == str(pathlib.Path(st3.path) / "triton")


def test_setup_leaves_the_users_choice_alone(monkeypatch, tmp_path):
    fake_gpu(monkeypatch)
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "mine"), C.ENV: str(tmp_path / "c")}
    st = C.setup("cuda:0", env, C.PACKAGE)
    assert st.path == "" and "set by the user" in st.line()
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
    assert "TRITON_CACHE_DIR" not in env and not (tmp_path / "c").exists()

    env = {C.ENV: "off"}
    st = C.setup("cuda:0", env, C.PACKAGE)
    assert st.path == "" and "off" in st.line() and "TORCHINDUCTOR_CACHE_DIR" not in env

    # A Triton folder the user chose stays; inductor's still moves to the keyed folder.
    env = {C.ENV: str(tmp_path / "c"), "TRITON_CACHE_DIR": str(tmp_path / "tri")}
    st = C.setup("cuda:0", env, C.PACKAGE)
    assert env["TRITON_CACHE_DIR"] == str(tmp_path / "tri")
    assert env["TORCHINDUCTOR_CACHE_DIR"] == st.path


def test_default_root_is_the_users_cache_folder(tmp_path):
    assert C.root({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "slimen" / "torch-compile"
    assert C.root({}) == pathlib.Path.home() / ".cache" / "slimen" / "torch-compile"
    assert C.root({C.ENV: str(tmp_path / "x")}) == tmp_path / "x"


def test_prune_removes_only_old_folders_of_ours(tmp_path):
    base = tmp_path / "cache"
    keep, old, recent, foreign = (base / n for n in ("keep", "old", "recent", "foreign"))
    for d in (keep, old, recent, foreign):
        d.mkdir(parents=True)
        (d / "entry").write_text("x")
    for d in (keep, old, recent):
        (d / C.MARKER).write_text("{}")
    long_ago = time.time() - (C.PRUNE_DAYS + 1) * 86400
    os.utime(old / C.MARKER, (long_ago, long_ago))
    os.utime(keep / C.MARKER, (long_ago, long_ago))
    os.utime(foreign / "entry", (long_ago, long_ago))
    assert C.prune(base, keep) == ["old"]
    assert sorted(p.name for p in base.iterdir()) == ["foreign", "keep", "recent"]


def test_counts_read_the_compilers_counters():
    from torch._dynamo.utils import counters
    before = C.counts()
    counters["inductor"]["fxgraph_cache_hit"] += 2
    counters["aot_autograd"]["autograd_cache_miss"] += 1
    try:
        after = C.counts()
        assert after["fx graph hit"] == before["fx graph hit"] + 2
        assert after["AOTAutograd miss"] == before["AOTAutograd miss"] + 1
        assert f"fx graph {after['fx graph hit']} hit" in C.counts_line()
    finally:
        counters["inductor"]["fxgraph_cache_hit"] -= 2
        counters["aot_autograd"]["autograd_cache_miss"] -= 1
