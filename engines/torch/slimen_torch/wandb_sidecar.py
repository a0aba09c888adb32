"""The Weights & Biases sidecar: a process of the project's Python environment that logs a slimen
run through the official wandb SDK (host/wandb starts it; docs/observability.md).

It reads one JSON object a line on stdin and answers on stdout, one JSON object a line:

    {"type": "init", "project", "entity", "name", "mode", "dir", "id", "config"}
        → {"type": "ready", "id", "name", "url", "dir", "mode"} or {"type": "error", "error"}
    {"type": "log", "step": N, "scalars": {"policy/metric": x},
     "histograms": {"policy/reward": [x, …]},
     "tables": {"rollouts": {"columns": [...], "rows": [[...], …]}}}
    {"type": "finish", "exit_code": 0}  → {"type": "finished"}, then it exits

Empty fields of init are left to the SDK, which then reads WANDB_PROJECT, WANDB_MODE,
WANDB_API_KEY, WANDB_DIR … from the environment as it always does. A scalar may be the string
"NaN", "Infinity" or "-Infinity" (JSON has no such numbers). A log message with a step below the
W&B run's current one is dropped, said once on stderr: W&B's steps only go forward, and a resumed
slimen run runs again the steps after its checkpoint, which the W&B run it resumes already holds.
When stdin ends without a finish (the host went away), the run is finished with exit code 1.

If wandb cannot be imported, the first line it writes is {"type": "error", "missing": "wandb"}.
The SDK's own messages, and anything printed, go to stderr: stdout carries only the protocol.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys

# A run is one line of stdin at a time; a line this long is a bug of the host, not a table.
MAX_LINE = 256 << 20

HISTOGRAM_BINS = 64


class Sidecar:
    """One W&B run driven by protocol messages; out is where replies go."""

    def __init__(self, wandb, out):
        self.wandb = wandb
        self.out = out
        self.run = None
        self.last_step = 0
        self.dropped = 0  # log messages of steps W&B already went past

    def reply(self, **msg) -> None:
        self.out.write(json.dumps(msg) + "\n")
        self.out.flush()

    def handle(self, msg: dict) -> bool:
        """Acts on one message; False once the run is finished."""
        kind = msg.get("type")
        if kind == "init":
            self.init(msg)
        elif kind == "log":
            self.log(msg)
        elif kind == "finish":
            self.finish(int(msg.get("exit_code", 0)))
            self.reply(type="finished")
            return False
        else:
            raise ValueError(f"unknown message type {kind!r}")
        return True

    def init(self, msg: dict) -> None:
        if self.run is not None:
            raise ValueError("init sent twice")
        kwargs = {k: msg[k] for k in ("project", "entity", "name", "mode", "dir", "id")
                  if msg.get(k)}
        if "id" in kwargs:
            kwargs["resume"] = "allow"  # a resumed slimen run goes on in the same W&B run
        try:
            self.run = self.wandb.init(config=msg.get("config") or {},
                                       settings=self.wandb.Settings(console="off"), **kwargs)
        except Exception as e:  # noqa: BLE001 - the host reports any failure of init as the reason
            self.reply(type="error", error=f"wandb.init: {type(e).__name__}: {e}")
            raise SystemExit(2) from None
        run = self.run
        self.last_step = max(0, int(getattr(run, "step", 0) or 0))
        mode = run.settings.mode
        url = run.url if mode in ("online", "run", "shared") else ""  # offline runs have none
        self.reply(type="ready", id=run.id, name=run.name or "", url=url or "", dir=run.dir or "",
                   mode=mode)

    def log(self, msg: dict) -> None:
        if self.run is None:
            raise ValueError("log before init")
        data = {}
        for k, v in (msg.get("scalars") or {}).items():
            data[k] = scalar(v)
        for k, values in (msg.get("histograms") or {}).items():
            values = [scalar(v) for v in values]
            values = [v for v in values if math.isfinite(v)]
            if values:
                data[k] = self.wandb.Histogram(values, num_bins=HISTOGRAM_BINS)
        for k, t in (msg.get("tables") or {}).items():
            data[k] = self.wandb.Table(columns=list(t["columns"]), data=[list(r) for r in t["rows"]])
        if not data:
            return
        step = int(msg.get("step", self.last_step))
        if step < self.last_step:
            self.dropped += 1
            if self.dropped == 1:
                print(f"wandb sidecar: step {step} is not logged, nor any other step the W&B "
                      f"run has gone past (it is at step {self.last_step}): it holds them from "
                      "before the resume", file=sys.stderr)
            return
        self.last_step = step
        self.run.log(data, step=step)

    def finish(self, exit_code: int) -> None:
        if self.run is not None:
            self.run.finish(exit_code=exit_code)
            self.run = None


def scalar(v) -> float:
    """A number of a log message: JSON's numbers, or the names of the non-finite ones."""
    if isinstance(v, str):
        if v not in ("NaN", "Infinity", "-Infinity"):
            raise ValueError(f"scalar {v!r} is not a number")
        return float(v.replace("Infinity", "inf"))
    return float(v)


def serve(lines, wandb, out) -> int:
    """Drives a Sidecar with the lines of stdin; returns the exit status."""
    s = Sidecar(wandb, out)
    for line in lines:
        if len(line) > MAX_LINE:
            print(f"wandb sidecar: a message of {len(line)} bytes was dropped", file=sys.stderr)
            continue
        line = line.strip()
        if not line:
            continue
        try:
            if not s.handle(json.loads(line)):
                return 0
        except (ValueError, KeyError, TypeError) as e:
            # A bad message loses that message, not the run.
            print(f"wandb sidecar: {type(e).__name__}: {e}", file=sys.stderr)
    s.finish(1)  # stdin ended without a finish: the host went away
    return 1


def main() -> int:
    # The protocol has stdout to itself: whatever the SDK or a library prints goes to stderr.
    out = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    # Ctrl-C in a terminal reaches the whole process group: the host stops its run gracefully and
    # then finishes this one, which must not die first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        import wandb
    except ImportError as e:
        out.write(json.dumps({"type": "error", "missing": "wandb", "error": str(e),
                              "python": sys.executable}) + "\n")
        out.flush()
        return 3
    return serve(sys.stdin, wandb, out)


if __name__ == "__main__":
    sys.exit(main())
