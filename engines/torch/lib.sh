# Shell functions the GPU measurement scripts share (multi_gpu.sh, swarm_gpu.sh): source it from
# the repository root after setting SLIMEN, PY, WORK and BUDGET.
#
#   gpu_lib_init          builds SLIMEN (with cgo: `slimen gpus` needs NVML) when missing, puts
#                         engines/torch on PYTHONPATH, keeps NVLink multicast off, makes WORK afresh
#                         (WORK/status holds each part's outcome) and starts the budget's clock
#   part NAME S CMD…      CMD under a timeout cut from the budget, its output in WORK/NAME.log;
#                         when it fails, its last lines and its torch workers' (worker_tail)
#   worker_tail NAME [N]  the torch workers' last lines in the run folder WORK/NAME's events.log
#   sample NAME           nvidia-smi's compute processes and memory per GPU every second, until killed
#   stamp                 each line of its input with the time it came
#   torch_policy …        one torch policy of a config (YAML)
#   saved_inventory N     `slimen gpus --json` of a machine of N H100s, for --machine on the CPU
#
# engines/torch/gpu_runs.py reads what these write (the status files, the samples) for the tables.

gpu_lib_init() {
  START=$(date +%s)
  if [ ! -x "$SLIMEN" ]; then
    mkdir -p "$(dirname "$SLIMEN")"
    CGO_ENABLED=1 go build -o "$SLIMEN" ./cmd/slimen || return 1
  fi
  export PYTHONPATH="$PWD/engines/torch${PYTHONPATH:+:$PYTHONPATH}"
  # NVLink multicast stays off (the lent machines' rule; the workers inherit this environment).
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  rm -rf "$WORK"
  mkdir -p "$WORK/status"
}

# part NAME SECONDS CMD…: runs CMD under a timeout of at most SECONDS (less if the budget, minus
# 20 s kept for the table, has less left), its output in NAME.log; NAME's status: rc, the timeout
# and the seconds it took (rc "skipped" when the budget had less than 10 s left).
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
  [ "$rc" = 0 ] || { echo "== $name: exit $rc" >&2; tail -5 "$WORK/$name.log" >&2; worker_tail "$name" >&2; }
  return "$rc"
}

# worker_tail NAME [N]: the last N (40) lines of the torch workers' own output (stderr and stdout,
# which slimen writes to the run's events.log as 'policy "P": worker: …' lines) of part NAME's run
# folder WORK/NAME, under a heading; nothing when it has none.
worker_tail() {
  local ev="$WORK/$1/events.log" lines
  [ -f "$ev" ] || return 0
  lines=$(grep -F '": worker: ' "$ev" | tail -n "${2:-40}")
  [ -n "$lines" ] || return 0
  echo "-- $1: the torch workers' last lines ($ev):"
  printf '%s\n' "$lines"
}

# sample NAME: every second, nvidia-smi's compute processes (NAME.apps: time, gpu uuid, pid, MiB),
# each GPU's memory in use (NAME.mem: time, index, MiB) and the process tree (NAME.ps: time, pid,
# ppid: a rank or a compiler child is found under the worker that started it), until killed.
# Without nvidia-smi it returns at once.
sample() {
  nvidia-smi --query-gpu=index,uuid --format=csv,noheader >"$WORK/$1.uuids" 2>/dev/null || return 0
  local t
  while :; do
    t=$(date +%s)
    nvidia-smi --query-compute-apps=gpu_uuid,pid,used_memory --format=csv,noheader,nounits 2>/dev/null |
      sed "s/^/$t, /" >>"$WORK/$1.apps"
    nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits 2>/dev/null |
      sed "s/^/$t, /" >>"$WORK/$1.mem"
    ps -eo pid=,ppid= | awk -v t="$t" '{print t ", " $1 ", " $2}' >>"$WORK/$1.ps"
    sleep 1
  done
}

# Each line of a command's output with the time it came.
stamp() { while IFS= read -r l; do printf '%s %s\n' "$(date +%s.%N)" "$l"; done; }

# torch_policy NAME MODEL WHERE [TRAIN [MORE]]: one policy of a config's policies: list on a torch
# worker run by $PY. WHERE goes into engine: {kind: torch, python: $PY, WHERE} (its device, gpus
# and args); TRAIN is the train: map's content (default GRPO at lr 1e-5 with one optimizer step
# per step); MORE is further keys of the policy, one "key: value" per line.
torch_policy() {
  local train=${4:-"lr: 1.0e-5, advantage_estimator: grpo, global_batch_size: 0"}
  printf '  - name: %s\n    hf_checkpoint: %s\n    engine: {kind: torch, python: %s, %s}\n    train: {%s}\n' \
    "$1" "$2" "$PY" "$3" "$train"
  if [ -n "${5:-}" ]; then
    printf '%s\n' "$5" | sed 's/^/    /'
  fi
}

# saved_inventory N: the inventory of a machine of N H100 80GB (what `slimen gpus --json` prints,
# UUIDs GPU-0 …), so that the CPU runs place the GPU form of their configs with --machine.
saved_inventory() {
  local i sep=""
  printf '['
  for ((i = 0; i < $1; i++)); do
    printf '%s{"Index": %d, "UUID": "GPU-%d", "Name": "NVIDIA H100 80GB HBM3", "MemTotal": 85520809984, "MemUsed": 0, "Util": 0, "Processes": []}' \
      "$sep" "$i" "$i"
    sep=", "
  done
  printf ']\n'
}
