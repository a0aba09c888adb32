"""Summarises a run of engines/torch/e2e_toolorchestra.sh: per step, the step time and its split,
the turns of a conversation, its prefill tokens and how many of them re-read the conversation so
far (examples/toolorchestra logs prefill_tokens and reread_tokens per conversation).

    python engines/torch/e2e_toolorchestra_summary.py RUN/metrics.jsonl
"""

import json
import sys


def main() -> None:
    with open(sys.argv[1]) as f:
        runs = [m for m in map(json.loads, filter(str.strip, f)) if m.get("policy") == "_run"]
    print("| step | step s | rollout s | train s | turns/conv | prefill tokens/conv "
          "| re-read tokens/conv | re-read share |")
    print("|---|---|---|---|---|---|---|---|")
    for r in runs:
        pre, rr = r.get("prefill_tokens", 0), r.get("reread_tokens", 0)
        print(f"| {r['step']} | {r['step_s']:.2f} | {r['rollout_s']:.2f} | {r['train_s']:.2f} "
              f"| {r.get('turns', 0):.2f} | {pre:.0f} | {rr:.0f} | {100 * rr / pre if pre else 0:.0f}% |")
    later = runs[1:] or runs  # the first step compiles
    if later:
        n = len(later)
        print(f"\nsteps {later[0]['step']}–{later[-1]['step']}: mean step "
              f"{sum(r['step_s'] for r in later) / n:.2f} s (rollout "
              f"{sum(r['rollout_s'] for r in later) / n:.2f} s, training "
              f"{sum(r['train_s'] for r in later) / n:.2f} s); failed rollouts "
              f"{sum(r.get('failed', 0) for r in runs)}")


if __name__ == "__main__":
    main()
