#!/usr/bin/env bash
# Issue 23's run on a machine of G GPUs (G from nvidia-smi): one Qwen3-0.6B-shaped policy (random
# weights, bf16) trained with GRPO by `slimen exec` over N = 1 and N = G GPUs (num_gpus_per_node: N,
# FSDP2 under torchrun, NCCL), with
#   1. `slimen gpus` and `slimen gpus --config` of each run, and where its worker's processes were
#      while it ran (nvidia-smi's process list, sampled every second): "placement matches: yes/no";
#   2. per N: optimizer-step time, trained tokens/s and MFU per GPU, generation tokens/s per GPU,
#      the gather of full weights after each optimizer step (events.log), scaling N=G against N=1;
#   3. one non-zero rank SIGKILLed after step 1's checkpoint (N=G): the group restarts, the run
#      completes, and its metrics against the uninterrupted N=G run's (same seed, save_interval 1).
# The script: one rollout per task, reward = parity of the first sampled token (random weights
# give random rewards; this one moves the weights every step), n_samples_per_prompt 4.
# Each part runs under a timeout cut from one budget (BUDGET s, default 500), so that a failure
# never eats the call: the table says which part failed, with the last lines of its log.
# Run from the repository root:
#
#   SLIMEN=.devbuild/slimen PY=python3 engines/torch/multi_gpu.sh           # the GPUs (~5 min on 2)
#   SLIMEN=.devbuild/slimen PY=python3 engines/torch/multi_gpu.sh --quick   # CPU: tiny, 2 gloo ranks
#
# Knobs (env): STEPS (3), PROMPTS (64), SAMPLES (4), MAXLEN (128 new tokens), SHAPE (qwen3-0.6b),
# COMPILE_TRAIN (off: the training layer eager, so that no run spends its budget compiling; block
# for the compiled layer), BUDGET (500 s), G (the GPU count, default from nvidia-smi), WORK
# (/tmp/multi-gpu: the runs, their logs and table.md). SLIMEN is built with cgo when missing
# (`slimen gpus` needs NVML).
set -uo pipefail
QUICK=0
[ "${1:-}" = --quick ] && QUICK=1
SLIMEN=${SLIMEN:-.devbuild/slimen}
PY=${PY:-python3}
WORK=${WORK:-/tmp/multi-gpu}
BUDGET=${BUDGET:-500}
COMPILE_TRAIN=${COMPILE_TRAIN:-off}
START=$(date +%s)
if [ ! -x "$SLIMEN" ]; then
  mkdir -p "$(dirname "$SLIMEN")"
  CGO_ENABLED=1 go build -o "$SLIMEN" ./cmd/slimen || exit 1
fi
export PYTHONPATH="$PWD/engines/torch${PYTHONPATH:+:$PYTHONPATH}"
# NVLink multicast stays off (the lent machines' rule; the workers inherit this environment).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
rm -rf "$WORK"
mkdir -p "$WORK/status"
if [ "$QUICK" = 1 ]; then
  G=${G:-2} SHAPE=${SHAPE:-tiny} PROMPTS=${PROMPTS:-4} SAMPLES=${SAMPLES:-4} MAXLEN=${MAXLEN:-8}
  STEPS=${STEPS:-3} DEV='device: cpu, ' PEAK=0
