#!/usr/bin/env bash
# Issue 38's run-level identities: the e2e debate (e2e_debate.sh's model and config) with
# `deterministic: true`, three times with the same seed: two uninterrupted runs, and a third whose
# worker is SIGKILLed once step KILL_AFTER's checkpoint is written (the host starts it
# again and restores the checkpoint). Their metrics.jsonl, timings aside, must be byte-identical.
# (The victim is the run's lowest-pid torch worker: the generator's or the critic's.)
#
#   SLIMEN=.devbuild/slimen PY=python3 DEVICE=cuda:0 OUT=/tmp/e2e-det engines/torch/e2e_determinism.sh
#   DEVICE=cpu STEPS=3 engines/torch/e2e_determinism.sh       # the CPU's dry run (tiny-qwen3, parity)
#
# Steps: make-model SHAPE; on a GPU a short warm-up (`sft` for SFT_SECONDS on synthetic:arith SFT
# pairs of seed 7, so that answers are sometimes right and the weights move); then the three
# `slimen exec` runs (save_interval 1, so the killed worker resumes from a checkpoint); on a GPU
# they run at the same time on the one device (batch invariance makes that irrelevant to the
# numbers; PARALLEL=0 runs them one after the other). SCRIPT is the rollout script: the debate
# (default on a GPU) or `parity` (the CPU's default: a tiny random model never answers right, so
# the reward is its first token's parity and the weights move anyway). DETERMINISTIC=false runs
# the default mode instead, for contrast. Writes OUT/{a,b,killed}/
# {metrics.jsonl,events.log,exec.log}, OUT/config.yaml, OUT/verdict.md; exits 1 unless the three
# agree. Run from the repository root.
set -euo pipefail
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda:0}
OUT=${OUT:-/tmp/e2e-det}
WORK=${WORK:-/tmp/e2e-det-work}
SLIMEN=${SLIMEN:-.devbuild/slimen}
case "$DEVICE" in
cpu*) gpu=0 ;;
*) gpu=1 ;;
esac
STEPS=${STEPS:-$([ $gpu = 1 ] && echo 20 || echo 3)}
KILL_AFTER=${KILL_AFTER:-$((STEPS / 2))}  # SIGKILL the worker once this step's checkpoint is in
BATCH=${BATCH:-$([ $gpu = 1 ] && echo 16 || echo 2)}
SHAPE=${SHAPE:-$([ $gpu = 1 ] && echo qwen3-50m || echo tiny-qwen3)}
SFT_SECONDS=${SFT_SECONDS:-$([ $gpu = 1 ] && echo 45 || echo 0)}  # 0: no warm-up
SFT_BATCH=${SFT_BATCH:-64}
SFT_LR=${SFT_LR:-1e-3}
LR=${LR:-3e-5}
MAXLEN=${MAXLEN:-$([ $gpu = 1 ] && echo 32 || echo 8)}
SLOTS=${SLOTS:-$([ $gpu = 1 ] && echo 128 || echo 16)}
SCRIPT=${SCRIPT:-$([ $gpu = 1 ] && echo examples/debate/debate.star || echo parity)}
PARALLEL=${PARALLEL:-$gpu}
DETERMINISTIC=${DETERMINISTIC:-true}  # false: the default mode, for contrast
EXEC_TIMEOUT=${EXEC_TIMEOUT:-0}  # SIGTERM each run after this long (it ends its step; 0: never)
if [ "$KILL_AFTER" -lt 1 ] || [ "$KILL_AFTER" -ge "$STEPS" ]; then
  echo "e2e_determinism.sh: KILL_AFTER=$KILL_AFTER must be in [1, STEPS-1] (STEPS=$STEPS)" >&2
  exit 2
fi
if [ ! -x "$SLIMEN" ]; then
  mkdir -p "$(dirname "$SLIMEN")"
  go build -o "$SLIMEN" ./cmd/slimen
