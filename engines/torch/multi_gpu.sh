#!/usr/bin/env bash
# Issue 23's run on a machine of G GPUs (G from nvidia-smi): one Qwen3-0.6B-shaped policy (random
# weights, bf16) trained with GRPO by `slimen exec` over N GPUs for each N of NS (default 1 and G;
# NS="1 2 4" on a 4-GPU machine runs all three in one call) (num_gpus_per_node: N, FSDP2 under
# torchrun, NCCL), with
#   1. `slimen gpus` and `slimen gpus --config` of each run, and where its worker's processes were
#      while it ran (nvidia-smi's process list, sampled every second): "placement matches: yes/no";
#   2. per N: optimizer-step time, trained tokens/s and MFU per GPU, generation tokens/s per GPU
#      (continuous on every rank: each request goes to a rank as it comes, no rounds), the gather
#      of full weights in bf16 after each optimizer step (events.log), scaling against N=1;
#   3. one non-zero rank SIGKILLed after step 1's checkpoint (the largest N): the group restarts,
#      the run completes, and its metrics against the uninterrupted run's (same seed); the time
#      from the kill to the run going on, and its parts (gpu_runs.RESTART_MILESTONES: rank 0
#      exited, torchrun's new group up, rank 0 listening, the ranks met, the worker ready, the
#      checkpoint loaded).
# Weak scaling by default: the run over N GPUs has PROMPTS×N prompts a step, so each GPU has the
# work of the N=1 run and the per-GPU rates compare like for like (SCALING=strong: PROMPTS for
# all; each GPU then has 1/N of the work and the fixed costs weigh N times more). The rates are means over
# the steps after the first WARMUP (compilation, CUDA graphs, the allocator growing). Only the run
# with the SIGKILL saves a checkpoint every step (its restart needs step 1's; ~20 s each for
# 0.6B's weights and AdamW state): the others write only the one every run writes at its end.
# The script: one rollout per task, reward = parity of the first sampled token (random weights
# give random rewards; this one moves the weights every step), n_samples_per_prompt 4.
# Each part runs under a timeout cut from one budget (BUDGET s, default 540), so that a failure
# never eats the call: the table says which part failed, with the last lines of its log and of
# its torch workers' own output (events.log), which the script's stderr shows too (more of them).
# Run from the repository root:
#
#   SLIMEN=.devbuild/slimen PY=python3 engines/torch/multi_gpu.sh           # the GPUs (~6 min on 2)
#   SLIMEN=.devbuild/slimen PY=python3 NS="1 2 4" engines/torch/multi_gpu.sh   # 4 GPUs (~8 min)
#   SLIMEN=.devbuild/slimen PY=python3 engines/torch/multi_gpu.sh --quick   # CPU: tiny, 2 gloo ranks
#
# Knobs (env): NS ("1 G"), STEPS (5), WARMUP (2), FAULTY (1; 0 skips part 3), FAULTY_STEPS (3: the
# killed run's steps), PROFILE (a step K: each uninterrupted run's ranks profile step K, its
# rollouts and its training call, into WORK/profile-nN, slimen_torch/profiling.py), PROMPTS
# (64: per GPU with weak scaling), SCALING (weak | strong), SAMPLES (4), MAXLEN (128 new tokens), SHAPE
# (qwen3-0.6b), MBT (the worker's --micro-batch-tokens; default its own, 16,384 on a GPU),
# COMPILE_TRAIN (block: the training layer compiled, under FSDP2 too; ~16 s of a
# one-GPU worker's first step cold, ~5 s warm; off for the eager layer), ALT (settings of the
# worker's environment to compare, ";" between settings, e.g. "SLIMEN_TORCH_FSDP_GROUP_MB=96;
# SLIMEN_TORCH_FSDP_GROUP_MB=96 SLIMEN_TORCH_FSDP_LOCAL_OPT=1": for each N > 1 of NS, one more
# uninterrupted run with each setting, nNaK for the K-th, its rows after N's; the sharded step's
# switches are dist.py's SLIMEN_TORCH_FSDP_*; SLIMEN_TORCH_PREFORK=1 in the environment forks
# the ranks from a process that has imported them, prefork.py: the killed rank's return without
# the imports), BUDGET (540 s), G (the GPU count, default from
# nvidia-smi), WORK (/tmp/multi-gpu: the runs, their logs and table.md). SLIMEN is built with cgo
# when missing (`slimen gpus` needs NVML). engines/torch/lib.sh and gpu_runs.py hold what this
# shares with swarm_gpu.sh.
set -uo pipefail
QUICK=0
[ "${1:-}" = --quick ] && QUICK=1
SLIMEN=${SLIMEN:-.devbuild/slimen}
PY=${PY:-python3}
WORK=${WORK:-/tmp/multi-gpu}
BUDGET=${BUDGET:-540}
COMPILE_TRAIN=${COMPILE_TRAIN:-block}
SCALING=${SCALING:-weak}
. engines/torch/lib.sh
gpu_lib_init || exit 1
if [ "$QUICK" = 1 ]; then
  G=${G:-2} SHAPE=${SHAPE:-tiny} PROMPTS=${PROMPTS:-4} SAMPLES=${SAMPLES:-4} MAXLEN=${MAXLEN:-8}
  DEV='device: cpu, ' PEAK=0
