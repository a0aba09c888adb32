#!/bin/bash
# The exam swarm with eight agents as LoRA adapters on one base against eight full copies
# (docs/performance.md): peak memory, CPU and wall time of each run, and its mean step time.
# usage: scripts/exam_swarm_lora_bench.sh STEPS REPS OUTDIR  (the binary: $SLIMEN, else bin/slimen)
set -euo pipefail
steps=$1; reps=$2; out=$3
for rep in $(seq $reps); do for c in lora8 full8; do
  /usr/bin/time -f "$c rep$rep maxrss_kb %M wall_s %e cpu_s %U+%S" ${SLIMEN:-bin/slimen} exec examples/exam_swarm/exam_swarm8.star --config examples/exam_swarm/config_$c.yaml --steps $steps --out $out/es_${c}_$rep 2>&1 | grep -E "maxrss"
  python3 -c "
import json,sys
rows=[json.loads(l) for l in open('$out/es_${c}_$rep/metrics.jsonl')]
run=[r for r in rows if r.get('policy')=='_run'][1:]
f=lambda k: sum(r[k] for r in run)/len(run)
print('$c rep$rep steps 2..$steps mean step_s %.3f rollout_s %.3f train_s %.3f' % (f('step_s'), f('rollout_s'), f('train_s')))
"
done; done
