"""Summarises a run of engines/torch/e2e_toolorchestra.sh: per step, the step time and its split,
the turns of a conversation, its prefill tokens and how many of them re-read the conversation so
far (examples/toolorchestra logs prefill_tokens and reread_tokens per conversation), and with the
prefix cache on, how many prompt tokens the orchestrator's worker reused from its cache (its
`prefix cache:` log line before each training step, in events.log).

    python engines/torch/e2e_toolorchestra_summary.py RUN/metrics.jsonl [RUN/events.log]
    python engines/torch/e2e_toolorchestra_summary.py --compare off=OUT/off on=OUT/on
"""

import json
import os
import re
import sys

PREFIX = re.compile(r'policy "orchestrator": worker: .*prefix cache: (\d+) prompts, (\d+) with a '
                    r'cached prefix; (\d+) of (\d+) prompt tokens reused')


def steps(metrics: str) -> list[dict]:
    with open(metrics) as f:
        return [m for m in map(json.loads, filter(str.strip, f)) if m.get("policy") == "_run"]


def reuse(events: str) -> list[tuple[int, int]]:
    """(reused, prompt tokens) of the orchestrator's worker, one per step that prefilled."""
    if not events or not os.path.exists(events):
        return []
    out = []
    with open(events) as f:
        for line in f:
            m = PREFIX.search(line)
            if m and int(m.group(1)):
                out.append((int(m.group(3)), int(m.group(4))))
    return out


def later(runs: list[dict]) -> list[dict]:
    return runs[1:] or runs  # the first step compiles


def pct(a: float, b: float) -> str:
    return f"{100 * a / b:.0f}%" if b else "–"


def summary(metrics: str, events: str = "") -> None:
    runs = steps(metrics)
    cache = reuse(events)
    print("| step | step s | rollout s | train s | turns/conv | prefill tokens/conv "
          "| re-read tokens/conv | re-read share | cache-reused share |")
    print("|---|---|---|---|---|---|---|---|---|")
    for i, r in enumerate(runs):
        pre, rr = r.get("prefill_tokens", 0), r.get("reread_tokens", 0)
        used = pct(*cache[i]) if i < len(cache) else "–"
        print(f"| {r['step']} | {r['step_s']:.2f} | {r['rollout_s']:.2f} | {r['train_s']:.2f} "
              f"| {r.get('turns', 0):.2f} | {pre:.0f} | {rr:.0f} | {pct(rr, pre)} | {used} |")
    rest = later(runs)
    if rest:
        n = len(rest)
        print(f"\nsteps {rest[0]['step']}–{rest[-1]['step']}: mean step "
              f"{sum(r['step_s'] for r in rest) / n:.2f} s (rollout "
              f"{sum(r['rollout_s'] for r in rest) / n:.2f} s, training "
              f"{sum(r['train_s'] for r in rest) / n:.2f} s); failed rollouts "
              f"{sum(r.get('failed', 0) for r in runs)}")


def compare(pairs: list[str]) -> None:
    """One row per run (mode=DIR): the mean over the steps after the first."""
    print("| prefix cache | mean step s | rollout s | train s | re-read share "
          "| prompt tokens reused (orchestrator) | rollout speed-up |")
    print("|---|---|---|---|---|---|---|")
    base = None
    for pair in pairs:
        mode, _, d = pair.partition("=")
        try:
            runs = later(steps(os.path.join(d, "metrics.jsonl")))
        except OSError as e:
            print(f"| {mode} | no metrics: {e} | | | | | |")
            continue
        if not runs:
            print(f"| {mode} | no steps | | | | | |")
            continue
        n = len(runs)
        step = sum(r["step_s"] for r in runs) / n
        roll = sum(r["rollout_s"] for r in runs) / n
        train = sum(r["train_s"] for r in runs) / n
        pre = sum(r.get("prefill_tokens", 0) for r in runs)
        rr = sum(r.get("reread_tokens", 0) for r in runs)
        cache = reuse(os.path.join(d, "events.log"))[1:]  # the steps after the first
        used, total = sum(c[0] for c in cache), sum(c[1] for c in cache)
        used_s = f"{used:,} of {total:,} ({pct(used, total)})" if total else "–"
        base = roll if base is None else base
        print(f"| {mode} | {step:.2f} | {roll:.2f} | {train:.2f} | {pct(rr, pre)} | {used_s} "
              f"| {base / roll:.2f}× |")


def main() -> None:
    if sys.argv[1:2] == ["--compare"]:
        compare(sys.argv[2:])
    else:
        summary(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "")


if __name__ == "__main__":
    main()
