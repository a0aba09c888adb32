"""slimen_torch.launch, the wrapper the host starts torchrun in: the program's arguments and exit
status pass through, and torchrun's report of a failed group reaches the worker's log."""

import os
import subprocess
import sys

import pytest

from slimen_torch import launch


@pytest.mark.parametrize("body,code", [("pass", 0), ("raise SystemExit(3)", 3),
                                       ("sys.exit('bad')", 1), ("raise ValueError('x')", 1)])
def test_status_and_arguments(tmp_path, monkeypatch, body, code):
    (tmp_path / "prog_mod.py").write_text(
        "import sys\nopen(sys.argv[1], 'w').write(' '.join(sys.argv[2:]))\n" + body + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    out = tmp_path / "argv"
    assert launch.run(["prog_mod", str(out), "-m", "x", "--y"]) == code
    assert out.read_text() == "-m x --y"


def test_torchrun_with_a_failed_rank(tmp_path):
    """torchrun under the wrapper, one of its two ranks failing: its status (1) and its report."""
    (tmp_path / "rank.py").write_text(
        "import os, sys, time\n"
        "if os.environ['RANK'] == '1':\n    sys.exit(7)\ntime.sleep(60)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(launch.__file__)), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-m", "slimen_torch.launch", "torch.distributed.run",
                        "--standalone", "--nproc-per-node", "2", str(tmp_path / "rank.py")],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 1, p.stderr
    assert "ChildFailedError" in p.stderr and "exitcode  : 7" in p.stderr, p.stderr


def test_torchrun_restarts_a_group_that_meets_again(tmp_path):
    """A group that torchrun starts again itself (--max-restarts) after a rank died: its ranks
    meet through dist.init as the first group's did (whose keys torchrun's store still holds),
    and its rank 0 takes the port its predecessor wrote (dist.relisten)."""
    (tmp_path / "address").write_text("127.0.0.1:40123\n")
    (tmp_path / "rank.py").write_text(
        "import os, sys\n"
        "from slimen_torch import dist\n"
        "rank, _, size, links = dist.init('cpu')\n"
        "n = dist.restart_count()\n"
        "if n == 0 and rank == 1:\n    os._exit(9)\n"
        "if n == 1 and rank == 0:\n"
        f"    print('listen', dist.relisten('127.0.0.1:0', {str(tmp_path / 'address')!r}),\n"
        "          dist.relisten('127.0.0.1:7', ''), flush=True)\n"
        "import torch, torch.distributed as d\n"
        "t = torch.ones(1)\n"
        "d.all_reduce(t, group=links.calls)\n"
        f"open(os.path.join({str(tmp_path)!r}, f'round{{n}}-rank{{rank}}'), 'w')"
        ".write(str(int(t.item())))\n"
        "d.destroy_process_group()\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(launch.__file__)), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-m", "slimen_torch.launch", "torch.distributed.run",
                        "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                        str(tmp_path / "rank.py")],
                       capture_output=True, text=True, env=env, timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "listen 127.0.0.1:40123 127.0.0.1:7" in p.stdout, p.stdout + p.stderr
    for r in (0, 1):
        assert (tmp_path / f"round1-rank{r}").read_text() == "2", p.stdout + p.stderr


def test_prefork_runs_slimen_torch_as_a_forked_function():
    """SLIMEN_TORCH_PREFORK: torchrun's program `-m slimen_torch ARGS` becomes prefork.py run as
    a function in children of the fork server; another program stays as it is."""
    from slimen_torch import prefork

    argv = ["torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "--max-restarts", "3", "-m", "slimen_torch", "serve", "--model", "m", "-m", "x"]
    assert prefork.torchrun_argv(argv) == argv[:6] + [
        "--run-path", "--start-method", "forkserver", os.path.abspath(prefork.__file__)
    ] + ["serve", "--model", "m", "-m", "x"]
    other = ["torch.distributed.run", "--nproc-per-node", "2", "-m", "other", "serve"]
    assert prefork.torchrun_argv(other) == other


def test_quick_rendezvous_names_the_caller():
    """quick_rendezvous's method name is inspect.stack()'s (the caller of the caller)."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    saved = dr.get_method_name, dr._delay
    try:
        launch.quick_rendezvous(True)

        def record():
            return dr.get_method_name()

        def caller():
            return record()

        assert caller() == "caller"
        dr._delay((0, 0.3))  # the jitter: no pause
    finally:
        dr.get_method_name, dr._delay = saved


def test_prefork_group_comes_back_without_imports(model_dirs, tmp_path):
    """A worker group of two CPU ranks forked from the fork server (SLIMEN_TORCH_PREFORK=1): rank
    1 SIGKILLed, torchrun forks a new group, whose rank 0 serves on the old port, within seconds
    (no rank imports torch again)."""
    import re
    import signal
    import time

    addr = tmp_path / "address"
    log = tmp_path / "log"
    env = dict(os.environ, SLIMEN_TORCH_PREFORK="1", PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(launch.__file__)), os.environ.get("PYTHONPATH", "")]))
    with open(log, "w") as out:
        p = subprocess.Popen([sys.executable, "-m", "slimen_torch.launch", "torch.distributed.run",
                              "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                              "-m", "slimen_torch", "serve", "--model", str(model_dirs["tiny"]),
                              "--device", "cpu", "--listen", "127.0.0.1:0", "--address-file",
                              str(addr)], stdout=out, stderr=subprocess.STDOUT, env=env)

    def wait_for(pred, what, limit=240):
        end = time.monotonic() + limit
        while time.monotonic() < end:
            text = log.read_text()
            if pred(text):
                return text
            assert p.poll() is None, text
            time.sleep(0.1)
        raise AssertionError(f"no {what}:\n{log.read_text()}")

    try:
        text = wait_for(lambda t: "serving" in t, "first group")
        first = addr.read_text()
        pid = int(re.findall(r"process (\d+) began \(rank 1 of 2\)", text)[-1])
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        text = wait_for(lambda t: t.count("serving") == 2, "second group")
        back = time.monotonic() - killed
        assert addr.read_text() == first
        assert len(re.findall(r"began \(rank 1 of 2\)", text)) == 2
        assert back < 60, f"back after {back:.1f} s:\n{text}"
    finally:
        p.terminate()
        p.wait(timeout=60)
