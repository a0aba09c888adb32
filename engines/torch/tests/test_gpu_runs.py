"""gpu_runs.py, the tables of multi_gpu.sh and swarm_gpu.sh: the placement `slimen gpus --config`
printed against where nvidia-smi saw each policy's worker (by the pids events.log gives, through
the process tree for ranks), and the fallback on memory where nvidia-smi lists no process."""

import pytest

import gpu_runs

PLAN = """GPU 0  NVIDIA H100 80GB HBM3  GPU-a  memory 0.0 MiB used of 79.6 GiB (79.6 GiB free)  utilisation 0%

placement: actor 0 GPUs, rollout 0, total 0 = actor + rollout (not colocated); this machine has 2
  a0: GPU 0 (engine.gpus), CUDA_VISIBLE_DEVICES=0
    memory about 1.0 GiB: weights 0.1 GiB
    LoRA adapters in it: "a1", "a2"
  b: GPU 1 (engine.gpus), CUDA_VISIBLE_DEVICES=1
    memory about 1.0 GiB: weights 0.1 GiB
  group: GPU 0,1 (placement), CUDA_VISIBLE_DEVICES=0,1
    memory about 1.0 GiB: weights 0.1 GiB
"""

EVENTS = """2026-11-25T10:00:00Z policy "a0": starting a torch worker: python3 -m slimen_torch serve --model /m/base, on device
2026-11-25T10:00:05Z policy "a0": torch worker ready in 5.0s (pid 100)
2026-11-25T10:00:05Z policy "a1": a LoRA adapter on the torch worker of /m/base that another policy of the run started
2026-11-25T10:00:05Z policy "a2": a LoRA adapter on the torch worker of /m/base that another policy of the run started
2026-11-25T10:00:05Z policy "b": starting a torch worker: python3 -m slimen_torch serve --model /m/b, on device
2026-11-25T10:00:09Z policy "b": torch worker ready in 4.0s (pid 200)
2026-11-25T10:00:09Z policy "group": starting a torch worker: python3 -m torch.distributed.run --nproc-per-node 2 -m slimen_torch serve (FSDP2 over 2 ranks) --model /m/g, on device
2026-11-25T10:00:20Z policy "group": torch worker ready in 11.0s (pid 300)
2026-11-25T10:01:00Z policy "b": the torch worker (pid 200) exited: signal: killed
2026-11-25T10:01:01Z policy "b": the torch worker is started again on 127.0.0.1:4 (restart 1 of at most 3, pid 201)
"""


def work(tmp_path, apps, mem="", ps=""):
    (tmp_path / "gpus-x.log").write_text(PLAN)
    (tmp_path / "x").mkdir(exist_ok=True)
    (tmp_path / "x" / "events.log").write_text(EVENTS)
    (tmp_path / "x.uuids").write_text("0, GPU-a\n1, GPU-b\n")
    (tmp_path / "x.apps").write_text(apps)
    (tmp_path / "x.mem").write_text(mem)
    # The group's ranks 301 and 302 are children of its torchrun (300); 303 is a child of a rank.
    (tmp_path / "x.ps").write_text(ps or "1, 300, 9\n1, 301, 300\n1, 302, 300\n1, 303, 302\n1, 100, 9\n1, 201, 9\n")
    return gpu_runs.Work(tmp_path)


def test_plan_lists_adapters_with_their_worker(tmp_path):
    w = work(tmp_path, "")
    assert w.planned("gpus-x") == {"a0": [0], "a1": [0], "a2": [0], "b": [1], "group": [0, 1]}
    pids = w.worker_pids("x")
    assert pids["a1"] == [100] and pids["b"] == [200, 201] and pids["group"] == [300]


def test_placement_matches_by_pid(tmp_path):
    # The LoRA worker on GPU 0, b's restarted process on GPU 1, the group's ranks on 0 and 1.
    apps = "1, GPU-a, 100, 900\n1, GPU-b, 201, 900\n1, GPU-a, 301, 900\n1, GPU-b, 302, 900\n2, GPU-b, 303, 10\n"
    line = work(tmp_path, apps).placement("gpus-x", "x")
    assert line.endswith("placement matches: yes"), line
    assert "ran on GPU 0: a0, a1, a2; GPU 1: b; GPU 0,1: group" in line


