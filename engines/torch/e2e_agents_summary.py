"""The table of engines/torch/e2e_agents.sh: per example run, its steps, wall time, held-out
accuracy before training and at its last eval (and its best eval between, when higher), the
tokens its policies trained on and the share of their responses masked out.

    python engines/torch/e2e_agents_summary.py [--sft SFT_LOG] --status WORK/status NAME=RUN_DIR ...

RUN_DIR holds the run's metrics.jsonl (and rollouts.jsonl); WORK/status/NAME is lib.sh's part
status ("rc timeout seconds"), whose seconds are the wall time (the worker start-up and the evals
included). The masked share is the mean of the script's chat_masked_share where it logs one
(ToolOrchestra), else it is read from the loss masks of the trained calls in rollouts.jsonl (the
few rollouts a step the run keeps; marked "(saved rollouts)"): a trained call's tokens after its
first sampled one that are masked out (tool results, injected messages, template tokens), over
all of them. Single-turn generate calls mask nothing. With --sft, sft's held-out greedy exact
match per kind comes first, as a table.
"""

from __future__ import annotations

import argparse
import json
import os
import re


def read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def read_status(path: str) -> tuple[str, float, float] | None:
    """lib.sh's part status: the exit code (or "skipped"), the timeout and the seconds taken."""
    if not path or not os.path.exists(path):
        return None
    rc, timeout, secs = open(path).read().split()[:3]
    return rc, float(timeout), float(secs)


def held_out(metrics: list[dict]) -> list[tuple[int, float]]:
    """(step, accuracy) of each eval, the datasets of one step averaged."""
    by_step: dict[int, list[float]] = {}
    for m in metrics:
        if m.get("policy") == "_eval" and "accuracy" in m:
            by_step.setdefault(m["step"], []).append(m["accuracy"])
    return [(s, sum(v) / len(v)) for s, v in sorted(by_step.items())]


def masked_share(metrics: list[dict], rollouts: list[dict]) -> str:
    logged = [m["chat_masked_share"] for m in metrics
              if m.get("policy") == "_run" and "chat_masked_share" in m]
    if logged:
        return f"{sum(logged) / len(logged):.0%}"
    masked = total = 0
    for r in rollouts:
        if r.get("eval"):
            continue
        for c in r.get("calls", []):
            mask = c.get("mask") or []
            if not c.get("trained") or 1 not in mask:
                continue
            rest = mask[mask.index(1):]
            masked += rest.count(0)
            total += len(rest)
    return f"{masked / total:.0%} (saved rollouts)" if total else "–"


def row(name: str, run_dir: str, status: tuple[str, float, float] | None) -> list[str]:
    metrics = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    rollouts = read_jsonl(os.path.join(run_dir, "rollouts.jsonl"))
    steps = len({m["step"] for m in metrics if m.get("policy") == "_run"})
    trained = sum(m.get("trained_tokens", 0) for m in metrics
                  if not str(m.get("policy", "_")).startswith("_"))
    evals = held_out(metrics)
    if not evals:
        acc = "no eval"
    elif len(evals) == 1:
        acc = f"{evals[0][1]:.2f} (step {evals[0][0]} only)"
    else:
        (s0, a0), (s1, a1) = evals[0], evals[-1]
        acc = f"{a0:.2f} → {a1:.2f} ({a1 - a0:+.2f}; step {s0} → {s1}"
        sb, ab = max(evals[1:-1], key=lambda e: e[1], default=(s1, a1))
        acc += f"; best {ab:.2f} at step {sb})" if ab > a1 else ")"
    if status is None:
        wall, note = "–", "not run"
    else:
        rc, timeout, secs = status
        wall = f"{secs:.0f}"
        note = {"0": "done", "124": f"stopped at its {timeout:.0f} s limit",
                "137": f"killed at its {timeout:.0f} s limit", "skipped": "skipped: no budget left"
                }.get(rc, f"exit {rc}")
    return [name, str(steps), wall, acc, f"{trained:,}", masked_share(metrics, rollouts), note]


HEAD = ["example", "steps", "wall s", "held-out accuracy, first → last", "tokens trained",
        "masked share", "run"]


def table(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(HEAD) + " |", "|---|---:|---:|---|---:|---:|---|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


SFT_EVAL = re.compile(r"^step (\d+): held-out .*: ([\d.]+)% of (\d+)(?: \((.*)\))?$")


def sft_table(log: str) -> str:
    """sft's held-out lines (`step N: held-out FILE, greedy answers equal to the right ones: X% of
    M (calc a%, …)`) as a table: the exact match over all the right lines and per kind."""
    rows, kinds = [], []
    with open(log) as f:
        for line in f:
            m = SFT_EVAL.match(line.strip())
            if not m:
                continue
            per = dict(p.rsplit(" ", 1) for p in m.group(4).split(", ")) if m.group(4) else {}
            kinds += [k for k in per if k not in kinds]
            rows.append((m.group(1), f"{m.group(2)}% of {m.group(3)}", per))
    if not rows:
        return f"no held-out lines in {log}"
    lines = ["| sft step | held-out exact match | " + " | ".join(kinds) + " |",
             "|---:|---:|" + "---:|" * len(kinds)]
    lines += [f"| {step} | {all_} | " + " | ".join(per.get(k, "–") for k in kinds) + " |"
              for step, all_, per in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--status", default="", help="lib.sh's status folder (WORK/status)")
    ap.add_argument("--sft", default="", help="sft's log: its held-out lines as a table first")
    ap.add_argument("runs", nargs="+", help="NAME=RUN_DIR")
    args = ap.parse_args()
    if args.sft:
        print(sft_table(args.sft) + "\n")
    rows = []
    for pair in args.runs:
        name, sep, run_dir = pair.partition("=")
        if not sep:
            ap.error(f"{pair!r}: want NAME=RUN_DIR")
        st = read_status(os.path.join(args.status, name)) if args.status else None
        rows.append(row(name, run_dir, st))
    print(table(rows))


if __name__ == "__main__":
    main()
