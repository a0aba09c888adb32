"""Rank 0's funnel of a worker over several ranks (dist.py), on the CPU: the real gRPC server and
dist.Group over gloo, each rank's engine replaced by a fake one that decodes nothing.

    python engines/torch/bench_group.py [--ranks 1,2,4] [--per-rank 256] [--rounds 3]

For each rank count N it starts N processes (gloo; N = 1 is the one-rank worker: the server over
the engine, no Group), and a client in this process opens a Generate stream and sends N ×
--per-rank requests at once (chat messages, one sample of 128 tokens each, as multi_gpu.sh's
rollouts), --rounds times. The fake engine (FakeEngine) checks a request as the real one does
(Engine.check and Engine.request: the chat template, the tokenizer), lets it join its batch at the
next step and finishes it --steps steps of --step-ms later (sleeping, as a GPU's decode step
leaves the CPU free), with a completion of the real one's form (the tokens, their log-probs and
the decoded text). The table gives, for each N, the round of median wall time (the first, a warm-up, left
out):

* wall: the client's first send to its last completion, and how much of it is the funnel's
  (wall less the fake decode, --steps × --step-ms);
* when (ms from the first send): the last request reaches a rank's engine, the last completion
  leaves a rank's engine, the last completion reaches rank 0's server; and deals, the times rank
  0's group thread dealt requests out (each a broadcast to the followers);
* rank 0's CPU µs a request, split by thread: the stream reader (parse, check, queue), the group
  thread (deal, broadcast), the receivers of the followers' completions (receive, unpickle) and
  their callbacks (the response messages), rank 0's engine thread (its own share and its
  callbacks), the gRPC handler (response streaming), the rest (gRPC's own threads);
* a follower's (rank 1's) CPU µs a request of its own: its main thread (the broadcast received,
  its requests checked and submitted), its outbox (completions sent) and its engine thread.

On 2 shared cores the wall times are those of N + 1 processes taking turns; the CPU figures are
per thread and hold on any machine.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from slimen_torch.engine import Engine  # noqa: E402
from slimen_torch.types import Completion  # noqa: E402

PROMPT = ("Compute {a} + {b} * {c}. Show each step of the arithmetic on its own line, then give "
          "the final answer as a single number inside \\boxed{{}}.")


class FakeEngine(Engine):
    """An engine without a model: request() is the real one (the chat template, the tokenizer,
    the checks); a submitted request joins the batch at the next step and each of its samples
    finishes steps steps later with max_tokens tokens, their log-probs and their text."""

    keeps_versions = False

    def __init__(self, model_dir: str, steps: int, step_s: float):
        from types import SimpleNamespace

        from slimen_torch.config import read_config
        from slimen_torch.tokenizer import Tokenizer

        self.device = torch.device("cpu")
        self.cfg, _ = read_config(model_dir)
        self.tokenizer = Tokenizer(model_dir)
        self.gen = SimpleNamespace(L=512)  # multi_gpu.sh's --max-seq-len
        self.bank = SimpleNamespace(adapters={})
        self.steps, self.step_s = steps, step_s
        g = random.Random(0)
        self.pool = [g.randrange(self.cfg.vocab_size) for _ in range(1 << 14)]
        self.lp_pool = [-g.random() * 4 for _ in self.pool]
        self.marks = {"in": [], "out": []}  # monotonic times: requests taken, samples finished
        self._cv = threading.Condition()
        self._new: list = []
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="slimen-torch-worker",
                                        daemon=True)
        self._thread.start()

    def info(self) -> dict:
        return {"model": "fake"}

    def submit(self, req, on_completion, on_error=None) -> None:
        r = self.request(req, on_completion, on_error)
        with self._cv:
            self._new.append(r)
            self._cv.notify()

    def cancel(self, request_id: str) -> None:
        pass

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join()

    def _loop(self) -> None:
        running: list = []  # [request, steps left]
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._closed or self._new or running)
                if self._closed:
                    return
                new, self._new = self._new, []
            now = time.monotonic()
            self.marks["in"] += [now] * len(new)
            running += [[r, self.steps] for r in new]
            time.sleep(self.step_s)
            left = []
            for x in running:
                x[1] -= 1
                if x[1] > 0:
                    left.append(x)
                else:
                    self._finish(x[0])
            running = left

    def _finish(self, r) -> None:
        k = r.sampling.max_tokens
        for i in range(r.n):
            o = (r.sampling.seed * 7919 + i * 104729) % (len(self.pool) - k)
            toks, lps = self.pool[o:o + k], self.lp_pool[o:o + k]
            c = Completion(request_id=r.id, index=i, prompt_tokens=list(r.prompt), tokens=toks,
                           logprobs=lps, text=self.tokenizer.decode(toks),
                           finish_reason="length")
            self.marks["out"].append(time.monotonic())
            r.on_completion(c)


class Meter:
    """Thread CPU seconds spent in wrapped functions, by (label, thread name) (time.thread_time
    around each call, a label's own recursive calls counted once), and the time each label was
    last left."""

    def __init__(self):
        self.cpu: dict[tuple[str, str], float] = {}
        self.last: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.lock = threading.Lock()
        self.local = threading.local()

    def wrap(self, label: str, fn):
        def timed(*a, **k):
            inside = self.local.__dict__.setdefault("inside", set())
            if label in inside:
                return fn(*a, **k)
            inside.add(label)
            t = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                dt = time.thread_time() - t
                inside.discard(label)
                key = (label, threading.current_thread().name)
                with self.lock:
                    self.cpu[key] = self.cpu.get(key, 0.0) + dt
                    self.last[label] = time.monotonic()
                    self.calls[label] = self.calls.get(label, 0) + 1
        return timed


def thread_cpu() -> dict[str, float]:
    """CPU seconds of this process's Python threads by name, and "total" for the process."""
    out = {"total": time.process_time()}
    for t in threading.enumerate():
        try:
            out[t.name] = time.clock_gettime(time.pthread_getcpuclockid(t.ident))
        except (OSError, TypeError, ValueError):
            pass
    return out


def _rank(rank, size, port, model_dir, steps, step_s, ctl, res):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(size))
    torch.set_num_threads(1)
    from slimen_torch import dist, server

    meter = Meter()
    server.completion_pb = meter.wrap("response build", server.completion_pb)
    server._Generate.submit = meter.wrap("server submit", server._Generate.submit)
    server._Generate._deliver = meter.wrap("server deliver", server._Generate._deliver)
    FakeEngine.submit = meter.wrap("engine submit", FakeEngine.submit)
    dist.Group._send = meter.wrap("deal", dist.Group._send)
    # The stream's reader thread ends with its stream: its CPU is metered as it runs.
    shim = type(sys)("threading")
    shim.__dict__.update(vars(threading))

    def thread(*a, target=None, **k):
        return threading.Thread(*a, target=meter.wrap("thread", target), **k)

    shim.Thread = thread
    server.threading = shim
    links = None
    if size > 1:
        _, _, _, links = dist.init("cpu")
    eng = FakeEngine(model_dir, steps, step_s)

    def control():
        while ctl.get() == "snap":
            res.put((rank, {"cpu": thread_cpu(), "meter": dict(meter.cpu),
                            "last": dict(meter.last), "calls": dict(meter.calls),
                            "in": list(eng.marks["in"]), "out": list(eng.marks["out"])}))

    if rank != 0:
        threading.Thread(target=control, daemon=True).start()
        dist.follow(eng, links, rank)
        eng.close()
        torch.distributed.destroy_process_group()
        return
    srv, service, bound = server.make_server("127.0.0.1:0", roots=[tempfile.gettempdir()])
    service.engine = dist.Group(eng, links, ["cpu"] * size) if size > 1 else eng
    service.loading = False
    res.put(("port", bound))
    control()
    srv.stop(grace=None).wait()
    if size > 1:
        service.engine.close(timeout=30)
        torch.distributed.destroy_process_group()
    else:
        eng.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def client_round(stub, pb, k: int, n: int, max_tokens: int, per_msg: int) -> tuple:
    """Sends n requests on one Generate stream, per_msg a message; returns (first send, last
    completion), monotonic."""
    reqs = [pb.GenerateRequest(
        id=f"r{k}-{i}", n=1,
        messages=[pb.Message(role="user", content=PROMPT.format(a=i, b=3 * i + 7, c=i % 13))],
        sampling=pb.Sampling(max_tokens=max_tokens, temperature=1.0, top_p=1.0, seed=i))
        for i in range(n)]
    msgs = [pb.GenerateStreamRequest(requests=reqs[i:i + per_msg]) for i in range(0, n, per_msg)]
    got = 0
    t0 = time.monotonic()
    for resp in stub.Generate(iter(msgs)):
        got += len(resp.completions)
        if resp.errors:
            raise RuntimeError(f"errors: {list(resp.errors)[:3]}")
    t1 = time.monotonic()
    if got != n:
        raise RuntimeError(f"{got} completions of {n}")
    return t0, t1


