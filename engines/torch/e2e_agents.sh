#!/usr/bin/env bash
# The agent examples end to end on one GPU, in one call: a Qwen3-shaped chat model (≥ 50M
# parameters) is fitted to the synthetic chat corpus with the torch worker's sft, then AgentFlow,
# MemAgent, ToolOrchestra and the debate train from it with GRPO, each with a held-out eval before
# training and as it goes; one table (steps, wall time, held-out accuracy first → last, tokens
# trained, masked share) ends it.
#
#   SLIMEN=.devbuild/slimen PY=python3 OUT=/tmp/agents engines/torch/e2e_agents.sh
#   # on a CPU, tiny sizes (the numbers mean nothing; it checks that every part runs):
#   SLIMEN=.devbuild/slimen DEVICE=cpu SHAPE=tiny-qwen3 LAYERS= POSITIONS=4096 N=3000 ARITH_N=0 EVAL_N=20 \
#     SFT_SECONDS=15 STEPS=4 EVAL_INTERVAL=2 EVAL_LIMIT=4 BATCH=2 MAXLEN=24 SLOTS=16 BUDGET=900 \
#     engines/torch/e2e_agents.sh
#   # the same from builtin:tiny-chat's weights, which already speak the examples' formats:
#   … INIT=engines/tiny/builtin/tiny-chat SFT_SECONDS=5 SFT_LR=1e-5 … engines/torch/e2e_agents.sh
#   # one device call (it brings back a few files: PACK=1 puts the runs in one archive):
#   OUT=$OUT/agents PACK=1 SLIMEN=.devbuild/slimen PY=python3 engines/torch/e2e_agents.sh
#
# 1. `slimen export --task synthetic:chat`: N training lines (seed SEED) and EVAL_N held-out lines
#    (seed SEED + 1000), and with ARITH_N > 0 that many `synthetic:arith` pairs (seed 7) mixed in;
#    `make-model --like engines/tiny/builtin/tiny-chat --shape SHAPE --layers LAYERS` (qwen3-50m
#    with 11 layers: 54.6M parameters, tiny-chat's tokenizer and chat template, so the examples'
#    prompts render as the corpus's did); `python -m slimen_torch sft` for SFT_SECONDS on DEVICE,
#    printing the held-out greedy exact match per kind. This is engines/torch/pretrain_chat.sh's
#    recipe (docs/tiny.md), cut to fit.
# 2. For each of EXAMPLES a config like the example's config_torch.yaml with every policy on the
#    sft'd folder, torch workers sharing DEVICE (SLOTS rows of SEQ positions each), the trained
#    policy at LR (LR_<example> overrides it: e.g. LR_debate=1e-5), and an eval: block (EVAL_LIMIT
#    held-out tasks of the run's task source, before training and every EVAL_INTERVAL steps);
#    `slimen exec` for at most STEPS steps (GBS: global_batch_size, 0 = one optimizer step a
#    step). The debate learns from the chat corpus's own arithmetic (6 examples in 100: the
#    word problems as user turns, half with other agents' answers as its critics see them) and
#    from ARITH_N (12,000) `synthetic:arith` pairs mixed into sft's data. PARALLEL runs at a time
#    (default: all four; the model is small, so the GPU has room, and each run is bound by its
#    own round trips, not by the GPU); what the budget leaves is split between the waves, and a
#    run still going at its limit gets SIGTERM (it ends its step; its last eval is then the last
#    multiple of EVAL_INTERVAL).
# 3. e2e_agents_summary.py: the table, printed and written to OUT/table.md; OUT/sft.md has sft's
#    held-out lines, OUT/sft.log its log, OUT/<example>/ each run's config, output, metrics.jsonl,
#    events.log and rollouts.jsonl (PACK=1: all of them in OUT/runs.tar.gz instead).
#
# Every part runs under a timeout cut from BUDGET (seconds, the whole script: one device call of
# 600 s at most), so a failure never eats the call. Everything stays on the machine but the logs
# and the runs' metrics (OUT/<example>/): the model folder is too big to bring back. Run from the
# repository root.
set -euo pipefail
SLIMEN=${SLIMEN:-.devbuild/slimen}
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda:0}
OUT=${OUT:-/tmp/agents}
WORK=${WORK:-/tmp/agents-work}
BUDGET=${BUDGET:-560}
SEED=${SEED:-1}
N=${N:-200000}             # chat corpus lines for sft (about one pass in SFT_SECONDS on an H200)
EVAL_N=${EVAL_N:-300}      # held-out chat lines (the right ones are scored)
ARITH_N=${ARITH_N:-12000}  # synthetic:arith pairs mixed into sft's data (the corpus has 6% already)
CHAT_TASK=${CHAT_TASK:-synthetic:chat} # sft's corpus, with options (vary_chunks=true, easy_calc=true:
                           # docs/torch.md); the held-out lines stay the default corpus's