else
  G=${G:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')}
  SHAPE=${SHAPE:-qwen3-0.6b} PROMPTS=${PROMPTS:-64} SAMPLES=${SAMPLES:-4} MAXLEN=${MAXLEN:-128}
  DEV='' PEAK=989e12  # H100 SXM dense bf16
fi
STEPS=${STEPS:-5} WARMUP=${WARMUP:-2} FAULTY_STEPS=${FAULTY_STEPS:-3} FAULTY=${FAULTY:-1}
NS=${NS:-$(printf '%s\n' 1 "$G" | sort -nu | tr '\n' ' ')}
NMAX=0
for n in $NS; do
  if ! [[ "$n" =~ ^[1-9][0-9]*$ ]] || [ "$n" -gt "$G" ]; then
    echo "NS=\"$NS\": each N must be a GPU count from 1 to G=$G" >&2
    exit 2
  fi
  NMAX=$((n > NMAX ? n : NMAX))
done
# prompts N: the prompts of a step over N GPUs.
prompts() {
  case "$SCALING" in
    weak) echo $((PROMPTS * $1)) ;;
    strong) echo "$PROMPTS" ;;
  esac
}
case "$SCALING" in
  weak | strong) ;;
  *) echo "SCALING=$SCALING: give weak or strong" >&2; exit 2 ;;
esac
{
  printf 'G=%s shape=%s; %s scaling:' "$G" "$SHAPE" "$SCALING"
  for n in $NS; do printf ' N=%s %s prompts x %s samples a step;' "$n" "$(prompts "$n")" "$SAMPLES"; done
  echo " $MAXLEN new tokens; $STEPS steps, rates over the steps after step $WARMUP; compile-train $COMPILE_TRAIN"
} >"$WORK/setup.txt"
cat "$WORK/setup.txt" >&2

# config N PROMPTS STEPS SAVE_INTERVAL: one policy over N GPUs (colocated: its worker trains and
# generates on them).
config() {
  echo "policies:"
  torch_policy solver "$WORK/model" "${DEV}args: [--max-seq-len, \"512\", --compile-train, $COMPILE_TRAIN${MBT:+, --micro-batch-tokens, \"$MBT\"}]" \
    "lr: 1.0e-5, advantage_estimator: grpo, global_batch_size: 0, n_samples_per_prompt: $SAMPLES" \
    "num_gpus_per_node: $1
megatron_num_nodes: 1
sglang_num_nodes: 0"
  cat <<EOF
rollout: {batch_size: $2, max_response_len: $MAXLEN, temperature: 1.0}
data: {path: "synthetic:arith"}
run: {steps: $3, seed: 1, save_interval: $4, colocate: true}
EOF
}
cat >"$WORK/parity.star" <<'EOF'
def rollout(task):
    c = generate("solver", task.prompt)
    reward(c, float(c.tokens[0] % 2))
    train(c)
EOF

