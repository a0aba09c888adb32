#!/usr/bin/env bash
# Runs agent examples with their own config on the embedded engine and prints, per run, the
# held-out accuracy of the config's eval before training and at its end, and the wall time: the
# numbers of docs/agents.md's table. Usage:
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
printf '%-18s %4s %6s %8s %8s %8s\n' example seed steps "held-out" "→ last" "wall s"
for ex in "${examples[@]}"; do
  for seed in $seeds; do
    out=runs/curves/$ex-s$seed
    rm -rf "$out"
    start=$(date +%s)
    bin/slimen exec "examples/$ex/$ex.star" --config "examples/$ex/config.yaml" --seed "$seed" --out "$out" >"$out.log" 2>&1 ||
      { echo "$ex seed $seed failed: see $out.log"; continue; }
    wall=$(( $(date +%s) - start ))
    python3 - "$out/metrics.jsonl" "$ex" "$seed" "$wall" <<'EOF'
import json, sys
path, ex, seed, wall = sys.argv[1:]
evals = [json.loads(l) for l in open(path) if '"_eval"' in l]
steps = max(json.loads(l)["step"] for l in open(path))
first, last = evals[0]["accuracy"], evals[-1]["accuracy"]
print(f"{ex:<18} {seed:>4} {steps:>6} {first:>8.3f} {last:>8.3f} {wall:>8}")
EOF
  done
done
