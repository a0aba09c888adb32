#!/usr/bin/env bash
# Issue 23's exam swarm on a machine of G GPUs (G from nvidia-smi): examples/exam_swarm/
# exam_swarm8.star (eight agents, 4 samples each per task) on torch workers of a Qwen3-shaped model
# (qwen3-50m, random weights, bf16), run by `slimen exec` in three layouts:
#   spread  eight full-weight policies, each its own worker, pinned with engine.gpus to GPU
#           i·G/8 (one per GPU on 8 GPUs, two per GPU on 4, four on 2; G > 8 uses the first 8);
#   one     the same eight workers all on GPU 0;
#   lora    eight LoRA adapters (rank 8, every projection) on one base in one worker on GPU 0
#           (examples/exam_swarm/config_torch.yaml's layout).
# Per layout one row: the workers' start (the run opens them one after another), step 1, the mean
# step over the steps after the first WARMUP with its split into rollout_s and train_s (the host's
# wall times of the step's two phases; train also as the sum of the eight policies' train_s, which
# shows how much of it overlapped), generated tokens/s, the memory each GPU gained, and whether
# `slimen gpus --config` placed each policy where nvidia-smi saw its worker's process (by the pid
# events.log gives; where nvidia-smi lists no process, the GPUs whose memory rose). The model has
# random weights, so every answer is wrong and every advantage 0: the steps still generate and
# train every sample (nothing skips a zero advantage), which is what is timed. Each layout runs
# under a timeout cut from one budget (BUDGET s, default 540), in the order of LAYOUTS; the table
# says which part failed or was skipped. Run from the repository root:
#
#   SLIMEN=.devbuild/slimen PY=python3 engines/torch/swarm_gpu.sh           # the GPUs (~6 min)
#   SLIMEN=.devbuild/slimen PY=python3 engines/torch/swarm_gpu.sh --quick   # CPU: tiny-qwen3 (~2 min)
#
# Knobs (env): LAYOUTS ("spread lora one"), LORA_SLOTS (the LoRA worker's cache rows; 0, the
# default: the host's sizing), STEPS (5), WARMUP (2), PROMPTS (64 tasks a step: 256 samples per
# agent), MAXLEN (64 new tokens), SHAPE (qwen3-50m), COMPILE_TRAIN (off), BUDGET (540 s), G
# (default from nvidia-smi), WORK (/tmp/swarm-gpu: runs, logs, table.md). --quick runs the workers
# on the CPU and places the GPU form of each config on a saved inventory of G (2) H100s.
set -uo pipefail
QUICK=0
[ "${1:-}" = --quick ] && QUICK=1
SLIMEN=${SLIMEN:-.devbuild/slimen}
PY=${PY:-python3}
WORK=${WORK:-/tmp/swarm-gpu}
BUDGET=${BUDGET:-540}
COMPILE_TRAIN=${COMPILE_TRAIN:-off}
LAYOUTS=${LAYOUTS:-spread lora one}
# The LoRA worker's cache rows (--slots; 0: the host's sizing, 256 for each of its eight policies
# where the GPU has room, as the other layouts' eight workers of 256 rows each).
LORA_SLOTS=${LORA_SLOTS:-0}
. engines/torch/lib.sh
gpu_lib_init || exit 1
if [ "$QUICK" = 1 ]; then
  G=${G:-2} SHAPE=${SHAPE:-tiny-qwen3} PROMPTS=${PROMPTS:-2} MAXLEN=${MAXLEN:-8} STEPS=${STEPS:-3} WARMUP=${WARMUP:-1}
  saved_inventory "$G" >"$WORK/machine.json"
  ids=()
  for ((k = 0; k < G; k++)); do ids+=("$k"); done
