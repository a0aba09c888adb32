#!/usr/bin/env bash
# The end-to-end GPU experiment: the debate example on a ~55M-parameter Qwen3-shaped model
# warmed up on synthetic:arith, both policies on torch workers sharing one device.
#
#   SLIMEN=.devbuild/slimen PY=python3 DEVICE=cuda:0 OUT=/tmp/e2e engines/torch/e2e_debate.sh
#
# Steps: make-model qwen3-50m; `slimen export` of synthetic:arith SFT pairs (seed 7, so not the
# run's problems, which use run.seed 1); `python -m slimen_torch sft`; `slimen exec
# examples/debate/debate.star` for STEPS steps. Writes OUT/{sft.log,exec.log,metrics.jsonl,
# events.log,config.yaml} and prints the reward curve and the rollout/train split
# (e2e_summary.py). Run from the repository root.
set -euo pipefail
SLIMEN=${SLIMEN:-.devbuild/slimen}
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda:0}
OUT=${OUT:-/tmp/e2e}
STEPS=${STEPS:-50}
BATCH=${BATCH:-32}
SFT_STEPS=${SFT_STEPS:-4000}
SFT_SECONDS=${SFT_SECONDS:-0}      # stop the warm-up early after this long (0: run SFT_STEPS)
EXEC_TIMEOUT=${EXEC_TIMEOUT:-0}    # SIGTERM the run after this long: it finishes its step
SFT_BATCH=${SFT_BATCH:-64}
SFT_LR=${SFT_LR:-1e-3}
LR=${LR:-3e-5}
SHAPE=${SHAPE:-qwen3-50m}
MAXLEN=${MAXLEN:-32}
DATA=${DATA:-synthetic:arith}  # the RL tasks
SLOTS=${SLOTS:-128}
WORK=${WORK:-/tmp/e2e-work}
EXTRA_ARGS=${EXTRA_ARGS:-}
mkdir -p "$OUT" "$WORK"
export PYTHONPATH="$PWD/engines/torch${PYTHONPATH:+:$PYTHONPATH}"
t0=$(date +%s)
model="$WORK/model"
rm -rf "$model" "$WORK/run"
"$PY" -m slimen_torch make-model --shape "$SHAPE" --out "$WORK/init" >/dev/null
"$SLIMEN" export --task synthetic:arith --seed 7 --n 50000 --out "$WORK/sft.jsonl"
"$PY" -m slimen_torch sft --model "$WORK/init" --data "$WORK/sft.jsonl" --out "$model" \
  --device "$DEVICE" --steps "$SFT_STEPS" --batch-size "$SFT_BATCH" --lr "$SFT_LR" \
  --log-every 250 --max-seconds "$SFT_SECONDS" 2>&1 | tee "$OUT/sft.log"
rm -f "$model/optimizer.pt"  # RL starts with a fresh optimizer
t1=$(date +%s)
extra=""
for a in $EXTRA_ARGS; do extra="$extra, \"$a\""; done
cat >"$OUT/config.yaml" <<EOF
# Two policies on torch workers sharing $DEVICE; ${SHAPE} warmed up by sft.
policies:
  - name: generator
    hf_checkpoint: $model
    engine: {kind: torch, python: $PY, device: "$DEVICE", args: [--slots, "$SLOTS", --max-seq-len, "512"$extra]}
    train: {lr: $LR, advantage_estimator: grpo, global_batch_size: 0}
  - name: critic
    hf_checkpoint: $model
    engine: {kind: torch, python: $PY, device: "$DEVICE", args: [--slots, "$SLOTS", --max-seq-len, "512"$extra]}
    train: {lr: $LR, advantage_estimator: grpo, global_batch_size: 0}
rollout: {batch_size: $BATCH, max_response_len: $MAXLEN, temperature: 1.0}
data: {path: "$DATA"}
run: {steps: $STEPS, seed: 1}
EOF
set +e
to=()
[ "$EXEC_TIMEOUT" != 0 ] && to=(timeout -s TERM "$EXEC_TIMEOUT")
"${to[@]}" "$SLIMEN" exec examples/debate/debate.star --config "$OUT/config.yaml" \
  --out "$WORK/run" 2>&1 | tee "$OUT/exec.log"
rc=${PIPESTATUS[0]}
set -e
cp "$WORK/run/metrics.jsonl" "$WORK/run/events.log" "$OUT/" 2>/dev/null || true
t2=$(date +%s)
echo "e2e: make-model+export+sft $((t1 - t0)) s, exec $((t2 - t1)) s, exit $rc"
"$PY" "$(dirname "$0")/e2e_summary.py" "$OUT/metrics.jsonl" | tee "$OUT/summary.md" || true
exit "$rc"
