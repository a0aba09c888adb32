#!/usr/bin/env bash
# Issue 18's measurements on one GPU: placement and start-up of two policies sharing it (the
# debate on the e2e model's shape, qwen3-50m, random weights), the gather of full weights after an
# optimizer step of a worker over several ranks (s per GB), and the restart of a worker SIGKILLed
# in the middle of a run (the run completes; its metrics against an uninterrupted run's: a
# checkpoint every step, and a script whose reward, the parity of the first token, moves a random
# model's weights every step, so that a restore that lost them would show). Prints a short table.
# Run from the repository root:
#
#   SLIMEN=.devbuild/slimen PY=python3 engines/torch/gpu_measure.sh           # the GPU (~4 min)
#   SLIMEN=.devbuild/slimen PY=python3 engines/torch/gpu_measure.sh --quick   # CPU, tiny model
#
# SLIMEN is built (go build ./cmd/slimen) when missing. Writes WORK (default /tmp/gpu-measure):
# the runs, their logs, gather.json and table.md.
set -euo pipefail
QUICK=0
[ "${1:-}" = --quick ] && QUICK=1
SLIMEN=${SLIMEN:-.devbuild/slimen}
PY=${PY:-python3}
WORK=${WORK:-/tmp/gpu-measure}
if [ ! -x "$SLIMEN" ]; then
  mkdir -p "$(dirname "$SLIMEN")"
  go build -o "$SLIMEN" ./cmd/slimen
fi
export PYTHONPATH="$PWD/engines/torch${PYTHONPATH:+:$PYTHONPATH}"
rm -rf "$WORK"
mkdir -p "$WORK"
if [ "$QUICK" = 1 ]; then
  SHAPE=tiny BATCH=4 MAXLEN=8 STEPS=${STEPS:-4}
  where='device: cpu'
else
  SHAPE=${SHAPE:-qwen3-50m} BATCH=${BATCH:-8} MAXLEN=${MAXLEN:-32} STEPS=${STEPS:-3}
  # Both pinned to GPU 0: the placement shares it between them (--slots that add up).
  where='gpus: ["0"]'
fi
"$PY" -m slimen_torch make-model --shape "$SHAPE" --out "$WORK/model" >/dev/null
cat >"$WORK/config.yaml" <<EOF
policies:
  - name: generator
    hf_checkpoint: $WORK/model
    engine: {kind: torch, python: $PY, $where, args: [--max-seq-len, "512"]}
    train: {lr: 1.0e-4, advantage_estimator: grpo, global_batch_size: 0}
  - name: critic
    hf_checkpoint: $WORK/model
    engine: {kind: torch, python: $PY, $where, args: [--max-seq-len, "512"]}
    train: {lr: 1.0e-4, advantage_estimator: grpo, global_batch_size: 0}
rollout: {batch_size: $BATCH, max_response_len: $MAXLEN, temperature: 1.0}
data: {path: "synthetic:arith"}
run: {steps: $STEPS, seed: 1, save_interval: 1}
EOF

# Each line of the run's output with the time it came (for the restart's duration).
stamp() { while IFS= read -r l; do printf '%s %s\n' "$(date +%s.%N)" "$l"; done; }

echo "== placement" >&2
"$SLIMEN" gpus --config "$WORK/config.yaml" >"$WORK/placement.txt" 2>&1 || true
cat "$WORK/placement.txt" >&2

echo "== the debate: two workers sharing the device ($STEPS steps)" >&2
t0=$(date +%s.%N)
"$SLIMEN" exec examples/debate/debate.star --config "$WORK/config.yaml" --out "$WORK/debate" \
  2>&1 | stamp >"$WORK/debate.log"
t1=$(date +%s.%N)
echo "$t0 $t1" >"$WORK/debate.time"

echo "== the uninterrupted run" >&2
"$SLIMEN" exec engines/torch/parity.star --config "$WORK/config.yaml" --out "$WORK/clean" \
  >"$WORK/clean.log" 2>&1

echo "== the run with a worker SIGKILLed after step 1's checkpoint" >&2
"$SLIMEN" exec engines/torch/parity.star --config "$WORK/config.yaml" --out "$WORK/faulty" \
  > >(stamp >"$WORK/faulty.log") 2>&1 &
pid=$!
t0=$(date +%s.%N)
killed=""
while kill -0 "$pid" 2>/dev/null; do
  if [ -z "$killed" ] && [ -f "$WORK/faulty/checkpoints/step_1/MANIFEST.json" ]; then
    # One of the two workers (the lowest pid), whatever runs it (python, or torchrun).
    w=$(pgrep -P "$pid" -f slimen_torch | head -1 || true)
    if [ -n "$w" ]; then
      kill -9 "$w"
      killed="$(date +%s.%N) $w"
      echo "$killed" >"$WORK/killed"
      echo "killed worker pid $w" >&2
    fi
  fi
  sleep 0.05
done
rc=0
wait "$pid" || rc=$?
t1=$(date +%s.%N)
echo "$t0 $t1 $rc" >"$WORK/faulty.time"
sleep 0.5  # the stamping reader finishes

