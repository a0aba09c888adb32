#!/usr/bin/env bash
# Issue 21's measurement: the end-to-end debate of e2e_debate.sh (a Qwen3-shaped ~55M model warmed
# up on synthetic:arith, generator and critic on two torch workers sharing one device, or on two
# with DEVICE2) at
# rollout.max_staleness 0, 1 and 2 (docs/async.md). At K > 0 each worker keeps the weights versions
# itself (a device copy of the weights per kept version, sampled by a rollout model in the same
# process while the trainer steps); the runs of REPLICA_KS (default 1) run again with
# --no-versions, where each policy samples from rollout replicas (more worker processes) that take
# the trainer's weights after each step by broadcast through a push group (host/replica.go: NCCL
# between two GPUs, gloo through the CPU on one). By default the replicas share their trainer's
# device; REPLICA_GPU=1 places the generator instead (no engine.device; megatron_num_nodes 1,
# sglang_num_nodes 1, run.colocate false): it trains on the machine's GPU 0 and its replicas run on
# its rollout slice, GPU 1, so its push crosses GPUs by NCCL (the critic stays on DEVICE2; use
# DEVICE2=cuda:1 or cuda:0). FOLDER=1 adds the replica runs again with --no-push (the folder push)
# for comparison. One warm-up serves every run; each is its own run from the same model.
#
#   SLIMEN=.devbuild/slimen PY=python3 DEVICE=cuda:0 OUT=/tmp/e2e-async engines/torch/e2e_async.sh
#   SLIMEN=/tmp/slimen PY=$(scripts/pyenv.sh)/bin/python DEVICE=cpu QUICK=1 engines/torch/e2e_async.sh
#   KS=0 REPLICA_KS=1 REPLICA_GPU=1 FOLDER=1 DEVICE2=cuda:1 …  (the push between two GPUs)
#
# REUSE=1 keeps a warmed-up model already in WORK (a second call for the other K, KS="2": the
# table then covers every K run into OUT so far).
# QUICK=1 is the CPU check: the tiny-qwen3 shape, 20 SFT steps, 3 steps of 2 tasks. Prints one
# table (async_summary.py): step time, wall time, each engine's busy fraction, the reward over the
# first and last quarter of the steps and against wall time, the in-worker copy of a weights
# version in s/GB, and the replicas' push in s/GB per link (the target between GPUs of one host:
# ≤ 0.01 s/GB).
set -euo pipefail
SLIMEN=${SLIMEN:-.devbuild/slimen}
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda:0}
DEVICE2=${DEVICE2:-$DEVICE}  # the critic's device: DEVICE2=cuda:1 puts the two policies on two GPUs
OUT=${OUT:-/tmp/e2e-async}
KS=${KS-0 1 2}  # KS="" runs none (only REPLICA_KS)
REPLICA_KS=${REPLICA_KS-1}
if [ "${QUICK:-0}" = 1 ]; then
  : "${SHAPE:=tiny-qwen3}" "${SFT_STEPS:=20}" "${STEPS:=3}" "${BATCH:=2}" "${MAXLEN:=8}" "${SLOTS:=8}" "${SFT_BATCH:=8}"
fi
STEPS=${STEPS:-40}
BATCH=${BATCH:-32}
SFT_STEPS=${SFT_STEPS:-300}
SFT_BATCH=${SFT_BATCH:-64}
SFT_LR=${SFT_LR:-1e-3}
LR=${LR:-1e-5}
SHAPE=${SHAPE:-qwen3-50m}
MAXLEN=${MAXLEN:-32}
DATA=${DATA:-synthetic:arith?difficulty=4}
SLOTS=${SLOTS:-128}
WORK=${WORK:-/tmp/e2e-async-work}
mkdir -p "$OUT" "$WORK"
export PYTHONPATH="$PWD/engines/torch${PYTHONPATH:+:$PYTHONPATH}"
model="$WORK/model"
t0=$(date +%s)
if [ "${REUSE:-0}" != 1 ] || [ ! -f "$model/config.json" ]; then
  rm -rf "$model" "$WORK"/run-* "$OUT"/k*
  "$PY" -m slimen_torch make-model --shape "$SHAPE" --out "$WORK/init" >/dev/null
  "$SLIMEN" export --task synthetic:arith --seed 7 --n 50000 --out "$WORK/sft.jsonl"
  "$PY" -m slimen_torch sft --model "$WORK/init" --data "$WORK/sft.jsonl" --out "$model" \
    --device "$DEVICE" --steps "$SFT_STEPS" --batch-size "$SFT_BATCH" --lr "$SFT_LR" \
    --log-every 250 >"$OUT/sft.log" 2>&1
  rm -f "$model/optimizer.pt"  # RL starts with a fresh optimizer
