#!/usr/bin/env bash
# The ToolOrchestra example (examples/toolorchestra) at scale on torch workers: BATCH tasks × 4
# conversations (256 by default) of up to 8 turns each (synthetic:multipart with PARTS parts, one
# turn or more a part), on the e2e model shape (make-model qwen3-50m, random weights: the timing
# does not depend on what the model says, and a random model answers each part in one turn, so
# every conversation runs PARTS turns of up to MAXLEN tokens). Measures the step time and how much
# of the prefill re-reads the conversation so far (the example logs prefill_tokens and
# reread_tokens: each turn's prompt, and the part of it an earlier turn of its conversation had).
# It runs twice, the workers' prefix cache off and then on (--prefix-cache SLOTS: a turn prefills
# only what its conversation's kept cache row lacks; docs/torch.md), and compares the two;
# PREFIX_CACHE=0 or PREFIX_CACHE=1 runs one of them (the comparison covers every run in OUT, so
# two calls with the same OUT compare too).
#
#   SLIMEN=.devbuild/slimen PY=python3 DEVICE=cuda:0 OUT=/tmp/orch engines/torch/e2e_toolorchestra.sh
#   # on a CPU, tiny sizes:
#   SLIMEN=.devbuild/slimen DEVICE=cpu SHAPE=tiny BATCH=2 PARTS=2 MAXLEN=16 STEPS=2 SEQ=512 SLOTS=16 \
#     engines/torch/e2e_toolorchestra.sh
#
# Writes OUT/{off,on}/{exec.log,metrics.jsonl,events.log,config.yaml,summary.md} and
# OUT/compare.md, and prints the tables. Run from the repository root.
set -euo pipefail
SLIMEN=${SLIMEN:-.devbuild/slimen}
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda:0}
OUT=${OUT:-/tmp/orch}
STEPS=${STEPS:-4}
BATCH=${BATCH:-64}      # tasks a step; the example runs 4 conversations a task
PARTS=${PARTS:-8}       # sub-questions a task: with one turn each, 8 turns a conversation
MAXLEN=${MAXLEN:-64}
SHAPE=${SHAPE:-qwen3-50m}
SEQ=${SEQ:-2048}
SLOTS=${SLOTS:-256}
WORK=${WORK:-/tmp/orch-work}
EXTRA_ARGS=${EXTRA_ARGS:-}
PREFIX_CACHE=${PREFIX_CACHE:-0 1}  # the runs: 0 prefix cache off, 1 on
mkdir -p "$OUT" "$WORK"
export PYTHONPATH="$PWD/engines/torch${PYTHONPATH:+:$PYTHONPATH}"
rm -rf "$WORK/model"
"$PY" -m slimen_torch make-model --shape "$SHAPE" --out "$WORK/model" >/dev/null
summary="$(dirname "$0")/e2e_toolorchestra_summary.py"
# The example with the embedded model's settings (the parts one user message at a time, no
# schemas), which it would otherwise leave for the chat model's on a torch engine: a copy beside a
# rollout that asks for them.
cp examples/toolorchestra/toolorchestra.star "$WORK/"
cat >"$WORK/orchestrate_parts.star" <<'STAR'
load("toolorchestra.star", "SAMPLES", "orchestrate")

def rollout(task):
    parallel(lambda _: orchestrate(task, chat_settings = False), range(SAMPLES))
STAR
status=0
runs=()
for pc in $PREFIX_CACHE; do
  case $pc in
    0) mode=off; cache_args="" ;;
    1) mode=on; cache_args="--prefix-cache $SLOTS" ;;
    *) echo "e2e_toolorchestra: PREFIX_CACHE=$PREFIX_CACHE: want 0, 1 or \"0 1\"" >&2; exit 2 ;;
  esac
  dir="$OUT/$mode"
  mkdir -p "$dir"
  rm -f "$dir/metrics.jsonl" "$dir/events.log"
  rm -rf "$WORK/run"
  extra=""
  for a in $EXTRA_ARGS $cache_args; do extra="$extra, \"$a\""; done
  args="[--slots, \"$SLOTS\", --max-seq-len, \"$SEQ\"$extra]"
  cat >"$dir/config.yaml" <<CONFIG
# ToolOrchestra on torch workers sharing $DEVICE: ${SHAPE}, random weights; prefix cache $mode.
policies:
  - name: orchestrator
    hf_checkpoint: $WORK/model
    engine: {kind: torch, python: $PY, device: "$DEVICE", args: $args}
    train: {lr: 1.0e-5, advantage_estimator: grpo, global_batch_size: 0}
  - name: expert
    trainable: false
    hf_checkpoint: $WORK/model
    engine: {kind: torch, python: $PY, device: "$DEVICE", args: $args}
rollout: {batch_size: $BATCH, max_response_len: $MAXLEN, temperature: 1.0}
data: {path: "synthetic:multipart?parts=$PARTS"}
run: {steps: $STEPS, seed: 1}
CONFIG
  echo "e2e_toolorchestra: prefix cache $mode"
  t0=$(date +%s)
  set +e
  "$SLIMEN" exec "$WORK/orchestrate_parts.star" --config "$dir/config.yaml" \
    --out "$WORK/run" 2>&1 | tee "$dir/exec.log"
  rc=${PIPESTATUS[0]}
  set -e
  cp "$WORK/run/metrics.jsonl" "$WORK/run/events.log" "$dir/" 2>/dev/null || true
  echo "e2e_toolorchestra: prefix cache $mode: exec $(( $(date +%s) - t0 )) s, exit $rc"
  "$PY" "$summary" "$dir/metrics.jsonl" "$dir/events.log" | tee "$dir/summary.md" || true
  [ "$rc" = 0 ] || status=$rc
done
# Every run in OUT, this call's and an earlier call's (PREFIX_CACHE=0, then PREFIX_CACHE=1).
for mode in off on; do
  [ -f "$OUT/$mode/metrics.jsonl" ] && runs+=("$mode=$OUT/$mode")
done
echo
"$PY" "$summary" --compare "${runs[@]}" | tee "$OUT/compare.md" || true
exit "$status"