def test_placement_mismatch_is_said(tmp_path):
    # b's worker ran on GPU 0, not the planned GPU 1.
    apps = "1, GPU-a, 100, 900\n1, GPU-a, 201, 900\n1, GPU-a, 301, 900\n1, GPU-b, 302, 900\n"
    line = work(tmp_path, apps).placement("gpus-x", "x")
    assert line.endswith("placement matches: no"), line
    assert "ran on GPU 0: a0, a1, a2, b; GPU 0,1: group" in line


def test_no_process_listed_falls_back_on_memory(tmp_path):
    mem = "1, 0, 10\n1, 1, 10\n2, 0, 5000\n2, 1, 4000\n"
    line = work(tmp_path, "", mem).placement("gpus-x", "x")
    assert "GPUs whose memory in use rose ≥ 1 GiB: 0,1" in line and line.endswith("placement matches: yes"), line
    line = work(tmp_path, "", "1, 0, 10\n1, 1, 10\n2, 0, 5000\n2, 1, 20\n").placement("gpus-x", "x")
    assert line.endswith("placement matches: no"), line


def test_status_and_steady(tmp_path):
    w = gpu_runs.Work(tmp_path)
    (tmp_path / "status").mkdir()
    (tmp_path / "status" / "ok").write_text("0 100 3.5\n")
    (tmp_path / "status" / "slow").write_text("124 100 100.2\n")
    (tmp_path / "slow.log").write_text("a\nb | c\nd\n")
    assert w.status("ok") == "" and w.status("missing") == "not run"
    assert w.status("slow") == "**timed out** after 100 s; last lines: a / b \\| c / d"
    lines = [{"step": s} for s in range(1, 6)]
    assert [m["step"] for m in gpu_runs.steady(lines, 2)] == [3, 4, 5]
    assert gpu_runs.steady(lines[:2], 2) == [{"step": 2}]
    assert gpu_runs.steps_label(gpu_runs.steady(lines, 2)) == "steps 3–5 mean"


def test_placement_without_worker_pids(tmp_path):
    # An older binary's events.log: no pid on the ready lines; the GPUs with processes are compared.
    w = work(tmp_path, "1, GPU-a, 100, 900\n1, GPU-b, 201, 900\n")
    ev = tmp_path / "x" / "events.log"
    ev.write_text(ev.read_text().replace(" (pid 100)", "").replace(" (pid 200)", "").replace(" (pid 300)", "")
                  .replace(", pid 201)", ")"))
    line = w.placement("gpus-x", "x")
    assert "GPUs with processes: 0,1" in line and line.endswith("placement matches: yes"), line


HUNG = """2026-11-28T13:20:01Z policy "solver": starting a torch worker: python3 -m torch.distributed.run --nproc-per-node 4 -m slimen_torch serve (FSDP2 over 4 ranks) --model /m, on device
2026-11-28T13:20:02Z policy "solver": worker: 
""" + "".join(f'2026-11-28T13:20:0{i}Z policy "solver": worker: line {i} | of the worker\n' for i in range(3, 10)) + \
    """2026-11-28T13:20:10Z policy "solver": worker:   File "dist.py", line 130 in init
2026-11-28T13:20:11Z policy "solver": the torch worker (pid 7) exited: signal: killed
"""