else
  G=${G:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')}
  SHAPE=${SHAPE:-qwen3-0.6b} PROMPTS=${PROMPTS:-64} SAMPLES=${SAMPLES:-4} MAXLEN=${MAXLEN:-128}
  STEPS=${STEPS:-3} DEV='' PEAK=989e12  # H100 SXM dense bf16
fi
echo "G=$G shape=$SHAPE batch $PROMPTS x $SAMPLES, $MAXLEN new tokens, $STEPS steps, compile-train $COMPILE_TRAIN" \
  >"$WORK/setup.txt"
cat "$WORK/setup.txt" >&2

# part NAME SECONDS CMD…: runs CMD under a timeout of at most SECONDS (less if the budget, minus
# 20 s kept for the table, has less left), its output in NAME.log; NAME's status: rc and seconds.
part() {
  local name=$1 want=$2
  shift 2
  local left=$((BUDGET - 20 - ($(date +%s) - START)))
  local t=$((want < left ? want : left))
  if [ "$t" -lt 10 ]; then
    echo "skipped 0 0" >"$WORK/status/$name"
    echo "== $name: skipped (the budget is spent)" >&2
    return 1
  fi
  echo "== $name (at most ${t}s)" >&2
  local t0 rc=0
  t0=$(date +%s.%N)
  timeout -k 10 "$t" "$@" >"$WORK/$name.log" 2>&1 || rc=$?
  echo "$rc $t $(awk "BEGIN{print $(date +%s.%N) - $t0}")" >"$WORK/status/$name"
  [ "$rc" = 0 ] || { echo "== $name: exit $rc" >&2; tail -5 "$WORK/$name.log" >&2; }
  return "$rc"
}

# The config of one policy over N GPUs (colocated: its worker trains and generates on them).
config() {
  cat <<EOF
policies:
  - name: solver
    hf_checkpoint: $WORK/model
    num_gpus_per_node: $1
    megatron_num_nodes: 1
    sglang_num_nodes: 0
    engine: {kind: torch, python: $PY, ${DEV}args: [--max-seq-len, "512", --compile-train, $COMPILE_TRAIN]}
    train: {lr: 1.0e-5, advantage_estimator: grpo, global_batch_size: 0, n_samples_per_prompt: $SAMPLES}
rollout: {batch_size: $PROMPTS, max_response_len: $MAXLEN, temperature: 1.0}
data: {path: "synthetic:arith"}
run: {steps: $STEPS, seed: 1, save_interval: $2, colocate: true}
EOF
}
cat >"$WORK/parity.star" <<'EOF'
def rollout(task):
    c = generate("solver", task.prompt)
    reward(c, float(c.tokens[0] % 2))
    train(c)
EOF

part make-model 120 "$PY" -m slimen_torch make-model --shape "$SHAPE" --out "$WORK/model"
config 1 0 >"$WORK/one.yaml"
config "$G" "${SAVE_INTERVAL:-1}" >"$WORK/many.yaml"

# ---- 1. the inventory and the placement of each config
part gpus 30 "$SLIMEN" gpus
for n in one many; do
  part "gpus-$n" 30 "$SLIMEN" gpus --config "$WORK/$n.yaml"
  sed -n '/^placement:/,$p' "$WORK/gpus-$n.log" >&2
done
if [ "$QUICK" = 1 ]; then
  # Nothing is placed on the CPU: print the plan of the GPU form of the N=G config on a saved
  # inventory of two H100s, so that the plan's path runs too.
  "$PY" - >"$WORK/machine.json" <<'EOF'
import json
print(json.dumps([{"Index": i, "UUID": f"GPU-{i}", "Name": "NVIDIA H100 80GB HBM3", "MemTotal": 85520809984,
                   "MemUsed": 0, "Util": 0, "Processes": []} for i in range(2)]))
EOF
  sed 's/device: cpu, //' "$WORK/many.yaml" >"$WORK/many-gpu.yaml"
  part gpus-saved 30 "$SLIMEN" gpus --machine "$WORK/machine.json" --config "$WORK/many-gpu.yaml"
fi

# sample NAME: nvidia-smi's compute processes (gpu uuid, pid, MiB) and each GPU's memory in use,
# every second, until killed.
sample() {
  nvidia-smi --query-gpu=index,uuid --format=csv,noheader >"$WORK/$1.uuids" 2>/dev/null || return 0
  while :; do
    t=$(date +%s)
    nvidia-smi --query-compute-apps=gpu_uuid,pid,used_memory --format=csv,noheader,nounits 2>/dev/null |
      sed "s/^/$t, /" >>"$WORK/$1.apps"
    nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits 2>/dev/null |
      sed "s/^/$t, /" >>"$WORK/$1.mem"
    sleep 1
  done
}
# Each line of a command's output with the time it came.
stamp() { while IFS= read -r l; do printf '%s %s\n' "$(date +%s.%N)" "$l"; done; }

# run NAME CONFIG SECONDS: slimen exec of the parity script, nvidia-smi sampled meanwhile.
run() {
  local name=$1 cfg=$2 want=$3 sp=""
  if [ "$QUICK" = 0 ]; then
    sample "$name" &
    sp=$!
  fi
  part "$name" "$want" "$SLIMEN" exec "$WORK/parity.star" --config "$WORK/$cfg.yaml" --out "$WORK/$name"
  local rc=$?
  [ -n "$sp" ] && kill "$sp" 2>/dev/null
  return "$rc"
}

# ---- 2. N = 1 and N = G, uninterrupted
run one one 150
run many many 170

# ---- 3. N = G with rank 1 SIGKILLed once step 1's checkpoint is written
faulty() {
  local killed="" run victim
  "$SLIMEN" exec "$WORK/parity.star" --config "$WORK/many.yaml" --out "$WORK/faulty" > >(stamp) 2>&1 &
  local pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    # Step 1 done (its checkpoint is written before its line): step 2 is under way.
    if [ -z "$killed" ] && grep -q ' step 1/' "$WORK/faulty.log" 2>/dev/null; then
      # A rank of the group other than 0: a child of the torchrun that slimen started (on one
      # GPU, where there is no group, the worker itself).
      run=$(pgrep -P "$pid" -f torch.distributed.run | head -1 || true)
      victim="" rank=""
      for r in $(pgrep -P "${run:-0}" -f slimen_torch || true); do
        if tr '\0' '\n' <"/proc/$r/environ" 2>/dev/null | grep -qx 'RANK=[1-9][0-9]*'; then
          victim=$r rank=$(tr '\0' '\n' <"/proc/$r/environ" | grep -x 'RANK=.*')
          break
        fi
      done
      if [ -z "$run" ] && [ "$G" = 1 ]; then
        victim=$(pgrep -P "$pid" -f slimen_torch | head -1 || true) rank="the-worker"
      fi
      if [ -n "$victim" ]; then
        last=$(ls "$WORK/faulty/checkpoints" 2>/dev/null | sort -t_ -k2 -n | tail -1)
        killed="$(date +%s.%N) $victim $rank ${last:-no-checkpoint}"
        kill -9 "$victim"
        echo "$killed" >"$WORK/killed"
        echo "$killed: SIGKILLed that rank (torchrun pid $run)"
      fi
    fi
    sleep 0.05
  done
  wait "$pid"
}
export -f faulty stamp
export SLIMEN WORK G
if [ "$QUICK" = 0 ]; then
  sample faulty &
  sp=$!
fi
part faulty 190 bash -c faulty
[ "$QUICK" = 0 ] && kill "$sp" 2>/dev/null

# ---- the table
"$PY" - "$WORK" "$G" "$STEPS" "$PEAK" "$QUICK" <<'EOF' | tee "$WORK/table.md"
import json, math, pathlib, re, struct, sys
work, G, steps, peak, quick = pathlib.Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), sys.argv[5] == "1"
rows = []