UPSAMPLE=${UPSAMPLE:-}     # "KIND:K ...": the corpus lines of that kind K times in sft's data
                           # (e.g. "memory:4"); the held-out lines stay as exported
SHAPE=${SHAPE:-qwen3-50m}
LAYERS=${LAYERS-11}        # qwen3-50m with 11 layers: 54.6M parameters with tiny-chat's vocabulary
HIDDEN=${HIDDEN:-} POSITIONS=${POSITIONS:-}
LIKE=${LIKE:-engines/tiny/builtin/tiny-chat}
INIT=${INIT:-}             # a model folder to fit instead of a new one (e.g. tiny-chat itself, on a CPU)
SFT_SECONDS=${SFT_SECONDS:-150}
SFT_OVERHEAD=${SFT_OVERHEAD:-150} # the most sft may take beyond SFT_SECONDS (tokenizing, compiling,
                                  # its eval, saving): every later part needs its model
SFT_LR=${SFT_LR:-1e-3}     # e2e_debate.sh's for qwen3-50m (3e-3 pretrained tiny-chat's 150k parameters)
BATCH_TOKENS=${BATCH_TOKENS:-16384}
WARMUP=${WARMUP:-100}
COMPILE=${COMPILE:-block}  # sft --compile-train (a GPU's; off on the CPU)
EXAMPLES=${EXAMPLES:-agentflow memagent toolorchestra debate}
PARALLEL=${PARALLEL:-4}
LR=${LR:-3e-5}             # the trained policies' GRPO lr (1e-6 is for 1.5B instruct models)
GBS=${GBS:-0}              # global_batch_size: samples an optimizer step (0: one optimizer step a step)
STEPS=${STEPS:-1000}       # at most; the time limit usually ends a run first
EVAL_INTERVAL=${EVAL_INTERVAL:-10} # 200 tasks every 10 steps: the eval time of 100 every 5 (until
EVAL_LIMIT=${EVAL_LIMIT:-200}      # 2026-11-29), a standard error of about 0.035 instead of 0.05
BATCH=${BATCH:-}           # tasks a step for every example (default: each example's own, below)
MAXLEN=${MAXLEN:-}         # max_response_len for every example (default: each example's own)
DEBATE_DATA=${DEBATE_DATA:-synthetic:arith}
SLOTS=${SLOTS:-128}
SEQ=${SEQ:-2048}
EXTRA_ARGS=${EXTRA_ARGS:-} # more `serve` flags for every worker
PACK=${PACK:-0}            # 1: the runs' folders packed into OUT/runs.tar.gz (a device call's few files)
# shellcheck source=engines/torch/lib.sh
source "$(dirname "$0")/lib.sh"
gpu_lib_init
read -r -a exs <<<"$EXAMPLES"
on_gpu=0
case $DEVICE in cuda*) on_gpu=1 ;; esac