def test_a_failed_run_shows_its_workers_last_lines(tmp_path):
    """A run that timed out or failed shows, beside slimen's last lines, the last lines of its
    torch workers' own output (events.log's worker lines), in the table (gpu_runs) and on the
    script's stderr (lib.sh's worker_tail, which part calls)."""
    import pathlib
    import subprocess

    (tmp_path / "status").mkdir()
    (tmp_path / "status" / "n4").write_text("124 200 200.1\n")
    (tmp_path / "n4.log").write_text('policy "solver": starting a torch worker\n')
    (tmp_path / "n4").mkdir()
    (tmp_path / "n4" / "events.log").write_text(HUNG)
    st = gpu_runs.Work(tmp_path).status("n4")
    assert st.startswith("**timed out** after 200 s; last lines: policy \"solver\": starting a torch worker; "
                         "the torch workers' last lines (events.log): solver: line 3 \\| of the worker / "), st
    assert st.endswith("solver: line 9 \\| of the worker / solver: File \"dist.py\", line 130 in init"), st
    assert "exited" not in st and "line 2" not in st  # slimen's own lines and the 8 before the last
    (tmp_path / "status" / "n2").write_text("124 200 200.1\n")  # no run folder: slimen's lines only
    assert "workers" not in gpu_runs.Work(tmp_path).status("n2")

    root = pathlib.Path(__file__).resolve().parents[3]
    out = subprocess.run(["bash", "-c", '. engines/torch/lib.sh && worker_tail n4 3 && worker_tail n2'],
                         cwd=root, env={"WORK": str(tmp_path), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, check=True).stdout
    assert out == (f"-- n4: the torch workers' last lines ({tmp_path}/n4/events.log):\n"
                   + "".join(f'2026-11-28T13:20:0{i}Z policy "solver": worker: line {i} | of the worker\n'
                             for i in (8, 9))
                   + '2026-11-28T13:20:10Z policy "solver": worker:   File "dist.py", line 130 in init\n'), out


def test_placement_of_a_worker_that_never_became_ready(tmp_path):
    # Issue 37's N=4 run: the ranks held their GPUs, but no ready line ever named the worker's pid.
    w = work(tmp_path, "1, GPU-a, 301, 900\n1, GPU-b, 302, 900\n")
    (tmp_path / "x" / "events.log").write_text(HUNG)
    line = w.placement("gpus-x", "x")
    assert "GPUs with processes: 0,1 (events.log names no worker pid: no torch worker became ready)" in line, line


def test_restart_milestones(tmp_path):
    """A killed rank's return, milestone by milestone: the host's stamped lines and the workers'
    own log lines (local time, to the ms) after the kill; the first start's lines do not count."""
    import time
    killed = time.mktime(time.strptime("2026-11-28 21:24:28", "%Y-%m-%d %H:%M:%S")) + 0.126
    (tmp_path / "f").mkdir()
    (tmp_path / "f.log").write_text(
        f"{killed - 1:.3f} step 1/3 · reward\n"
        f"{killed + 2.29:.3f} policy \"s\": the torch worker (pid 5190) exited: exit status 1\n"
        f"{killed + 2.30:.3f} policy \"s\": the torch worker is started again on 127.0.0.1:1\n"
        f"{killed + 19.1:.3f} policy \"s\": its torch worker restarted as a new process (i)\n")
    w = 'T policy "s": worker: 2026-11-28 '
    (tmp_path / "f" / "events.log").write_text("".join(w + l + "\n" for l in [
        "21:24:24,791 slimen_torch INFO listening on 127.0.0.1:1 (loading m)",
        "21:24:26,986 slimen_torch INFO rank 0 of 2 (local rank 0) on cpu",
        "21:24:27,200 slimen_torch INFO serving m on 127.0.0.1:1 from 2 ranks: a, b",
        "21:24:28,226 slimen_torch INFO rank 1 gone: exiting at once",
        "21:24:34,503 slimen_torch INFO serve: process 6060 began (rank 1 of 2)",
        "21:24:34,611 slimen_torch INFO serve: process 6061 began (rank 0 of 2)",
        "21:24:46,078 slimen_torch INFO listening on 127.0.0.1:1 (loading m)",
        "21:24:46,094 slimen_torch INFO rank 1 of 2 (local rank 1) on cpu",
        "21:24:46,114 slimen_torch INFO rank 0 of 2 (local rank 0) on cpu",
        "21:24:46,325 slimen_torch INFO serving m on 127.0.0.1:1 from 2 ranks: a, b"]))
    got = gpu_runs.Work(tmp_path).restart("f", killed)
    names = [n for n, _ in got]
    assert names == [n for _, _, n in gpu_runs.RESTART_MILESTONES]
    want = [0.1, 2.29, 2.30, 6.377, 17.952, 17.968, 18.199, 19.1]
    assert [round(s, 3) for _, s in got] == pytest.approx(want, abs=2e-3)
    assert gpu_runs.Work(tmp_path).restart("f", killed + 30) == []