part make-model 120 "$PY" -m slimen_torch make-model --shape "$SHAPE" --out "$WORK/model"
for n in $NS; do
  config "$n" "$(prompts "$n")" "$STEPS" 0 >"$WORK/n$n.yaml"
done
config "$NMAX" "$(prompts "$NMAX")" "$FAULTY_STEPS" 1 >"$WORK/faulty.yaml"

# ---- 1. the inventory and the placement of each config
part gpus 30 "$SLIMEN" gpus
for n in $NS; do
  part "gpus-n$n" 30 "$SLIMEN" gpus --config "$WORK/n$n.yaml"
  sed -n '/^placement:/,$p' "$WORK/gpus-n$n.log" >&2
done
if [ "$QUICK" = 1 ]; then
  # Nothing is placed on the CPU: print the plan of the GPU form of the largest N's config on a
  # saved inventory of G H100s, so that the plan's path runs too.
  saved_inventory "$G" >"$WORK/machine.json"
  sed 's/device: cpu, //' "$WORK/n$NMAX.yaml" >"$WORK/n$NMAX-gpu.yaml"
  part gpus-saved 30 "$SLIMEN" gpus --machine "$WORK/machine.json" --config "$WORK/n$NMAX-gpu.yaml"
fi

# run NAME SECONDS: slimen exec of the parity script with NAME.yaml, nvidia-smi sampled meanwhile.
run() {
  local name=$1 want=$2 sp=""
  if [ "$QUICK" = 0 ]; then
    sample "$name" &
    sp=$!
  fi
  SLIMEN_TORCH_PROFILE=${PROFILE:+$WORK/profile-$name:$PROFILE} \
    part "$name" "$want" "$SLIMEN" exec "$WORK/parity.star" --config "$WORK/$name.yaml" --out "$WORK/$name"
  local rc=$?
  [ -n "$sp" ] && kill "$sp" 2>/dev/null
  return "$rc"
}

# ---- 2. each N, uninterrupted; then each N > 1 again with each setting of ALT
for n in $NS; do
  run "n$n" 200
done
IFS=';' read -ra ALTS <<<"${ALT:-}"
for n in $NS; do
  [ "$n" -gt 1 ] || continue
  k=0
  for alt in "${ALTS[@]}"; do
    [ -n "${alt// /}" ] || continue
    k=$((k + 1))
    cp "$WORK/n$n.yaml" "$WORK/n${n}a$k.yaml"
    echo "$alt" >"$WORK/n${n}a$k.alt"
    (
      # shellcheck disable=SC2086  # the setting's words are assignments
      export $alt
      run "n${n}a$k" 200
    )
  done
done

# ---- 3. the largest N with rank 1 SIGKILLed once step 1's checkpoint is written
faulty() {
  local killed="" run victim
  "$SLIMEN" exec "$WORK/parity.star" --config "$WORK/faulty.yaml" --out "$WORK/faulty" > >(stamp) 2>&1 &
  local pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    # Step 1 done (its checkpoint is written before its line): step 2 is under way.
    if [ -z "$killed" ] && grep -q ' step 1/' "$WORK/faulty.log" 2>/dev/null; then
      # A rank of the group other than 0, from its first line in the worker's log ("serve:
      # process PID began (rank R of N)"): a child of the torchrun that slimen started, or of
      # its fork server (SLIMEN_TORCH_PREFORK=1, slimen_torch/prefork.py), whose environment
      # and command line are the fork server's (on one GPU, where there is no group, the
      # worker itself).
      run=$(pgrep -P "$pid" -f torch.distributed.run | head -1 || true)
      victim="" rank=""
      r=$(grep -o 'serve: process [0-9]* began (rank [1-9][0-9]* of' "$WORK/faulty/events.log" \
        2>/dev/null | tail -1)
      if [ -n "$r" ] && [ -n "$run" ]; then
        victim=$(echo "$r" | cut -d' ' -f3) rank="RANK=$(echo "$r" | cut -d' ' -f6)"
      fi
      if [ -z "$run" ] && [ "$NMAX" = 1 ]; then
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
export SLIMEN WORK NMAX
if [ "$FAULTY" = 1 ]; then
  if [ "$QUICK" = 0 ]; then
    sample faulty &
    sp=$!
  fi
  part faulty 200 bash -c faulty
  [ "$QUICK" = 0 ] && kill "$sp" 2>/dev/null
fi

# ---- the table
"$PY" - "$WORK" "$G" "$STEPS" "$WARMUP" "$PEAK" "$QUICK" "$NS" <<'EOF' | tee "$WORK/table.md"
import math, re, sys
from gpu_runs import Work, mean, params, steady, steps_label, table
w = Work(sys.argv[1])
G, steps, warmup, peak, quick = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]), sys.argv[6] == "1"
NS = [int(x) for x in sys.argv[7].split()]
NMAX = max(NS)
rows = [("setup", (w.path / "setup.txt").read_text().strip())]
P = params(w.path / "model") if (w.path / "model").exists() else 0
rows.append(("parameters P", f"{P:,}" if P else w.status("make-model") or "?"))
inv = w.log("gpus").strip().splitlines()
rows.append(("slimen gpus", w.status("gpus") or "; ".join(l.strip() for l in inv if l.startswith("GPU") or "no NVIDIA" in l)[:300]))