else
  G=${G:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')}
  SHAPE=${SHAPE:-qwen3-50m} PROMPTS=${PROMPTS:-64} MAXLEN=${MAXLEN:-64} STEPS=${STEPS:-5} WARMUP=${WARMUP:-2}
  # Pinned by UUID: CUDA's device order need not be NVML's (docs/gpus.md).
  mapfile -t ids < <(nvidia-smi --query-gpu=uuid --format=csv,noheader 2>/dev/null)
fi
if [ "$G" -lt 1 ] || [ "${#ids[@]}" -lt "$G" ]; then
  echo "swarm_gpu.sh: no GPUs (G=$G); --quick runs on the CPU" >&2
  exit 2
fi
echo "G=$G shape=$SHAPE; exam_swarm8.star: 8 agents x 4 samples x $PROMPTS tasks a step ($((4 * PROMPTS)) samples per agent)," \
  "$MAXLEN new tokens; $STEPS steps, means over the steps after step $WARMUP; compile-train $COMPILE_TRAIN; layouts: $LAYOUTS" \
  >"$WORK/setup.txt"
cat "$WORK/setup.txt" >&2

# config LAYOUT FORM: the layout's config; FORM cpu runs every worker on the CPU (the quick run),
# FORM gpu pins them to GPUs.
config() {
  local i k where train rows lora=""
  echo "policies:"
  for ((i = 0; i < 8; i++)); do
    k=0
    if [ "$1" = spread ]; then
      k=$((G >= 8 ? i : i * G / 8))
    fi
    if [ "$2" = cpu ]; then
      where='device: cpu'
    else
      where="gpus: [\"${ids[$k]}\"]"
    fi
    train="lr: 1.0e-5, advantage_estimator: grpo, global_batch_size: 0" rows=""
    if [ "$1" = lora ]; then
      [ "$LORA_SLOTS" -gt 0 ] && rows=", --slots, \"$LORA_SLOTS\""
      train="lr: 1.0e-4, advantage_estimator: grpo, global_batch_size: 0"
      lora="lora: {rank: 8, alpha: 16, targets: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]}"
    fi
    torch_policy "agent_$i" "$WORK/model" "$where, args: [--max-seq-len, \"512\", --compile-train, $COMPILE_TRAIN$rows]" "$train" "$lora"
  done
  cat <<EOF
rollout: {batch_size: $PROMPTS, max_response_len: $MAXLEN, temperature: 1.0}
data: {path: "synthetic:arith"}
run: {steps: $STEPS, seed: 1}
EOF
}

part make-model 120 "$PY" -m slimen_torch make-model --shape "$SHAPE" --out "$WORK/model"
part gpus 30 "$SLIMEN" gpus
for layout in $LAYOUTS; do
  case "$layout" in
    spread | one | lora) ;;
    *) echo "LAYOUTS: unknown layout $layout (spread, one, lora)" >&2; exit 2 ;;
  esac
  if [ "$layout" = spread ] && [ "$G" = 1 ]; then
    echo "skipped 0 0" >"$WORK/status/$layout"
    echo "== spread: skipped (one GPU: the same as one)" >&2
    continue
  fi
  config "$layout" gpu >"$WORK/$layout-gpu.yaml"
  if [ "$QUICK" = 1 ]; then
    config "$layout" cpu >"$WORK/$layout.yaml"
    part "gpus-$layout" 30 "$SLIMEN" gpus --machine "$WORK/machine.json" --config "$WORK/$layout-gpu.yaml"
  else
    cp "$WORK/$layout-gpu.yaml" "$WORK/$layout.yaml"
    part "gpus-$layout" 30 "$SLIMEN" gpus --config "$WORK/$layout.yaml"
  fi
  sed -n '/^placement:/,$p' "$WORK/gpus-$layout.log" >&2
  sp=""
  if [ "$QUICK" = 0 ]; then
    sample "$layout" &
    sp=$!
  fi
  want=240
  [ "$layout" = lora ] && want=150
  part "$layout" "$want" "$SLIMEN" exec examples/exam_swarm/exam_swarm8.star --config "$WORK/$layout.yaml" --out "$WORK/$layout"
  [ -n "$sp" ] && kill "$sp" 2>/dev/null
done