# The examples' configs and runs (below), checked before anything runs.
model="$WORK/model"
# policy NAME TRAINABLE [LR]: one torch policy on the sft'd model, on DEVICE.
args="[--slots, \"$SLOTS\", --max-seq-len, \"$SEQ\""
for a in $EXTRA_ARGS; do args="$args, \"$a\""; done
args="$args]"
policy() {
  printf '  - name: %s\n    hf_checkpoint: %s\n    engine: {kind: torch, python: %s, device: "%s", args: %s}\n' \
    "$1" "$model" "$PY" "$DEVICE" "$args"
  if [ "$2" = 1 ]; then
    printf '    train: {lr: %s, global_batch_size: %s, advantage_estimator: grpo, eps_clip: 0.2, eps_clip_high: 0.28, clip_grad: 1.0}\n' \
      "$3" "$GBS"
  else
    printf '    trainable: false\n'
  fi
}
# config EXAMPLE: the run's config on stdout (the example's config_torch.yaml, sized for the budget).
config() {
  local ex=$1 lr_var="LR_$1" batch maxlen data
  local lr=${!lr_var:-$LR}
  echo "# $ex on torch workers sharing $DEVICE, from the sft'd $SHAPE (e2e_agents.sh)."
  echo "policies:"
  case $ex in
    agentflow)
      policy planner 1 "$lr"; policy executor 0; policy verifier 0
      batch=32 maxlen=64 data=synthetic:calc ;;
    memagent)
      policy agent 1 "$lr"
      batch=16 maxlen=64 data=synthetic:facts ;;
    toolorchestra)
      policy orchestrator 1 "$lr"; policy expert 0
      batch=16 maxlen=96 data=synthetic:multipart ;;
    debate)
      policy generator 1 "$lr"; policy critic 1 "$lr"
      batch=16 maxlen=32 data=$DEBATE_DATA ;;  # × 6 debates × 9 answers: 864 samples a step
    *) echo "e2e_agents: EXAMPLES: unknown example $ex (agentflow, memagent, toolorchestra, debate)" >&2
       return 2 ;;
  esac
  echo "rollout: {batch_size: ${BATCH:-$batch}, max_response_len: ${MAXLEN:-$maxlen}, temperature: 1.0}"
  echo "data: {path: \"$data\"}"
  echo "eval: {datasets: [{path: \"$data\", limit: $EVAL_LIMIT}]}"
  echo "run: {steps: $STEPS, seed: 1, eval_interval: $EVAL_INTERVAL, save_minutes: 0, keep_checkpoints: 1}"
}
# run EXAMPLE SECONDS: the example's run under its own timeout; its files go to OUT/EXAMPLE.
run() {
  local ex=$1 dir="$OUT/$1" rc=0
  mkdir -p "$dir"
  config "$ex" >"$dir/config.yaml" || return 2
  part "$ex" "$2" "$SLIMEN" exec "examples/$ex/$ex.star" --config "$dir/config.yaml" \
    --out "$WORK/run-$ex" || rc=$?
  cp "$WORK/$ex.log" "$dir/exec.log" 2>/dev/null || true
  cp "$WORK/run-$ex/metrics.jsonl" "$WORK/run-$ex/events.log" "$WORK/run-$ex/rollouts.jsonl" "$dir/" 2>/dev/null || true
  [ "$rc" != 124 ] || rc=0  # stopped at its limit, as planned: its step ended, its evals stand
  return "$rc"
}
for ex in "${exs[@]}"; do config "$ex" >/dev/null || exit 2; done
[ "$PARALLEL" -ge 1 ] || { echo "e2e_agents: PARALLEL=$PARALLEL: want 1 or more" >&2; exit 2; }
mkdir -p "$OUT"
for ex in "${exs[@]}"; do rm -rf "${OUT:?}/$ex"; done
rm -f "$OUT/runs.tar.gz" "$OUT/table.md" "$OUT/sft.md" "$OUT/sft.log"

# ---- 1. the chat model ----
data="$WORK/train.jsonl"
part export 120 bash -c "'$SLIMEN' export --task '$CHAT_TASK' --seed $SEED --n $N --out '$data' &&
  '$SLIMEN' export --task synthetic:chat --seed $((SEED + 1000)) --n $EVAL_N --out '$WORK/held.jsonl' &&
  if [ $ARITH_N -gt 0 ]; then '$SLIMEN' export --task synthetic:arith --seed 7 --n $ARITH_N >>'$data'; fi"
