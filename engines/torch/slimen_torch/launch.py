"""`python -m slimen_torch.launch MODULE ARGS…`: runs MODULE as the program (torchrun, as
torch.distributed.run, for a worker of several ranks: engines/torchproc) and exits as soon as it
returns, with its status, skipping the interpreter's finalization. torchrun's, torch's teardown
after its group failed, took 1–2.5 s on the CPU runs (1.1 s alone, 0.2 s without it), seconds a
restarted worker group waited for its launcher to exit before the host could start it again."""

from __future__ import annotations

import logging
import os
import runpy
import sys
import traceback
from typing import NoReturn


def run(argv: list[str]) -> int:
    """Runs module argv[0] as __main__ with argv[1:] as its arguments; returns its exit status
    (an exception it raises: printed, status 1, as the interpreter would)."""
    if not argv:
        print("usage: python -m slimen_torch.launch MODULE [ARGS…]", file=sys.stderr)
        return 2
    sys.argv = list(argv)
    try:
        runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def exit_now(code: int) -> NoReturn:
    """Ends the process with code at once: the logs and standard streams flushed, the
    interpreter's finalization (torch's, Triton's, gRPC's: seconds) skipped."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    exit_now(run(sys.argv[1:]))


if __name__ == "__main__":
    main()
