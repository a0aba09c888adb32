#!/usr/bin/env bash
# Pretrains a chat model on the host's synthetic chat corpus (tasks.ChatCorpus, the corpus of
# builtin:tiny-chat: calculator, ToolOrchestra, AgentFlow and MemAgent turns with their tool
# schemas, and arithmetic) with the torch worker's sft, on one GPU within one budget.
#
#   SLIMEN=.devbuild/slimen PY=python3 OUT=/tmp/chat engines/torch/pretrain_chat.sh
#   SHAPE=tiny-chat HIDDEN=256 LAYERS=4 …        a larger model of tiny-chat's (Llama) form
#   SHAPE=qwen3-50m LAYERS=11 …                  a Qwen3-shaped model of 54.6M parameters
#   INIT=engines/tiny/builtin/tiny-chat …        go on training a model folder instead
#   CHAT_TASK="synthetic:chat?vary_chunks=true"  the corpus with an option (docs/torch.md)
#
# Steps: `slimen export --task CHAT_TASK` of N training lines (seed SEED) and EVAL_N held-out lines
# of the default corpus (seed SEED+1000, the held-out seed of `slimen pretrain`); make-model --like
# engines/tiny/builtin/tiny-chat (its tokenizer and Qwen3-form chat template with tools; SHAPE
# tiny-chat keeps its Llama config, any make-model shape takes that shape; HIDDEN, LAYERS,
# INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, POSITIONS change it), or INIT's folder as it is; sft on DEVICE for STEPS steps or until
# MAX_SECONDS (default: what the budget leaves), printing the held-out exact match per kind; for
# a Llama shape, the Go engine's own held-out evaluation of the saved folder (`slimen pretrain
# --eval-only`: the same held-out examples), so both engines' numbers show. The folder goes to
# OUT/model (without the optimizer state), the logs to OUT. Run from the repository root; every
# part runs under a timeout cut from BUDGET (seconds, the whole script).
set -euo pipefail
SLIMEN=${SLIMEN:-.devbuild/slimen}
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda:0}
OUT=${OUT:-/tmp/pretrain-chat}
WORK=${WORK:-/tmp/pretrain-chat-work}
BUDGET=${BUDGET:-540}
SEED=${SEED:-1}
N=${N:-200000}             # training lines (each seen about once in a few minutes of a small model)
EVAL_N=${EVAL_N:-300}      # held-out lines; the right ones among them are scored
SHAPE=${SHAPE:-tiny-chat}
LIKE=${LIKE:-engines/tiny/builtin/tiny-chat}
INIT=${INIT:-}             # a model folder to train instead of a new one (SHAPE then only says whether it is Llama)
HIDDEN=${HIDDEN:-} LAYERS=${LAYERS:-} INTERMEDIATE=${INTERMEDIATE:-} HEADS=${HEADS:-}
KV_HEADS=${KV_HEADS:-} HEAD_DIM=${HEAD_DIM:-} POSITIONS=${POSITIONS:-}
CHAT_TASK=${CHAT_TASK:-synthetic:chat} # the training lines' corpus, with options (vary_chunks=true,
                           # easy_calc=true: docs/torch.md); the held-out lines stay the default's
STEPS=${STEPS:-1000000}    # the schedule's length; MAX_SECONDS usually ends the run first
MAX_SECONDS=${MAX_SECONDS:-}
BATCH_TOKENS=${BATCH_TOKENS:-16384}
LR=${LR:-3e-3}
DECAY=${DECAY:-cosine}     # with MAX_SECONDS the fall follows the time spent
WARMUP=${WARMUP:-100}
EVAL_EVERY=${EVAL_EVERY:-0}
LOG_EVERY=${LOG_EVERY:-100}
DTYPE=${DTYPE:-}           # default: float32 for tiny-chat's shape (the Go engine's), else by size
COMPILE=${COMPILE:-block}  # sft --compile-train (a GPU's; off on the CPU)
GO_EVAL_SECONDS=${GO_EVAL_SECONDS:-120}
SFT_OVERHEAD=${SFT_OVERHEAD:-90}  # seconds of sft outside its training loop: start, compile, evaluations, save
# shellcheck source=engines/torch/lib.sh
source "$(dirname "$0")/lib.sh"
gpu_lib_init
mkdir -p "$OUT"