# ---- the table
"$PY" - "$WORK" "$G" "$WARMUP" "$QUICK" "$LAYOUTS" <<'EOF' | tee "$WORK/table.md"
import datetime, re, sys
from gpu_runs import Work, compact, mean, params, steady, steps_label
w = Work(sys.argv[1])
G, warmup, quick, layouts = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1", sys.argv[5].split()
n = min(G, 8)
where = {"spread": f"8 full-weight workers over {n} GPU{'s' if n > 1 else ''} ({8 // n if 8 % n == 0 else f'{8 // n}–{8 // n + 1}'} per GPU)",
         "one": "8 full-weight workers on GPU 0", "lora": "8 LoRA adapters in 1 worker on GPU 0"}
print((w.path / "setup.txt").read_text().strip() + (f"; parameters {params(w.path / 'model'):,}" if (w.path / "model").exists() else ""))
print("\n| layout | workers' start | step 1 s | step s | rollout s | train s (Σ policies) | rollout : train | gen tok/s | GPU memory gained | placement |")
print("|---|---|---:|---:|---:|---:|---|---:|---|---|")
notes, label = [], "no steps"
for lay in layouts:
    st = w.status(lay)
    run = w.metrics(lay, "_run")
    if not run:
        print(f"| {lay}: {where[lay]} | {st or 'no metrics'} |||||||||")
        continue
    ss = steady(run, warmup)
    label = steps_label(ss)
    step, ro, tr = mean(m["step_s"] for m in ss), mean(m["rollout_s"] for m in ss), mean(m["train_s"] for m in ss)
    pol = [m for m in w.metrics(lay) if m.get("policy") != "_run" and m["step"] in {x["step"] for x in ss}]
    tr_sum = sum(m.get("train_s", 0) for m in pol) / len(ss)
    gen = mean(m["tokens"] / m["rollout_s"] for m in ss if m["rollout_s"] > 0)
    ev = w.events(lay)
    ready = [float(x) for x in re.findall(r"torch worker ready in ([0-9.]+)s", ev)]
    # The workers start at the same time: from the first start to the last ready line (events.log
    # stamps seconds), and the longest single start.
    stamp = lambda pat: [datetime.datetime.fromisoformat(t.replace("Z", "+00:00")).timestamp()
                         for t in re.findall(r"^(\S+) policy \"[^\"]+\": " + pat, ev, re.M)]
    t0, t1 = stamp("starting a torch worker"), stamp("torch worker ready in")
    span = f"{max(t1) - min(t0):.0f} s from the first start to the last ready, " if t0 and t1 else ""
    start = f"{len(ready)} worker{'s' if len(ready) != 1 else ''}: {span}longest {max(ready, default=0):.1f} s"
    obs = w.observed(lay)
    if obs is None:
        mem = "n/a (no nvidia-smi)"
    else:
        samples = {}
        for l in (w.path / f"{lay}.mem").read_text().splitlines() if (w.path / f"{lay}.mem").exists() else []:
            _, i, used = [x.strip() for x in l.split(",")]
            samples.setdefault(int(i), []).append(float(used))
        mem = ", ".join(f"GPU {i} {(max(v) - v[0]) / 1024:.1f} GiB" for i, v in sorted(samples.items()) if max(v) - v[0] >= 256) or "none seen"
    if quick:
        plan = w.planned(f"gpus-{lay}")
        place = (w.status(f"gpus-{lay}") or f"planned on a saved {G}-GPU inventory: {compact(plan)}") + "; ran on the CPU"
    else:
        place = (w.status(f"gpus-{lay}") + "; " if w.status(f"gpus-{lay}") else "") + w.placement(f"gpus-{lay}", lay)
    short = "yes" if "placement matches: yes" in place else ("no" if "placement matches: no" in place else "see below")
    notes.append(f"- {lay}: {place}" + (f" ({st})" if st else ""))
    print(f"| {lay}: {where[lay]} | {start} | {run[0]['step_s']:.1f} | {step:.2f} | {ro:.2f} | {tr:.2f} ({tr_sum:.2f}) | "
          f"{100 * ro / step:.0f} : {100 * tr / step:.0f} | {gen:,.0f} | {mem} | {short} |")
print(f"\nstep, rollout and train s: the _run line's step_s, rollout_s and train_s ({label}); "
      "Σ policies: the eight policies' train_s added up (equal to train s where the host trained them one after another, "
      "more where their training overlapped). Placement:")
print("\n".join(notes))
EOF