def status(name):
    p = work / "status" / name
    if not p.exists():
        return "not run"
    rc, t, took = p.read_text().split()
    if rc == "0":
        return ""
    log = work / f"{name}.log"
    tail = " / ".join(l.strip() for l in (log.read_text(errors="replace").splitlines()[-3:] if log.exists() else []))
    tail = tail.replace("|", "\\|")[:400]
    if rc == "skipped":
        return "skipped: the budget was spent"
    if rc in ("124", "137"):
        return f"**timed out** after {t} s; last lines: {tail}"
    return f"**failed** (exit {rc}); last lines: {tail}"

def metrics(run, pol="solver"):
    p = work / run / "metrics.jsonl"
    if not p.exists():
        return []
    return [m for m in map(json.loads, p.read_text().splitlines()) if m.get("policy") == pol]

def params():
    n = 0
    for f in (work / "model").glob("*.safetensors"):
        with open(f, "rb") as fh:
            h = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        n += sum(math.prod(v["shape"]) for k, v in h.items() if k != "__metadata__")
    return n

rows.append(("setup", (work / "setup.txt").read_text().strip()))
P = params() if (work / "model").exists() else 0
rows.append(("parameters P", f"{P:,}" if P else status("make-model") or "?"))
inv = (work / "gpus.log").read_text().strip().splitlines() if (work / "gpus.log").exists() else []
rows.append(("slimen gpus", status("gpus") or "; ".join(l.strip() for l in inv if l.startswith("GPU") or "no NVIDIA" in l)[:300]))

