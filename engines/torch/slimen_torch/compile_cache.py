"""torch.compile's caches kept across worker processes, so that a new run of a model seen before
does not compile its decode and training layers from scratch.

Inductor already caches compiled graphs (its FX graph cache, AOTAutograd's cache, the autotuning
results) and Triton its kernels on disk, but by default in /tmp/torchinductor_USER and
~/.triton/cache, unkeyed and gone with /tmp. setup() points both at one folder of the user's
cache, ~/.cache/slimen/torch-compile/KEY (or $XDG_CACHE_HOME/slimen/…, or
$SLIMEN_COMPILE_CACHE/KEY), where KEY hashes what a compiled kernel depends on beyond its own
graph: the torch, Triton and CUDA versions, the GPU and its compute capability, and the source of
slimen_torch. A new torch or Triton, another GPU or a changed model or kernel file therefore
starts a new folder instead of reading an entry written for something else (the compilers' own
keys would catch most of that too; the folder key makes it certain and keeps the folders apart).

SLIMEN_COMPILE_CACHE=off leaves torch's defaults alone, as does a TORCHINDUCTOR_CACHE_DIR the
user set. Folders of other keys unused for PRUNE_DAYS are removed when a worker starts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import shutil
import time

import torch

log = logging.getLogger("slimen_torch")

ENV = "SLIMEN_COMPILE_CACHE"
MARKER = ".slimen-compile-cache"  # in each key folder: its fingerprint; its mtime is last use
OURS = "SLIMEN_COMPILE_CACHE_IN_USE"  # the folder setup chose, to tell it from a user's setting
PRUNE_DAYS = 30
PACKAGE = pathlib.Path(__file__).resolve().parent


@dataclasses.dataclass
class Status:
    path: str = ""  # the folder in use; "" when the cache is not slimen's (off, or the user's)
    warm: bool = False  # the folder held entries from an earlier process
    files: int = 0  # files in it when the worker started
    bytes: int = 0
    note: str = ""  # why it is not ours, or where it came from

    def line(self) -> str:
        """The phrase of the worker's start-up line."""
        if not self.path:
            return f"compile cache: {self.note}"
        if self.warm:
            return (f"compile cache warm (hit: {self.files} files, {self.bytes / 2**20:.0f} MiB "
                    f"from earlier runs) in {self.path}")
        return f"compile cache cold (nothing yet for this key) in {self.path}"


def source_hash(package: pathlib.Path = PACKAGE) -> str:
    """sha256 over the names and bytes of the package's Python files (the model, kernels and
    training code that torch.compile and Triton compile)."""
    h = hashlib.sha256()
    for f in sorted(package.rglob("*.py")):
        h.update(str(f.relative_to(package)).encode() + b"\0")
        h.update(f.read_bytes() + b"\0")
    return h.hexdigest()


def _triton_version() -> str:
    try:
        import triton
        return triton.__version__
    except Exception:  # no Triton (CPU builds): part of the key all the same
        return ""


def fingerprint(device: torch.device | str, package: pathlib.Path = PACKAGE) -> dict:
    """What a compiled kernel depends on besides its graph."""
    device = torch.device(device)
    fp = {"torch": torch.__version__, "triton": _triton_version(),
          "cuda": torch.version.cuda or "", "hip": getattr(torch.version, "hip", None) or "",
          "device": device.type, "source": source_hash(package)}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        fp["gpu"] = p.name
        fp["capability"] = f"{p.major}.{p.minor}"
        fp["multiprocessors"] = p.multi_processor_count
    return fp


def key(fp: dict) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:20]


def root(environ=os.environ) -> pathlib.Path:
    if environ.get(ENV):
        return pathlib.Path(environ[ENV]).expanduser()
    base = environ.get("XDG_CACHE_HOME") or str(pathlib.Path.home() / ".cache")
    return pathlib.Path(base) / "slimen" / "torch-compile"


def _size(folder: pathlib.Path) -> tuple[int, int]:
    files = size = 0
    for dirpath, _, names in os.walk(folder):
        for n in names:
            if n == MARKER:
                continue
            try:
                size += os.lstat(os.path.join(dirpath, n)).st_size
                files += 1
            except OSError:  # removed meanwhile by another worker's compiler
                pass
    return files, size


def prune(base: pathlib.Path, keep: pathlib.Path, days: float = PRUNE_DAYS) -> list[str]:
    """Removes key folders of base other than keep whose marker is older than days; only folders
    that carry a marker (that this module made)."""
    gone = []
    limit = time.time() - days * 86400
    for d in base.iterdir() if base.is_dir() else ():
        m = d / MARKER
        if d == keep or not m.is_file():
            continue
        try:
            if m.stat().st_mtime < limit:
                shutil.rmtree(d)
                gone.append(d.name)
        except OSError as e:
            log.warning("compile cache: cannot remove the unused %s: %s", d, e)
    return gone


def setup(device: torch.device | str, environ=os.environ,
          package: pathlib.Path = PACKAGE) -> Status:
    """Points inductor's and Triton's caches at the keyed folder (environ: TORCHINDUCTOR_CACHE_DIR
    and TRITON_CACHE_DIR, which both read when they compile, so this must run before the first
    compile of the process). Idempotent; returns what the folder held."""
    mode = environ.get(ENV, "")
    if mode == "off":
        return Status(note=f"torch's defaults ({ENV}=off)")
    ours = environ.get(OURS, "")  # set by an earlier setup (this process or its parent)
    user_dir = environ.get("TORCHINDUCTOR_CACHE_DIR")
    if user_dir and user_dir != ours:
        return Status(note=f"TORCHINDUCTOR_CACHE_DIR={user_dir} (set by the user)")
    fp = fingerprint(device, package)
    base = root(environ)
    folder = base / key(fp)
    marker = folder / MARKER
    warm = marker.is_file()
    files, size = _size(folder) if warm else (0, 0)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        marker.write_text(json.dumps(fp, indent=1, sort_keys=True) + "\n")  # also: last used
    except OSError as e:
        return Status(note=f"torch's defaults ({folder} is not writable: {e})")
    environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    triton_dir = environ.get("TRITON_CACHE_DIR")
    if not triton_dir or (ours and triton_dir == str(pathlib.Path(ours) / "triton")):
        environ["TRITON_CACHE_DIR"] = str(folder / "triton")
    environ[OURS] = str(folder)
    gone = prune(base, folder)
    if gone:
        log.info("compile cache: removed %d folders unused for %d days", len(gone), PRUNE_DAYS)
    return Status(path=str(folder), warm=warm and files > 0, files=files, bytes=size)


def counts() -> dict[str, int]:
    """This process's cache hits and misses so far (inductor's FX graphs, AOTAutograd)."""
    from torch._dynamo.utils import counters
    out = {}
    for group, prefix, name in (("inductor", "fxgraph_cache_", "fx graph"),
                                ("aot_autograd", "autograd_cache_", "AOTAutograd")):
        for what in ("hit", "miss", "bypass"):
            out[f"{name} {what}"] = int(counters[group][prefix + what])
    return out


def counts_line() -> str:
    c = counts()
    return ", ".join(f"{n} {c[n + ' hit']} hit / {c[n + ' miss']} miss / {c[n + ' bypass']} bypass"
                     for n in ("fx graph", "AOTAutograd"))
