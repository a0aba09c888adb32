"""Summarises a run's metrics.jsonl: the reward curve and the split of step time.

    python engines/torch/e2e_summary.py RUN/metrics.jsonl [--every 5]

Prints a Markdown table (per block of steps: mean reward of each policy, consensus accuracy, step
seconds split into rollout, training and the rest (the step's failures handled and the next
rollouts launched), and each policy's engine-busy share: the host's own share of a step is where
no engine is busy) and the totals over the run and over its steps
after the first (which compiles).
"""

from __future__ import annotations

import argparse
import collections
import json


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("metrics")
    ap.add_argument("--every", type=int, default=5)
    args = ap.parse_args()
    by_step: dict[int, dict[str, dict]] = collections.defaultdict(dict)
    with open(args.metrics) as f:
        for line in f:
            if line.strip():
                m = json.loads(line)
                by_step[m["step"]][m["policy"]] = m
    steps = sorted(s for s in by_step if "_run" in by_step[s])
    if not steps:
        print("no steps in", args.metrics)
        return
    policies = sorted({p for s in steps for p in by_step[s] if not p.startswith("_")})

    def mean(xs):
        xs = [x for x in xs if x is not None]
        return sum(xs) / len(xs) if xs else float("nan")

    head = ["steps"] + [f"{p} reward" for p in policies] + [
        "accuracy", "generator accuracy", "step s", "rollout s", "train s", "other s", "tokens/s"] + [
        f"{p} busy" for p in policies]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for i in range(0, len(steps), args.every):
        block = steps[i:i + args.every]
        run = [by_step[s]["_run"] for s in block]
        row = [f"{block[0]}–{block[-1]}"]
        row += [f"{mean([by_step[s].get(p, {}).get('reward_mean') for s in block]):.3f}"
                for p in policies]
        row += [f"{mean([r.get('accuracy') for r in run]):.3f}",
                f"{mean([r.get('generator_accuracy') for r in run]):.3f}",
                f"{mean([r['step_s'] for r in run]):.2f}",
                f"{mean([r['rollout_s'] for r in run]):.2f}",
                f"{mean([r['train_s'] for r in run]):.2f}",
                f"{mean([r['step_s'] - r['rollout_s'] - r['train_s'] for r in run]):.2f}",
                f"{mean([r['tokens_per_s'] for r in run]):,.0f}"]
        row += [f"{mean([by_step[s].get(p, {}).get('engine_busy') for s in block]):.2f}"
                for p in policies]
        print("| " + " | ".join(row) + " |")
    print()
    for label, span in (("", steps), (" after step 1", steps[1:])):
        if not span:
            continue
        run = [by_step[s]["_run"] for s in span]
        total = sum(r["step_s"] for r in run)
        ro = sum(r["rollout_s"] for r in run)
        tr = sum(r["train_s"] for r in run)
        host = total - ro - tr
        pct = (lambda x: f"{100 * x / total:.0f}%") if total > 0 else (lambda x: "—")
        busy = ", ".join(
            f"{p} busy {mean([by_step[s].get(p, {}).get('engine_busy') for s in span]):.2f}"
            for p in policies)
        print(f"{len(span)} steps{label}, {total:.1f} s: rollout {ro:.1f} s ({pct(ro)}), "
              f"training {tr:.1f} s ({pct(tr)}), other {host:.1f} s ({pct(host)}); "
              + ", ".join(f"{p} training {sum(by_step[s].get(p, {}).get('train_s', 0) for s in span):.1f} s"
                          for p in policies)
              + f"; {busy}; failed rollouts {sum(r.get('failed', 0) for r in run)}")


if __name__ == "__main__":
    main()
