#!/usr/bin/env bash
# Runs agent examples with their own config on the embedded engine and prints, per run, the
# held-out accuracy of the config's eval before training and at its end, the wall time and the
# CPU time (user + system: on a shared machine the wall time depends on the other jobs, the CPU
# time much less; on an idle 2-core machine the wall time is about the CPU time over 1.5), and
# the other held-out numbers the example's eval gives, first → last (ToolOrchestra's cost per
# task, MemAgent's share of final notes that hold the fact): the numbers of docs/agents.md's
# table. Usage:
#
#   scripts/agent_curves.sh [EXAMPLE ...]      # default: calculator_agent agentflow memagent toolorchestra
#   SEEDS="1 2" scripts/agent_curves.sh calculator_agent
#
# Runs go to runs/curves/EXAMPLE-sSEED (metrics.jsonl, plots, rollouts.jsonl: `slimen view` them).
set -euo pipefail
cd "$(dirname "$0")/.."
examples=("$@")
[ ${#examples[@]} -gt 0 ] || examples=(calculator_agent agentflow memagent toolorchestra)
seeds=${SEEDS:-1}
go build -o bin/slimen ./cmd/slimen
mkdir -p runs/curves
printf '%-18s %4s %6s %8s %8s %7s %7s  %s\n' example seed steps "held-out" "→ last" "wall s" "cpu s" "more held-out numbers"
for ex in "${examples[@]}"; do
  for seed in $seeds; do
    out=runs/curves/$ex-s$seed
    rm -rf "$out"
    start=$(date +%s)
    /usr/bin/time -f '%U %S' -o "$out.time" bin/slimen exec "examples/$ex/$ex.star" --config "examples/$ex/config.yaml" --seed "$seed" --out "$out" >"$out.log" 2>&1 ||
      { echo "$ex seed $seed failed: see $out.log"; continue; }
    wall=$(( $(date +%s) - start ))
    python3 - "$out/metrics.jsonl" "$ex" "$seed" "$wall" "$out.time" <<'EOF'
import json, sys
path, ex, seed, wall, timefile = sys.argv[1:]
lines = [json.loads(l) for l in open(path)]
evals = [l for l in lines if l.get("policy") == "_eval"]
steps = max(l["step"] for l in lines)
cpu = sum(float(x) for x in open(timefile).read().split()[-2:])
first, last = evals[0], evals[-1]
more = "  ".join(f"{k} {first[k]:.3g} → {last[k]:.3g}" for k in ("parts_right", "cost", "tool_calls", "memory_holds_fact") if k in first)
print(f"{ex:<18} {seed:>4} {steps:>6} {first['accuracy']:>8.3f} {last['accuracy']:>8.3f} {wall:>7} {cpu:>7.0f}  {more}")
EOF
  done
done