# ---- 1. placement: planned vs. where the processes were
def events(run):
    p = work / run / "events.log"
    return p.read_text(errors="replace") if p.exists() else ""

def planned(name):
    log = work / f"gpus-{name}.log"
    text = log.read_text() if log.exists() else ""
    m = re.search(r"^\s+solver: GPU ([0-9,]+) ", text, re.M)
    return (sorted(int(x) for x in m.group(1).split(",")) if m else None), text

def observed(run):
    uu = work / f"{run}.uuids"
    if not uu.exists():
        return None, "no nvidia-smi"
    index = {}
    for l in uu.read_text().splitlines():
        i, u = [x.strip() for x in l.split(",")]
        index[u] = int(i)
    seen = set()
    apps = work / f"{run}.apps"
    for l in (apps.read_text().splitlines() if apps.exists() else []):
        f = [x.strip() for x in l.split(",")]
        if len(f) >= 4 and f[1] in index:
            seen.add(index[f[1]])
    if seen:
        return sorted(seen), "nvidia-smi's process list"
    # No process listed (a container's PID namespace): the GPUs whose memory in use rose by 1 GiB.
    mem = {}
    p = work / f"{run}.mem"
    for l in (p.read_text().splitlines() if p.exists() else []):
        t, i, used = [x.strip() for x in l.split(",")]
        mem.setdefault(int(i), []).append(float(used))
    seen = sorted(i for i, v in mem.items() if v and max(v) - v[0] > 1024)
    return seen, "memory in use (no process listed)"

for name, run, n in (("one", "one", 1), ("many", "many", G)):
    plan, text = planned(name)
    st = status(f"gpus-{name}")
    if quick:
        rows.append((f"placement N={n}", st or "nothing placed on the CPU (no NVML)"))
        continue
    obs, how = observed(run)
    none = "? (slimen gpus --config printed no plan: " + (text.strip().splitlines() or ["nothing"])[-1][:120] + ")"
    line = f"planned GPU {','.join(map(str, plan)) if plan else none}; ran on GPU " \
           f"{','.join(map(str, obs)) if obs else '?'} ({how}); placement matches: " \
           f"{'yes' if plan and obs == plan[:n] else 'no'}"
    ranks = re.search(r"from \d+ ranks: ([^\n]*)", events(run))
    line += f"; the ranks said: {ranks.group(1).strip()}" if ranks else ""
    rows.append((f"placement N={n}", (st + "; " if st else "") + line))
if quick:
    plan, text = planned("saved")
    rows.append((f"plan on a saved 2-GPU inventory, N={G}", status("gpus-saved") or
                 (f"GPU {','.join(map(str, plan))}" if plan else text.strip()[:200])))

# ---- 2. throughput
def gathers(run):
    return [(float(gb), float(s)) for gb, s in
            re.findall(r"gathered the full weights \(([0-9.]+) GB fp32\) from \d+ ranks in ([0-9.]+) s", events(run))]

def mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")

