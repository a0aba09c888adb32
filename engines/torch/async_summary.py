"""Compares runs of one experiment at several rollout.max_staleness (docs/async.md).

    python engines/torch/async_summary.py K=0:RUN0/metrics.jsonl K=1:RUN1/metrics.jsonl ...

For each run: steps, mean step seconds and wall time after the first step (which starts the
workers and replicas and compiles: nothing overlaps it), each policy's engine busy fraction, the
mean reward of every policy over the first and the last quarter of the steps, and the reward
against wall time (the mean reward, all policies, of the last quarter-run of steps ended within a
quarter, a half and all of the slowest run's wall time after step 1; the step reached in brackets). With events.log beside metrics.jsonl,
also the weights versions' cost: the workers' in-worker copy (KeepVersion, a device copy: mean
seconds a copy and seconds per GB, the total over the total), and the rollout replicas' weight push
(mean seconds a push, and seconds per GB of model pushed; by broadcast through a push group, with
its link, or through a folder).
"""

from __future__ import annotations

import collections
import json
import os
import re
import sys


def load(path: str):
    by_step: dict[int, dict[str, dict]] = collections.defaultdict(dict)
    with open(path) as f:
        for line in f:
            if line.strip():
                m = json.loads(line)
                by_step[m["step"]][m["policy"]] = m
    steps = sorted(s for s in by_step if "_run" in by_step[s])
    return by_step, steps


def mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else float("nan")


def push_rate(metrics_path: str):
    """The rollout replicas' pushes (host/replica.go's lines in events.log), by how they went
    ("broadcast nccl", "broadcast cuda-ipc", "broadcast gloo", "folder"): {how: (mean seconds a
    push, mean seconds per GB, pushes)}."""
    ev = os.path.join(os.path.dirname(metrics_path), "events.log")
    if not os.path.exists(ev):
        return None
    text = open(ev).read()
    got = collections.defaultdict(list)
    for m in re.finditer(r"pushed to its rollout replica in ([0-9.]+)s \(.*?: ([0-9.]+) s/GB saved and loaded",
                         text):
        got["folder"].append((float(m.group(1)), float(m.group(2))))
    for m in re.finditer(r"pushed to its rollout replica by broadcast in ([0-9.]+)s \([0-9.e+-]+ GB: "
                         r"([0-9.]+) s/GB; ([\w-]+)", text):
        got["broadcast " + m.group(3)].append((float(m.group(1)), float(m.group(2))))
    if not got:
        return None
    return {how: (mean([s for s, _ in xs]), mean([r for _, r in xs]), len(xs))
            for how, xs in sorted(got.items())}


def copy_rate(metrics_path: str):
    """The workers' KeepVersion copies (versions.py's log line, in events.log)."""
    ev = os.path.join(os.path.dirname(metrics_path), "events.log")
    if not os.path.exists(ev):
        return None
    pat = r"kept weights version \d+: ([0-9.e+-]+) GB copied on \S+ in ([0-9.]+) s"
    got = [(float(m.group(1)), float(m.group(2))) for m in re.finditer(pat, open(ev).read())]
    if not got:
        return None
    gb, secs = sum(g for g, _ in got), sum(s for _, s in got)
    return secs / len(got), secs / max(gb, 1e-12), len(got)


def main() -> None:
    runs = []
    for arg in sys.argv[1:]:
        label, _, path = arg.partition(":")
        by_step, steps = load(path)
        if not steps:
            print(f"{label}: no steps in {path}")
            continue
        runs.append((label, path, by_step, steps))
    if not runs:
        sys.exit(1)
    policies = sorted({p for _, _, b, s in runs for st in s for p in b[st] if not p.startswith("_")})
    horizon = max(sum(b[s]["_run"]["step_s"] for s in st[1:]) for _, _, b, st in runs)
    head = ["run", "steps", "step s", "wall s after step 1"] + [f"{p} busy" for p in policies] + \
        [f"{p} reward first→last ¼" for p in policies] + ["reward by ¼ / ½ / all of wall",
                                                        "in-worker copy s (s/GB)", "replica push s (s/GB)"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for label, path, b, steps in runs:
        run = [b[s]["_run"] for s in steps]
        q = max(1, len(steps) // 4)
        row = [label, str(len(steps)), f"{mean([r['step_s'] for r in run[1:]] or [run[0]['step_s']]):.3f}",
               f"{sum(r['step_s'] for r in run[1:]):.1f}"]
        row += [f"{mean([b[s].get(p, {}).get('engine_busy') for s in steps]):.2f}" for p in policies]
        row += [f"{mean([b[s].get(p, {}).get('reward_mean') for s in steps[:q]]):.3f}→"
                f"{mean([b[s].get(p, {}).get('reward_mean') for s in steps[-q:]]):.3f}" for p in policies]
        by_time = []
        for frac in (0.25, 0.5, 1.0):
            t, done = 0.0, steps[:1]
            for s in steps[1:]:
                t += b[s]["_run"]["step_s"]
                if t <= frac * horizon + 1e-9:
                    done.append(s)
            last = done[-q:] if done else []
            by_time.append(f"{mean([b[s].get(p, {}).get('reward_mean') for s in last for p in policies]):.3f}"
                           f" (step {done[-1] if done else 0})")
        row.append(" / ".join(by_time))
        cr = copy_rate(path)
        row.append("—" if cr is None else f"{cr[0]:.5f} ({cr[1]:.5f})")
        pr = push_rate(path)
        row.append("—" if pr is None else "; ".join(
            f"{how} ×{n}: {secs:.4f} ({rate:.4f})" for how, (secs, rate, n) in pr.items()))
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