def snap_all(ctls, res, size: int) -> list[dict]:
    for c in ctls:
        c.put("snap")
    out = [None] * size
    for _ in range(size):
        r, s = res.get(timeout=60)
        out[r] = s
    return out


def cpu_of(before: dict, after: dict) -> tuple[dict, dict]:
    """(thread CPU seconds by name, metered CPU seconds by (label, thread)) between snapshots."""
    cpu = {k: v - before["cpu"].get(k, 0.0) for k, v in after["cpu"].items()}
    met = {k: v - before["meter"].get(k, 0.0) for k, v in after["meter"].items()}
    return cpu, met


def summarize(size: int, n: int, t0: float, t1: float, before: list, after: list,
              decode_s: float) -> dict:
    row = {"N": size, "requests": n, "wall ms": (t1 - t0) * 1e3,
           "funnel ms": (t1 - t0 - decode_s) * 1e3}
    ins = [t for a in after for t in a["in"] if t >= t0]
    outs = [t for a in after for t in a["out"] if t >= t0]
    row["last dealt ms"] = (max(ins) - t0) * 1e3
    row["last decoded ms"] = (max(outs) - t0) * 1e3
    row["last at rank 0 ms"] = (after[0]["last"]["server deliver"] - t0) * 1e3
    row["deals"] = after[0]["calls"].get("deal", 0) - before[0]["calls"].get("deal", 0)
    cpu, met = cpu_of(before[0], after[0])
    us = 1e6 / n

    def m(label, prefix=""):
        return sum(v for (lb, th), v in met.items() if lb == label and th.startswith(prefix))

    reader = m("thread", "slimen-torch-generate-reader")
    group = cpu.get("slimen-torch-group", 0.0)
    recv = sum(v for k, v in cpu.items() if k.startswith("slimen-torch-from-rank-"))
    worker = cpu.get("slimen-torch-worker", 0.0)
    handler = sum(v for k, v in cpu.items() if k.startswith("ThreadPoolExecutor"))
    recv_cb = m("server deliver", "slimen-torch-from-rank-")
    worker_cb = m("server deliver", "slimen-torch-worker")
    named = reader + group + recv + worker + handler
    row.update({
        "r0 read+parse": (reader - m("server submit")) * us,
        "r0 submit+check": m("server submit") * us,
        "r0 deal+bcast": (group - m("engine submit", "slimen-torch-group")) * us,
        "r0 own submit": m("engine submit", "slimen-torch-group") * us,
        "r0 recv+unpickle": (recv - recv_cb) * us,
        "r0 callbacks": (recv_cb + worker_cb) * us,
        "  of which pb": m("response build") * us,
        "r0 fake decode": (worker - worker_cb) * us,
        "r0 stream out": handler * us,
        "r0 other thr": (cpu["total"] - named) * us,
        "r0 total": cpu["total"] * us,
    })
    if size > 1:
        c1, m1 = cpu_of(before[1], after[1])
        k = sum(1 for t in after[1]["in"] if t >= t0) or 1
        us1 = 1e6 / k
        sub = sum(v for (lb, th), v in m1.items() if lb == "engine submit")
        row.update({
            "r1 recv+unpickle": (c1.get("MainThread", 0.0) - sub) * us1,
            "r1 submit+check": sub * us1,
            "r1 outbox send": c1.get("slimen-torch-outbox", 0.0) * us1,
            "r1 fake decode": c1.get("slimen-torch-worker", 0.0) * us1,
            "r1 total": c1["total"] * us1,
        })
    return row


