#!/usr/bin/env bash
# Runs the flagship debate's default run (zero config, embedded engine) on seeds 1 and 2, one run
# at a time, and prints per run the held-out accuracy at every eval (before the first step and
# every 10 steps: README.md's table), the wall time and the CPU time (user + system: on a shared
# machine the wall time depends on the other jobs, the CPU time much less). Usage:
#
#   scripts/debate_curve.sh                         # seeds 1 and 2, the default run
#   SEEDS=1 scripts/debate_curve.sh --steps 20      # more arguments go to slimen exec
#   SCRIPT=path/to/variant.star scripts/debate_curve.sh
#
# Runs go to runs/curves/debate-sSEED (metrics.jsonl, plots, rollouts.jsonl: `slimen view` them).
set -euo pipefail
cd "$(dirname "$0")/.."
seeds=${SEEDS:-1 2}
script=${SCRIPT:-examples/debate/debate.star}
go build -o bin/slimen ./cmd/slimen
mkdir -p runs/curves
for seed in $seeds; do
  out=runs/curves/debate-s$seed
  rm -rf "$out"
  /usr/bin/time -f '%U %S %e' -o "$out.time" bin/slimen exec "$script" --seed "$seed" --out "$out" "$@" >"$out.log" 2>&1 ||
    { echo "debate seed $seed failed: see $out.log"; continue; }
  python3 - "$out/metrics.jsonl" "$seed" "$out.time" <<'EOF'
import json, sys
path, seed, timefile = sys.argv[1:]
lines = [json.loads(l) for l in open(path)]
evals = [l for l in lines if l.get("policy") == "_eval"]
user, system, wall = (float(x) for x in open(timefile).read().split()[-3:])
curve = "  ".join(f"{e['step']}:{e['accuracy']:.3f}" for e in evals)
gain = evals[-1]["accuracy"] - evals[0]["accuracy"]
print(f"seed {seed}: held-out {curve}  (last - first {gain:+.3f}, best {max(e['accuracy'] for e in evals):.3f})  "
      f"wall {wall:.0f} s  cpu {user + system:.0f} s")
EOF
done
