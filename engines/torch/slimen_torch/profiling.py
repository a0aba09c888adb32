"""SLIMEN_TORCH_PROFILE=DIR[:K]: torch.profiler over one step of a worker's run, for finding
where a step's time goes (multi_gpu.sh's PROFILE=1 sets it). The window opens when the worker's
training call K-1 ends (K defaults to 3: compiling and warm-up are over) and closes when call K
ends, so it holds step K's rollouts (the generate requests between the two calls) and its
training call, marked `slimen.train`. Each rank (torchrun's RANK) writes into DIR:

* rank{R}-step{K}.txt: the window's and the training call's wall seconds, then the operations
  by self device time and by self CPU time (a collective's wait shows as device time of its
  kernel; the Python of the threads as CPU time of the operations they launch);
* rank{R}-step{K}.json.gz: the Chrome trace (chrome://tracing, ui.perfetto.dev), for the
  timeline: a device idle between two decode steps is a host that did not keep up.
"""

from __future__ import annotations

import contextlib
import gzip
import logging
import os
import pathlib
import shutil
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

log = logging.getLogger("slimen_torch")

ENV = "SLIMEN_TORCH_PROFILE"


def parse(value: str) -> tuple[pathlib.Path, int] | None:
    """DIR[:K] → (DIR, K); None when unset. K must be at least 2 (the window opens when call
    K-1 ends)."""
    if not value:
        return None
    folder, sep, k = value.rpartition(":")
    if not sep or not k.isdigit():
        folder, k = value, "3"
    if int(k) < 2:
        raise ValueError(f"{ENV}={value}: the step must be at least 2 (the window opens when "
                         "the training call before it ends)")
    return pathlib.Path(folder), int(k)


class StepProfiler:
    """Counts a worker's training calls and profiles the window of call K (module docstring)."""

    def __init__(self, value: str | None = None, rank: int | None = None):
        cfg = parse(os.environ.get(ENV, "") if value is None else value)
        self.folder, self.k = cfg if cfg else (None, 0)
        self.rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        self.calls = 0
        self.prof = None
        self.opened = 0.0
        self.train_s = 0.0

    @contextlib.contextmanager
    def train(self):
        """Wraps one training call."""
        if self.folder is None:
            yield
            return
        t = time.perf_counter()
        with torch.profiler.record_function("slimen.train"):
            yield
        self.calls += 1
        if self.calls == self.k - 1:
            self._open()
        elif self.calls == self.k and self.prof is not None:
            self.train_s = time.perf_counter() - t
            self._close()

    def _open(self) -> None:
        acts = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        # Every thread: generation and the calls run on the engine's thread, the gRPC handlers
        # and a group's links on others.
        every = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
        self.prof = torch.profiler.profile(activities=acts, experimental_config=every,
                                           acc_events=True)
        self.prof.__enter__()
        self.opened = time.perf_counter()

    def _close(self) -> None:
        prof, self.prof = self.prof, None
        window = time.perf_counter() - self.opened
        prof.__exit__(None, None, None)
        self.folder.mkdir(parents=True, exist_ok=True)
        stem = self.folder / f"rank{self.rank}-step{self.k}"
        ka = prof.key_averages()
        device_key = "self_device_time_total"
        lines = [f"rank {self.rank}, step {self.k}: window {window:.3f} s (its rollouts and its "
                 f"training call), the training call {self.train_s:.3f} s", "",
                 "by self device time:",
                 ka.table(sort_by=device_key, row_limit=30, max_name_column_width=70), "",
                 "by self CPU time:",
                 ka.table(sort_by="self_cpu_time_total", row_limit=30,
                          max_name_column_width=70)]
        stem.with_suffix(".txt").write_text("\n".join(lines) + "\n")
        raw = stem.with_suffix(".json")
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()
        log.info("profiled step %d: %s.txt", self.k, stem)


class OpCount(TorchDispatchMode):
    """Counts the tensor operations dispatched inside it (n), for tests and benches that check
    how much work a step launches: `with OpCount() as c: step()`, then c.n."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))