# ---- 1. placement: planned vs. where the processes were
for n in NS:
    name = f"n{n}"
    st = w.status(f"gpus-{name}")
    if quick:
        rows.append((f"placement N={n}", st or "nothing placed on the CPU (no NVML)"))
        continue
    line = w.placement(f"gpus-{name}", name)
    ranks = re.search(r"from \d+ ranks: ([^\n]*)", w.events(name))
    line += f"; the ranks said: {ranks.group(1).strip()}" if ranks else ""
    rows.append((f"placement N={n}", (st + "; " if st else "") + line))
if quick:
    plan = w.planned("gpus-saved")
    rows.append((f"plan on a saved {G}-GPU inventory, N={NMAX}", w.status("gpus-saved") or
                 (f"GPU {','.join(map(str, plan['solver']))}" if "solver" in plan else w.log("gpus-saved").strip()[:200])))

# ---- 2. throughput
def gathers(run):
    return [(float(gb), float(s), dt) for gb, dt, s in
            re.findall(r"gathered the full weights \(([0-9.]+) GB (\w+)\) from \d+ ranks in ([0-9.]+) s", w.events(run))]

# Each N's run, then each N > 1 again with each setting of ALT (nNaK, its setting in nNaK.alt).
runs = [(n, f"n{n}", f"N={n}") for n in NS]
for n in NS:
    k = 1
    while n > 1 and (w.path / f"n{n}a{k}.alt").exists():
        alt = (w.path / f"n{n}a{k}.alt").read_text().strip()
        rows.append((f"N={n} a{k}", f"N={n} again with {alt}"))
        runs.append((n, f"n{n}a{k}", f"N={n} a{k}"))
        k += 1
res = {}
for n, run, label in runs:
    st = w.status(run)
    ms = w.metrics(run, "solver")
    if st:
        rows.append((f"{label}: run", st))
    if not ms:
        continue
    ss = steady(ms, warmup)
    tr_s = mean(m["train_s"] for m in ss)
    tok = mean(m["trained_tokens"] for m in ss)
    gen_tok = mean(m["tokens"] for m in ss)
    ro_s = mean(m["rollout_s"] for m in ss)
    tps = tok / tr_s / n
    gps = gen_tok / ro_s / n
    mfu = 6 * P * tok / tr_s / n / peak if peak else float("nan")
    res[run] = (tr_s, tps, gps)
    rows.append((f"{label}: optimizer step (train_s, {steps_label(ss)}; step 1)",
                 f"{tr_s:.3f} s for {tok:.0f} tokens; step 1 {ms[0]['train_s']:.1f} s"
                 + "".join(f", step {m['step']} {m['train_s']:.2f} s" for m in ms[1:] if m not in ss)))
    rows.append((f"{label}: trained tokens/s per GPU, MFU per GPU",
                 f"{tps:,.0f} tok/s, " + (f"{100 * mfu:.1f}%" if peak else "n/a on the CPU")))
    rows.append((f"{label}: generation tokens/s per GPU (rollout_s)",
                 f"{gps:,.0f} tok/s ({gen_tok:.0f} tokens in {ro_s:.2f} s)"))
    g = gathers(run)
    rows.append((f"{label}: gather of full weights after each step",
                 ", ".join(f"{s:.3f} s" for _, s, _ in g) + (f" ({g[0][0]:.3f} GB {g[0][2]}, {mean(s / gb for gb, s, _ in g):.3f} s/GB)" if g[0][0] > 0 else f" ({g[0][0]:.3f} GB {g[0][2]})")
                 if g else ("none: one rank generates from the weights it trains" if n == 1 else "no gather line in events.log")))