res = {}
for run, n in (("one", 1), ("many", G)):
    st = status(run)
    ms = metrics(run)
    if st:
        rows.append((f"N={n}: run", st))
    if not ms:
        continue
    steady = [m for m in ms if m["step"] > 1] or ms
    tr_s = mean([m["train_s"] for m in steady])
    tok = mean([m["trained_tokens"] for m in steady])
    gen_tok = mean([m["tokens"] for m in steady])
    ro_s = mean([m["rollout_s"] for m in steady])
    tps = tok / tr_s / n
    gps = gen_tok / ro_s / n
    mfu = 6 * P * tok / tr_s / n / peak if peak else float("nan")
    res[n] = (tr_s, tps, gps)
    rows.append((f"N={n}: optimizer step (train_s, steps 2–{steps} mean; step 1)",
                 f"{tr_s:.3f} s for {tok:.0f} tokens; step 1 {ms[0]['train_s']:.1f} s"))
    rows.append((f"N={n}: trained tokens/s per GPU, MFU per GPU",
                 f"{tps:,.0f} tok/s, " + (f"{100 * mfu:.1f}%" if peak else "n/a on the CPU")))
    rows.append((f"N={n}: generation tokens/s per GPU (rollout_s)",
                 f"{gps:,.0f} tok/s ({gen_tok:.0f} tokens in {ro_s:.2f} s)"))
    g = gathers(run)
    rows.append((f"N={n}: gather of full weights after each step",
                 ", ".join(f"{s:.3f} s" for _, s in g) + (f" ({g[0][0]:.3f} GB fp32, {mean([s / gb for gb, s in g]):.3f} s/GB)" if g[0][0] > 0 else f" ({g[0][0]:.3f} GB fp32)")
                 if g else ("none: one rank generates from the weights it trains" if n == 1 else "no gather line in events.log")))
if 1 in res and G in res and G > 1:
    (t1, a1, g1), (tg, ag, gg) = res[1], res[G]
    rows.append((f"scaling N={G} vs N=1 (per-GPU rate / N=1's)",
                 f"training {100 * ag / a1:.0f}%, generation {100 * gg / g1:.0f}%; optimizer step N=1 / N={G}: {t1 / tg:.2f}×"))

# ---- 3. the SIGKILLed rank
st = status("faulty")
kp = work / "killed"
if kp.exists():
    tk, pid, rank, last = (kp.read_text().split() + ["?"] * 3)[:4]
    log = work / "faulty.log"
    back = None
    for l in (log.read_text(errors="replace").splitlines() if log.exists() else []):
        t, _, msg = l.partition(" ")
        try:
            t = float(t)
        except ValueError:
            continue
        if t > float(tk) and "restarted as a new process" in msg:
            back = t - float(tk)
            break
    rows.append((f"N={G}: rank SIGKILLed after step 1", f"pid {pid} ({rank}, newest checkpoint {last}); back in the run after "
                 + (f"{back:.1f} s" if back is not None else "? (no restart line)") + (f"; {st}" if st else "")))
else:
    rows.append((f"N={G}: rank SIGKILLed", st or "no kill: the run ended before step 1's checkpoint?"))
a, b = metrics("many"), metrics("faulty")
timing = {"rollout_s", "train_s", "step_s", "tokens_per_s", "gpu_mem_gib", "gpu_used_gib", "gpu_util",
          "engine_busy", "rollout_wall_s"}

def worst(pairs):
    w, where = 0.0, ""
    for x, y in pairs:
        for k, v in x.items():
            if k in timing or not isinstance(v, (int, float)) or isinstance(v, bool):
                continue
            u = y.get(k)
            d = math.inf if not isinstance(u, (int, float)) else abs(v - u) / max(1.0, abs(v))
            if d > w:
                w, where = d, f"{k}@{x['step']}"
    return f"{w:.2g} {where}".strip()

if a and b:
    pairs = list(zip(a, b))
    moved = sum(1 for x in b if x.get("grad_norm", 0) > 0)
    rows.append(("faulty vs uninterrupted N=" + str(G),
                 f"{len(b)} of {len(a)} policy-steps ({moved} with a gradient); largest relative difference: "
                 f"step 1 (before the kill: run-to-run noise) {worst(pairs[:1])}, steps 2–{steps} {worst(pairs[1:])}"))
print("| measure | value |\n|---|---|")
for k, v in rows:
    print(f"| {k} | {v} |")
if peak:
    print(f"\nMFU per GPU = 6 · P · trained tokens / train_s / N / {peak / 1e12:.0f} TFLOP/s (H100 and H200 SXM, dense bf16); "
          "train_s is the host's time of the policy's train call (forward, backward, optimizer step, gather).")
EOF
