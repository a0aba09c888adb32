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