fi
export PYTHONPATH="$PWD/engines/torch${PYTHONPATH:+:$PYTHONPATH}"
rm -rf "$WORK" "$OUT"
mkdir -p "$OUT" "$WORK"
t0=$(date +%s)
model="$WORK/model"
"$PY" -m slimen_torch make-model --shape "$SHAPE" --out "$model" >/dev/null
if [ "$SFT_SECONDS" != 0 ]; then
  "$SLIMEN" export --task synthetic:arith --seed 7 --n 50000 --out "$WORK/sft.jsonl"
  "$PY" -m slimen_torch sft --model "$model" --data "$WORK/sft.jsonl" --out "$WORK/sft" \
    --device "$DEVICE" --steps 100000 --batch-size "$SFT_BATCH" --lr "$SFT_LR" \
    --log-every 250 --max-seconds "$SFT_SECONDS" >"$OUT/sft.log" 2>&1
  model="$WORK/sft"
  rm -f "$model/optimizer.pt" # RL starts with a fresh optimizer
fi
[ "$SCRIPT" != parity ] || SCRIPT=engines/torch/parity.star
cat >"$OUT/config.yaml" <<EOF
# Two policies (deterministic: $DETERMINISTIC) on torch workers sharing $DEVICE ($SHAPE).
policies:
  - name: generator
    hf_checkpoint: $model
    engine: {kind: torch, python: $PY, device: "$DEVICE", deterministic: $DETERMINISTIC, args: [--slots, "$SLOTS", --max-seq-len, "512"]}
    train: {lr: $LR, advantage_estimator: grpo, global_batch_size: 0}
  - name: critic
    hf_checkpoint: $model
    engine: {kind: torch, python: $PY, device: "$DEVICE", deterministic: $DETERMINISTIC, args: [--slots, "$SLOTS", --max-seq-len, "512"]}
    train: {lr: $LR, advantage_estimator: grpo, global_batch_size: 0}
rollout: {batch_size: $BATCH, max_response_len: $MAXLEN, temperature: 1.0}
data: {path: "synthetic:arith"}
run: {steps: $STEPS, seed: 1, save_interval: 1}
EOF
t1=$(date +%s)

# run NAME [kill]: one `slimen exec` into WORK/NAME; with kill, SIGKILLs one torch worker (the
# lowest-pid slimen_torch child of slimen) once step KILL_AFTER's checkpoint is complete, and
# writes WORK/NAME.killed.
run() {
  local name=$1 dir="$WORK/$1" pid w slimen to=()
  [ "$EXEC_TIMEOUT" != 0 ] && to=(timeout -s TERM "$EXEC_TIMEOUT")
  XDG_CACHE_HOME="$WORK/cache-$name" "${to[@]}" "$SLIMEN" exec "$SCRIPT" --config "$OUT/config.yaml" \
    --out "$dir" >"$WORK/$name.log" 2>&1 &
  pid=$!
  if [ "${2:-}" = kill ]; then
    while kill -0 "$pid" 2>/dev/null; do
      if [ -f "$dir/checkpoints/step_$KILL_AFTER/MANIFEST.json" ]; then
        # (Under EXEC_TIMEOUT slimen is timeout's child.)
        [ ${#to[@]} = 0 ] && slimen=$pid || slimen=$(pgrep -P "$pid" | head -1 || true)
        w=$(pgrep -P "${slimen:-0}" -f slimen_torch | head -1 || true)
        if [ -n "$w" ]; then
          kill -9 "$w" || true
          echo "step $KILL_AFTER: SIGKILLed worker pid $w" | tee "$WORK/$name.killed" >&2
          break
        fi
      fi
      sleep 0.05
    done
  fi
  local rc=0
  wait "$pid" || rc=$?
  echo "$rc" >"$WORK/$name.rc"
}
if [ "$PARALLEL" = 1 ]; then
  run a &
  run b &
  run killed kill &
  wait
else
  run a
  run b
  run killed kill
fi
t2=$(date +%s)
for n in a b killed; do
  mkdir -p "$OUT/$n"
  cp "$WORK/$n.log" "$OUT/$n/exec.log"
  cp "$WORK/$n/metrics.jsonl" "$WORK/$n/events.log" "$OUT/$n/" 2>/dev/null || true
  cp "$WORK/$n.rc" "$OUT/$n/rc"
  cp "$WORK/$n.killed" "$OUT/$n/killed" 2>/dev/null || true
done
echo "e2e_determinism: make-model+warm-up $((t1 - t0)) s, three runs $((t2 - t1)) s (parallel $PARALLEL)" |
  tee "$OUT/times.txt"
"$PY" "$(dirname "$0")/e2e_determinism.py" "$OUT" "$STEPS" | tee "$OUT/verdict.md"