for n, run, label in runs:
    if n > 1 and "n1" in res and run in res:
        (t1, a1, g1), (tg, ag, gg) = res["n1"], res[run]
        rows.append((f"scaling {label} vs N=1 (per-GPU rate / N=1's)",
                     f"training {100 * ag / a1:.0f}%, generation {100 * gg / g1:.0f}%; optimizer step {label} / N=1: {tg / t1:.2f}×"))

# ---- 3. the SIGKILLed rank
st = w.status("faulty")
kp = w.path / "killed"
if not (w.path / "faulty.log").exists():
    rows.append((f"N={NMAX}: rank SIGKILLed", "not run (FAULTY=0)"))
elif kp.exists():
    tk, pid, rank, last = (kp.read_text().split() + ["?"] * 3)[:4]
    back = None
    for l in w.log("faulty").splitlines():
        t, _, msg = l.partition(" ")
        try:
            t = float(t)
        except ValueError:
            continue
        if t > float(tk) and "restarted as a new process" in msg:
            back = t - float(tk)
            break
    rows.append((f"N={NMAX}: rank SIGKILLed after step 1", f"pid {pid} ({rank}, newest checkpoint {last}); back in the run after "
                 + (f"{back:.1f} s" if back is not None else "? (no restart line)") + (f"; {st}" if st else "")))
    parts, prev = [], 0.0
    for name, at in w.restart("faulty", float(tk)):
        parts.append(f"{name} +{at - prev:.2f} s ({at:.2f})")
        prev = at
    rows.append((f"N={NMAX}: the return, part by part (+ s since the last; s since the kill)",
                 "; ".join(parts) or "no milestone found after the kill"))
else:
    rows.append((f"N={NMAX}: rank SIGKILLed", st or "no kill: the run ended before step 1's checkpoint?"))
a, b = w.metrics(f"n{NMAX}", "solver"), w.metrics("faulty", "solver")
timing = {"rollout_s", "train_s", "step_s", "tokens_per_s", "gpu_mem_gib", "gpu_used_gib", "gpu_util",
          "engine_busy", "rollout_wall_s"}

def worst(pairs):
    worst_d, where = 0.0, ""
    for x, y in pairs:
        for k, v in x.items():
            if k in timing or not isinstance(v, (int, float)) or isinstance(v, bool):
                continue
            u = y.get(k)
            d = math.inf if not isinstance(u, (int, float)) else abs(v - u) / max(1.0, abs(v))
            if d > worst_d:
                worst_d, where = d, f"{k}@{x['step']}"
    return f"{worst_d:.2g} {where}".strip()

if a and b:
    pairs = list(zip(a, b))
    moved = sum(1 for x in b if x.get("grad_norm", 0) > 0)
    rows.append((f"faulty ({len(b)} steps, a checkpoint each) vs uninterrupted N={NMAX}",
                 f"{len(b)} policy-steps ({moved} with a gradient); largest relative difference: "
                 f"step 1 (before the kill: run-to-run noise) {worst(pairs[:1])}, "
                 f"{'step 2' if len(pairs) == 2 else f'steps 2–{len(pairs)}'} {worst(pairs[1:])}"))
print(table(rows), end="")
if peak:
    print(f"\nMFU per GPU = 6 · P · trained tokens / train_s / N / {peak / 1e12:.0f} TFLOP/s (H100 and H200 SXM, dense bf16); "
          "train_s is the host's time of the policy's train call (forward, backward, optimizer step, gather).")
EOF