for kk in $UPSAMPLE; do
  kind=${kk%%:*} k=${kk#*:}
  case $kind:$k in
    [a-z]*:[1-9]|[a-z]*:[1-9][0-9]) ;;
    *) echo "e2e_agents: UPSAMPLE: $kk: want KIND:K (a kind of the corpus, K from 1 to 99)" >&2; exit 2 ;;
  esac
  grep -F "\"kind\":\"$kind\"" "$data" >"$WORK/kind.jsonl" || {
    echo "e2e_agents: UPSAMPLE: no lines of kind $kind in the corpus" >&2; exit 2; }
  for ((r = 1; r < k; r++)); do cat "$WORK/kind.jsonl" >>"$data"; done
  echo "sft data: the $(wc -l <"$WORK/kind.jsonl") lines of kind $kind $k times"
done
sizes=()
for kv in hidden:HIDDEN layers:LAYERS positions:POSITIONS; do
  v=${kv#*:}
  [ -z "${!v}" ] || sizes+=("--${kv%%:*}" "${!v}")
done
if [ -n "$INIT" ]; then
  cp -r "$INIT" "$WORK/init"
else
  part make-model 120 "$PY" -m slimen_torch make-model --like "$LIKE" --shape "$SHAPE" "${sizes[@]}" \
    --seed "$SEED" --out "$WORK/init"
fi
compile=$COMPILE
[ "$on_gpu" = 1 ] || compile=off
rc=0
part sft $((SFT_SECONDS + SFT_OVERHEAD)) "$PY" -m slimen_torch sft --model "$WORK/init" --data "$data" \
  --out "$model" --device "$DEVICE" --compile-train "$compile" --steps 1000000 \
  --max-seconds "$SFT_SECONDS" --batch-tokens "$BATCH_TOKENS" --lr "$SFT_LR" --warmup "$WARMUP" \
  --decay cosine --eval-data "$WORK/held.jsonl" --log-every 200 --seed "$SEED" || rc=$?
cp "$WORK/sft.log" "$OUT/"
[ "$rc" = 0 ] || { echo "e2e_agents: sft failed (exit $rc): no model to train" >&2; exit "$rc"; }
rm -f "$model/optimizer.pt"  # RL starts with a fresh optimizer
{
  grep -oE "(sft on|sft stopped after) .*" "$WORK/sft.log" || true
  grep -E "^step [0-9]+: held-out" "$WORK/sft.log" || true
  echo "sft took $(awk '{printf "%.0f", $3}' "$WORK/status/sft") s in all (tokenizing, compiling, evaluating and saving included)"
} | tee "$OUT/sft.md"

# ---- 2. the examples ----
status=0
i=0
while [ "$i" -lt "${#exs[@]}" ]; do
  waves=$(((${#exs[@]} - i + PARALLEL - 1) / PARALLEL))
  # This wave's share of what is left, 15 s kept for the stops and the table.
  t=$(((BUDGET - 35 - ($(date +%s) - START)) / waves))
  pids=()
  for ex in "${exs[@]:i:PARALLEL}"; do
    run "$ex" "$t" &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || status=1; done
  i=$((i + PARALLEL))
done

# ---- 3. the table ----
pairs=()
for ex in "${exs[@]}"; do pairs+=("$ex=$OUT/$ex"); done
{
  echo "e2e_agents: ${INIT:-$SHAPE ${sizes[*]}} on $DEVICE; GRPO lr $LR, global_batch_size $GBS, $PARALLEL run(s) at a time"
  echo
  grep -v '^step ' "$OUT/sft.md" | sed 's/^/    /'
  echo
  "$PY" "$(dirname "$0")/e2e_agents_summary.py" --sft "$WORK/sft.log" --status "$WORK/status" "${pairs[@]}"
} | tee "$OUT/table.md"
if [ "$PACK" = 1 ]; then
  # A device call brings back a few files: the runs' folders go into one archive (their saved
  # rollouts too while it stays under 15 MB).
  tar czf "$OUT/runs.tar.gz" -C "$OUT" "${exs[@]}"
  if [ "$(stat -c %s "$OUT/runs.tar.gz")" -gt 15000000 ]; then
    tar czf "$OUT/runs.tar.gz" -C "$OUT" --exclude rollouts.jsonl "${exs[@]}"
  fi
  for ex in "${exs[@]}"; do rm -rf "${OUT:?}/$ex"; done
fi
echo "e2e_agents: $(($(date +%s) - START)) s in all"
exit "$status"