fi
echo "e2e-async: model and warm-up $(( $(date +%s) - t0 )) s"
rc=0
runs=""
for k in $KS; do runs="$runs $k"; done
for k in $REPLICA_KS; do [ "$k" != 0 ] && runs="$runs ${k}r"; done
if [ "${FOLDER:-0}" = 1 ]; then
  for k in $REPLICA_KS; do [ "$k" != 0 ] && runs="$runs ${k}f"; done
fi
for run in $runs; do
  k=${run%[rf]}
  extra=""
  [ "$run" = "${k}r" ] && extra=', --no-versions'  # the rollout replicas' path: a push group
  [ "$run" = "${k}f" ] && extra=', --no-versions, --no-push'  # … through a folder
  gen_place="device: \"$DEVICE\", "
  slices=""
  colocate=""
  if [ -n "$extra" ] && [ "${REPLICA_GPU:-0}" = 1 ]; then
    # Placed: it trains on GPU 0 (its actor slice), its replicas run on GPU 1 (its rollout slice).
    gen_place=""
    slices=$'num_gpus_per_node: 1\n    megatron_num_nodes: 1\n    sglang_num_nodes: 1\n    '
    colocate=", colocate: false"
  fi
  cat >"$OUT/config-k$run.yaml" <<YAML
policies:
  - name: generator
    hf_checkpoint: $model
    ${slices}engine: {kind: torch, python: $PY, ${gen_place}args: [--slots, "$SLOTS", --max-seq-len, "512"$extra]}
    train: {lr: $LR, advantage_estimator: grpo, global_batch_size: 0}
  - name: critic
    hf_checkpoint: $model
    engine: {kind: torch, python: $PY, device: "$DEVICE2", args: [--slots, "$SLOTS", --max-seq-len, "512"$extra]}
    train: {lr: $LR, advantage_estimator: grpo, global_batch_size: 0}
rollout: {batch_size: $BATCH, max_response_len: $MAXLEN, temperature: 1.0, max_staleness: $k}
data: {path: "$DATA"}
run: {steps: $STEPS, seed: 1$colocate}
YAML
  t1=$(date +%s)
  rm -rf "$WORK/run-k$run" "$OUT/k$run"
  set +e
  "$SLIMEN" exec examples/debate/debate.star --config "$OUT/config-k$run.yaml" --out "$WORK/run-k$run" >"$OUT/exec-k$run.log" 2>&1
  r=$?
  set -e
  [ "$r" != 0 ] && rc=$r && tail -5 "$OUT/exec-k$run.log"
  mkdir -p "$OUT/k$run"
  cp "$WORK/run-k$run/metrics.jsonl" "$WORK/run-k$run/events.log" "$OUT/k$run/" 2>/dev/null || true
  echo "e2e-async: K=$k${extra:+ (rollout replicas$([ "$run" = "${k}f" ] && echo ", folder push"))} exec $(( $(date +%s) - t1 )) s, exit $r"
  rm -rf "$WORK/run-k$run"
done
args=()
for d in "$OUT"/k*/; do
  name=$(basename "$d" | cut -c2-)
  label="K=${name%[rf]}"
  [ "$name" != "${name%r}" ] && label="$label replicas"
  [ "$name" != "${name%f}" ] && label="$label replicas (folder)"
  [ -f "$d/metrics.jsonl" ] && args+=("$label:$d/metrics.jsonl")
done
"$PY" "$(dirname "$0")/async_summary.py" "${args[@]}" | tee "$OUT/summary.md"
exit "$rc"