echo "== the gather of full weights" >&2
gather() {
  timeout 90 "$PY" -m torch.distributed.run --standalone --nproc-per-node "$1" engines/torch/bench_gather.py \
    --model "$WORK/model" "${@:2}" 2>"$WORK/gather.err" | tail -1
}
if [ "$QUICK" = 1 ]; then
  g=$(gather 2 --device cpu) && mode="2 ranks, gloo, CPU"
else
  ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
  if [ "$ngpu" -ge 2 ]; then
    g=$(gather 2 --device cuda) && mode="2 ranks, NCCL, 2 GPUs"
  elif g=$(gather 2 --device cuda --same-gpu --backend gloo) && [ -n "$g" ]; then
    mode="2 ranks, gloo, both on GPU 0 (NCCL refuses two ranks on one GPU)"
  else
    g=$(gather 1 --device cuda) && mode="1 rank, NCCL: the full_tensor path only (2 ranks with gloo on one GPU failed: $WORK/gather.err)"
  fi
fi
echo "$g" >"$WORK/gather.json"
echo "$mode" >"$WORK/gather.mode"

"$PY" - "$WORK" "$STEPS" <<'EOF' | tee "$WORK/table.md"
import json, math, pathlib, re, sys
work, steps = pathlib.Path(sys.argv[1]), int(sys.argv[2])

def lines(name):
    out = []
    for l in (work / name).read_text().splitlines():
        t, _, msg = l.partition(" ")
        out.append((float(t), msg))
    return out

def metrics(run):
    p = work / run / "metrics.jsonl"
    return [json.loads(l) for l in p.read_text().splitlines()] if p.exists() else []

rows = []
place = (work / "placement.txt").read_text().strip().splitlines()
rows.append(("placement", "; ".join(l.strip() for l in place if "policy" in l or "GPU" in l)[:300]
             or (place[0] if place else "?")))
debate = lines("debate.log")
for pol in ("generator", "critic"):
    m = [re.search(r"torch worker ready in ([0-9.]+)s", x) for _, x in debate if f'"{pol}"' in x]
    m = [x for x in m if x]
    rows.append((f"start-up of {pol}'s worker", f"{m[0].group(1)} s" if m else "?"))
c0, c1 = map(float, (work / "debate.time").read_text().split())
first = next((t for t, x in debate if x.startswith("step 1/")), None)
rows.append((f"debate ({steps} steps): to step 1 done / whole", f"{first - c0:.1f} s / {c1 - c0:.1f} s" if first else f"? / {c1 - c0:.1f} s"))
for pol in ("generator", "critic"):
    mem = [m["gpu_mem_gib"] for m in metrics("debate") if m.get("policy") == pol and "gpu_mem_gib" in m]
    util = [m["gpu_util"] for m in metrics("debate") if m.get("policy") == pol and "gpu_util" in m]
    rows.append((f"{pol}: GPU memory, utilisation (metrics)",
                 f"{max(mem):.2f} GiB, {sum(util) / len(util):.0f}%" if mem and util else
                 "absent (no NVML)"))
g = (work / "gather.json").read_text().strip()
mode = (work / "gather.mode").read_text().strip()
if g:
    g = json.loads(g)
    rows.append(("gather of full weights", f"{g['s_per_gb']} s/GB ({g['gather_s']} s for "
                 f"{g['gb']} GB {g['dtype']}; {mode})"))
else:
    rows.append(("gather of full weights", f"failed ({mode})"))
f0, f1, rc = (work / "faulty.time").read_text().split()
faulty = lines("faulty.log")
kp = work / "killed"
if kp.exists():
    tk = float(kp.read_text().split()[0])
    back = next((t for t, x in faulty if t > tk and "restarted as a new process" in x), None)
    rows.append(("SIGKILLed worker: kill → back in the run",
                 f"{back - tk:.1f} s" if back else "not seen"))
else:
    rows.append(("SIGKILLed worker", "no kill (the run ended before step 1's checkpoint?)"))
a, b = metrics("clean"), metrics("faulty")
timing = {"rollout_s", "train_s", "step_s", "tokens_per_s", "gpu_mem_gib", "gpu_used_gib", "gpu_util"}
worst, where = 0.0, ""
for x, y in zip(a, b):
    for k, v in x.items():
        if k in timing or not isinstance(v, (int, float)) or isinstance(v, bool):
            continue
        w = y.get(k)
        if not isinstance(w, (int, float)):
            worst, where = math.inf, f"{x['policy']}@{x['step']} {k}"
            continue
        d = abs(v - w) / max(1.0, abs(v))
        if d > worst:
            worst, where = d, f"{x['policy']}@{x['step']} {k}"
moved = sum(1 for x in a if x.get("grad_norm", 0) > 0 and x.get("step", 0) > 1)
rows.append(("faulty run", f"exit {rc}, {float(f1) - float(f0):.1f} s, {len(b)} metric lines "
             f"(uninterrupted {len(a)}, {moved} policy-steps after step 1 with a gradient); "
             f"largest relative difference {worst:.2g} {where}"))
print("| measure | value |\n|---|---|")
for k, v in rows:
    print(f"| {k} | {v} |")
EOF
