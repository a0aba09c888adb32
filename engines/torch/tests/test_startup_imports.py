"""What a worker's rank imports before it can listen and meet its group: not the compiler
(torch._inductor, Dynamo: seconds of every restarted rank's start), which a rank of a group
imports on a thread of its own while the ranks meet (train.import_compiler_later)."""

import os
import subprocess
import sys

import slimen_torch

PACKAGE_ROOT = os.path.dirname(os.path.dirname(slimen_torch.__file__))


def _run(code: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([PACKAGE_ROOT,
                                                       os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    return p.stdout.strip()


def test_the_server_and_dist_import_no_compiler():
    out = _run("import sys\nfrom slimen_torch import dist, server, engine\n"
               "print(sorted({m.split('.')[1] for m in sys.modules\n"
               "              if m.startswith(('torch._inductor', 'torch._dynamo'))}))")
    assert out == "[]", f"imported at start-up: {out}"


def test_import_compiler_later():
    """The compiler arrives on its own thread, and the options read from it are the compiled
    layer's."""
    out = _run("import sys, threading, time\n"
               "from slimen_torch import train\n"
               "t = train.import_compiler_later()\n"
               "assert t.name == 'slimen-torch-import-compiler'\n"
               "t.join(240)\n"
               "print('torch._inductor.config' in sys.modules, 'torch._dynamo' in sys.modules,\n"
               "      train.compile_options()['triton.coalesce_tiling_analysis'])")
    assert out == "True True False"
