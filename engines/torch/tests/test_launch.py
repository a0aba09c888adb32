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