def run(size: int, a, model_dir: str) -> dict:
    import grpc

    from slimen_torch.proto import engine_pb2 as pb
    from slimen_torch.proto import engine_pb2_grpc as pb_grpc

    ctx = mp.get_context("spawn")
    ctls, res, port = [ctx.Queue() for _ in range(size)], ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank, args=(r, size, port, model_dir, a.steps, a.step_ms / 1e3,
                                             ctls[r], res), daemon=True) for r in range(size)]
    for p in procs:
        p.start()
    try:
        what, bound = res.get(timeout=180)
        assert what == "port", what
        ch = grpc.insecure_channel(f"127.0.0.1:{bound}", options=[
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.max_send_message_length", 64 << 20)])
        stub = pb_grpc.EngineStub(ch)
        n = size * a.per_rank
        rows = []
        for k in range(a.rounds):
            before = snap_all(ctls, res, size)
            t0, t1 = client_round(stub, pb, k, n, a.max_tokens, a.per_msg)
            after = snap_all(ctls, res, size)
            if k > 0 or a.rounds == 1:
                rows.append(summarize(size, n, t0, t1, before, after,
                                      a.steps * a.step_ms / 1e3))
        ch.close()
    finally:
        for c in ctls:
            c.put("close")
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    rows.sort(key=lambda r: r["wall ms"])
    return rows[len(rows) // 2]  # the median round's


def model_folder(out: str) -> str:
    """A model folder without weights (the fake engine reads none): the config, BPE tokenizer and
    ChatML template make-model writes for multi_gpu.sh's qwen3-0.6b-shaped model."""
    import json
    import pathlib

    from slimen_torch import make_model as mm

    shape, d = "qwen3-0.6b", pathlib.Path(out)
    d.mkdir(parents=True)
    tok = mm.train_tokenizer(mm.SHAPES[shape][2], 7)
    eos, pad = tok.token_to_id(mm.IM_END), tok.token_to_id(mm.ENDOFTEXT)
    vocab = -(-tok.get_vocab_size() // 8) * 8
    (d / "config.json").write_text(json.dumps(mm.config_dict(shape, vocab, eos, pad, "bfloat16")))
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": mm.CHAT_TEMPLATE,
        "eos_token": mm.IM_END, "pad_token": mm.ENDOFTEXT}))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="1,2,4")
    p.add_argument("--per-rank", type=int, default=256, help="requests a rank a round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=128, help="decode steps of a request")
    p.add_argument("--step-ms", type=float, default=2.3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--per-msg", type=int, default=1 << 20,
                   help="requests a stream message (default: all in one)")
    a = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = model_folder(os.path.join(tmp, "m"))
        for size in [int(x) for x in a.ranks.split(",")]:
            t = time.monotonic()
            rows.append(run(size, a, model))
            print(f"N={size}: {time.monotonic() - t:.1f} s", file=sys.stderr, flush=True)
    keys = list(dict.fromkeys(k for r in rows for k in r))
    print(f"{'':20s}" + "".join(f"{'N=' + str(r['N']):>10s}" for r in rows))
    for k in keys[1:]:
        cells = "".join(f"{r[k]:10.0f}" if k in r else f"{'':>10s}" for r in rows)
        print(f"{k:20s}{cells}")
    print("(ms: from the client's first send; r0/r1: CPU µs a request on rank 0, and on rank 1 "
          "a request of its own)")


if __name__ == "__main__":
    main()