llama=1
[ "$SHAPE" = tiny-chat ] || llama=0
if [ -z "$DTYPE" ] && [ "$llama" = 1 ]; then DTYPE=float32; fi

part export 120 bash -c "'$SLIMEN' export --task '$CHAT_TASK' --seed $SEED --n $N --out '$WORK/train.jsonl' &&
  '$SLIMEN' export --task synthetic:chat --seed $((SEED + 1000)) --n $EVAL_N --out '$WORK/held.jsonl'"
right=$(grep -c '"right":true' "$WORK/held.jsonl" || true)

sizes=()
for kv in hidden:HIDDEN layers:LAYERS intermediate:INTERMEDIATE heads:HEADS kv-heads:KV_HEADS head-dim:HEAD_DIM positions:POSITIONS; do
  v=${kv#*:}
  [ -z "${!v}" ] || sizes+=("--${kv%%:*}" "${!v}")
done
shape=()
[ "$llama" = 1 ] || shape=(--shape "$SHAPE")
if [ -n "$INIT" ]; then
  cp -r "$INIT" "$WORK/init"
else
  part make-model 120 "$PY" -m slimen_torch make-model --like "$LIKE" "${shape[@]}" "${sizes[@]}" \
    --seed "$SEED" --out "$WORK/init"
fi

# What the budget leaves for sft: all but the Go evaluation's share and 20 s for the summary.
left=$((BUDGET - 20 - ($(date +%s) - START) - (llama ? GO_EVAL_SECONDS : 0)))
MAX_SECONDS=${MAX_SECONDS:-$((left - SFT_OVERHEAD))}
[ "$MAX_SECONDS" -gt 0 ] || { echo "pretrain_chat: BUDGET $BUDGET leaves no time to train" >&2; exit 1; }
compile=$COMPILE
case $DEVICE in cuda*) ;; *) compile=off ;; esac
dtype=()
[ -z "$DTYPE" ] || dtype=(--dtype "$DTYPE")
rc=0
part sft "$left" "$PY" -m slimen_torch sft --model "$WORK/init" --data "$WORK/train.jsonl" \
  --out "$WORK/model" --device "$DEVICE" "${dtype[@]}" --compile-train "$compile" \
  --steps "$STEPS" --max-seconds "$MAX_SECONDS" --batch-tokens "$BATCH_TOKENS" --lr "$LR" \
  --warmup "$WARMUP" --decay "$DECAY" --eval-data "$WORK/held.jsonl" --eval-every "$EVAL_EVERY" \
  --log-every "$LOG_EVERY" --seed "$SEED" || rc=$?
cp "$WORK/sft.log" "$OUT/"
grep -E "slimen_torch INFO (sft on|tokenized|sft step .*0/|sft stopped|saved)" "$WORK/sft.log" | tail -8 || true
[ "$rc" = 0 ] || exit "$rc"
rm -f "$WORK/model/optimizer.pt"
echo "== torch sft, held-out synthetic:chat seed $((SEED + 1000)) ($right right lines of $EVAL_N):"
grep -E "^step [0-9]+: held-out" "$WORK/sft.log"

if [ "$llama" = 1 ]; then
  # The Go engine's ChatEval on the same held-out seed: its first $right right examples are the
  # right lines of held.jsonl.
  if part go-eval "$GO_EVAL_SECONDS" "$SLIMEN" pretrain --init "$WORK/model" --task synthetic:chat \
    --seed "$SEED" --eval-only --eval-n "$right"; then
    echo "== Go tiny engine, the same held-out examples:"
    grep -E "^step 0: held-out" "$WORK/go-eval.log"
  fi
  cp "$WORK/go-eval.log" "$OUT/" 2>/dev/null || true
fi
cp -r "$WORK/model" "$OUT/model"
printf '%s\n' "pretrain_chat: SHAPE=$SHAPE ${sizes[*]} N=$N, $(($(date +%s) - START)) s; the model is in $OUT/model"
