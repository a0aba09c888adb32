"""Weights versions (engines.Versions in Go): read-only copies of the weights that rollouts sample
from while the trainer steps its own, for the asynchronous loop (docs/async.md).

KeepVersion copies the trainer's parameters (in the generator's dtype) into a kept slot on the
same device: one torch.Tensor.copy_ per parameter, into buffers allocated for the slot. Versioned
generation and scoring run on a rollout model (the same architecture, its own parameters, never
the trainer's storage) with its own Generator, KV cache and CUDA stream, driven by its own thread,
so that they run while the engine's worker thread trains. Before a round of version v the rollout
model takes v's kept tensors (again a device copy into the same storage, so the rollout
generator's captured graphs stay valid); requests of different versions never share a decode
batch: the rollout thread drains one version's requests before it switches to the next.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time

import torch

from . import batch_invariant
from .generate import Generator, Request
from .model import Transformer, bind_thread, copy_tensors
from .types import RequestError

log = logging.getLogger("slimen_torch")


def _timed_copy(dst: list[torch.Tensor], src: list[torch.Tensor], device: torch.device) -> float:
    """copy_tensors on the current stream, waited for; returns its seconds (CUDA events on a GPU:
    the copy alone, not the work other streams have queued)."""
    if device.type != "cuda":
        t = time.perf_counter()
        copy_tensors(dst, src)
        return time.perf_counter() - t
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    copy_tensors(dst, src)
    end.record()
    end.synchronize()  # the rollout thread reads the buffers on its own stream once keep returns
    return start.elapsed_time(end) / 1e3


class Versions:
    """The kept versions of one engine and the rollout model that serves them."""

    def __init__(self, engine):
        self.eng = engine
        self.lock = threading.Lock()
        self.kept: dict[int, list[torch.Tensor]] = {}
        self.copied_bytes = 0  # KeepVersion copies so far: bytes and seconds
        self.copied_s = 0.0
        self.copies = 0
        self.rollout: _Rollout | None = None

    def names(self) -> list[str]:
        return self._rollout().names

    def _rollout(self) -> _Rollout:
        if self.rollout is None:
            self.rollout = _Rollout(self.eng, self)
        return self.rollout

    # ---- called on the engine's worker thread (no training runs meanwhile) ----

    def keep(self, v: int) -> dict:
        ro = self._rollout()
        src = dict(self.eng.model.named_parameters())
        with self.lock:
            bufs = self.kept.get(v)
        if bufs is None:
            bufs = [torch.empty_like(p, memory_format=torch.contiguous_format) for p in ro.params]
        d = _timed_copy(bufs, [src[n] for n in ro.names], self.eng.device)
        nbytes = sum(b.numel() * b.element_size() for b in bufs)
        with self.lock:
            self.kept[v] = bufs
            self.copied_bytes += nbytes
            self.copied_s += d
            self.copies += 1
        ro.forget(v)  # a version kept again (a resume) is copied into the rollout model again
        gb = nbytes / 1e9
        log.info("kept weights version %d: %.6g GB copied on %s in %.6f s (%.6f s/GB)",
                 v, gb, self.eng.device, d, d / max(gb, 1e-12))
        return dict(gb=gb, seconds=d)

    # ---- any thread ----

    def drop(self, below: int) -> None:
        with self.lock:
            for v in [v for v in self.kept if v < below]:
                del self.kept[v]

    def held(self) -> list[int]:
        with self.lock:
            return sorted(self.kept)

    def tensors(self, v: int) -> list[torch.Tensor]:
        with self.lock:
            bufs = self.kept.get(v)
        if bufs is None:
            raise RequestError("FAILED_PRECONDITION", f"weights version {v} is not kept by this "
                               f"worker (it keeps {self.held() or 'none'}); a worker that "
                               "restarted has lost its kept versions: resume the run from its "
                               "last checkpoint")
        return bufs

    def kept_bytes(self) -> int:
        with self.lock:
            return sum(b.numel() * b.element_size() for bufs in self.kept.values() for b in bufs)

    def submit(self, v: int, req: Request) -> None:
        self.tensors(v)  # refused at once when v is not kept
        self._rollout().put(v, ("req", req))

    def call(self, v: int, fn):
        """fn(rollout model) on the rollout thread, once the rollout model holds version v."""
        self.tensors(v)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._rollout().put(v, ("task", fn, fut))
        return fut.result()

    def close(self) -> None:
        if self.rollout is not None:
            self.rollout.close()

    def reset(self, message: str) -> None:
        """Another architecture was loaded: every kept version and the rollout model go."""
        with self.lock:
            self.kept.clear()
        if self.rollout is not None:
            self.rollout.close(message)
            self.rollout = None


class _Rollout:
    """The rollout model, its generator and the thread that drives them."""

    def __init__(self, eng, versions: Versions):
        self.vs = versions
        self.device = eng.device
        self.deterministic = eng.opts.deterministic
        model = Transformer(eng.cfg, device=eng.device, dtype=eng.dtype)
        self.model = model.eval().requires_grad_(False)
        self.names = [n for n, _ in self.model.named_parameters()]
        self.params = [p for _, p in self.model.named_parameters()]
        self.gen = eng.new_generator(self.model)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.holds: int | None = None  # the version in the rollout model's parameters
        self.cv = threading.Condition()
        self.queue: collections.deque = collections.deque()  # (version, item), in arrival order
        self.cancels: list[str] = []
        self.closed = ""
        self.thread = threading.Thread(target=self._loop, name="slimen-torch-rollout", daemon=True)
        self.thread.start()
        log.info("rollout model built for weights versions (%.3f GB on %s)",
                 sum(p.numel() * p.element_size() for p in self.params) / 1e9, self.device)

    def put(self, v: int, item) -> None:
        with self.cv:
            if self.closed:
                raise RuntimeError(self.closed)
            self.queue.append((v, item))
            self.cv.notify()

    def cancel(self, rid: str) -> None:
        with self.cv:
            self.cancels.append(rid)
            self.cv.notify()

    def forget(self, v: int) -> None:
        with self.cv:
            self.cancels.append(("forget", v))
            self.cv.notify()

    def close(self, message: str = "engine closed") -> None:
        with self.cv:
            self.closed = message
            self.cv.notify()
        self.thread.join(timeout=30)

    # ---- the rollout thread ----

    def _loop(self) -> None:
        try:
            bind_thread(self.device)
            batch_invariant.set_enabled(self.deterministic)  # the engine's arithmetic mode
            if self.stream is not None:
                with torch.cuda.stream(self.stream):
                    self._run()
            else:
                self._run()
        except BaseException as e:  # a bug: what waits, and what comes later, fails with it
            log.exception("the rollout thread stopped")
            with self.cv:
                self.closed = f"the rollout thread stopped: {type(e).__name__}: {e}"
                queue = list(self.queue)
                self.queue.clear()
            for _, it in queue:
                self._refuse(it, "INTERNAL", self.closed)

    def _run(self) -> None:
        pending: collections.deque = collections.deque()
        while True:
            with self.cv:
                while not (self.closed or self.queue or self.cancels or self.gen.busy()
                           or pending):
                    self.cv.wait()
                if self.closed:
                    break
                pending.extend(self.queue)
                self.queue.clear()
                cancels, self.cancels = self.cancels, []
            for c in cancels:
                if isinstance(c, tuple):  # ("forget", v): v was kept again
                    if self.holds == c[1] and not self.gen.busy():
                        self.holds = None
                    continue
                self.gen.cancel(c)
                pending = collections.deque(
                    (v, it) for v, it in pending if not (it[0] == "req" and it[1].id == c))
            try:
                pending = self._admit(pending)
                if self.gen.busy():
                    self.gen.step()
            except Exception as e:
                log.exception("versioned generation failed")
                self.gen.fail_all(f"generation failed: {e}")
        self.gen.fail_all(self.closed)
        for _, it in list(pending) + list(self.queue):
            self._refuse(it, "INTERNAL", self.closed)

    def _admit(self, pending: collections.deque) -> collections.deque:
        """Starts the pending work of the version the rollout model holds; once the generator has
        drained, switches to the version asked for first. Work of the held version that arrives
        while another version waits stays behind it (no version starves)."""
        if not pending:
            return pending
        if self.holds is None or (not self.gen.busy() and pending[0][0] != self.holds):
            if self.gen.busy():
                return pending
            v = pending[0][0]
            try:
                self._switch(v)
            except RequestError as e:
                rest = collections.deque()
                for pv, it in pending:
                    if pv == v:
                        self._refuse(it, e.code, str(e))
                    else:
                        rest.append((pv, it))
                return rest
        other_waits = pending[0][0] != self.holds
        rest = collections.deque()
        for v, it in pending:
            if v != self.holds or (other_waits and self.gen.busy()):
                rest.append((v, it))
                other_waits = True
            elif it[0] == "req":
                self.gen.add(it[1])
            else:
                self.gen.flush()
                _, fn, fut = it
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn(self.model))
                    except BaseException as e:  # handed to the caller
                        fut.set_exception(e)
        return rest

    def _switch(self, v: int) -> None:
        bufs = self.vs.tensors(v)
        self.gen.flush()
        if self.gen.prefix_rows:  # kept prefix rows hold keys and values of the other weights
            self.gen.forget_prefixes()
        # On the rollout thread's stream, ordered before its next decode steps; the kept buffers
        # were written and waited for by keep. They may be dropped (freed) on another thread
        # while this copy is queued: record_stream keeps the allocator from reusing them first.
        copy_tensors(self.params, bufs)
        if self.stream is not None:
            for b in bufs:
                b.record_stream(self.stream)
        self.holds = v

    @staticmethod
    def _refuse(it, code: str, message: str) -> None:
        if it[0] == "req":
            r = it[1]
            if not r.cancelled and r.on_error is not None:
                r.cancelled = True
                r.on_error(code, message)
        else:
            fut = it[2]
            if fut.set_running_or_notify_cancel():
                fut.set_exception(RequestError(code, message))


__all__ = ["Versions"]
