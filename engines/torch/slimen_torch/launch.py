"""`python -m slimen_torch.launch MODULE ARGS…`: runs MODULE as the program (torchrun, as
torch.distributed.run, for a worker of several ranks: engines/torchproc) and exits as soon as it
returns, with its status, skipping the interpreter's finalization. torchrun's, torch's teardown
after its group failed, took 1–2.5 s on the CPU runs (1.1 s alone, 0.2 s without it), seconds a
restarted worker group waited for its launcher to exit before the host could start it again.
With SLIMEN_TORCH_PREFORK set, torchrun forks its ranks from a process that has imported them
(slimen_torch.prefork)."""

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
    if argv[0] == "torch.distributed.run":
        from . import prefork

        quick_rendezvous("--standalone" in argv)
        if prefork.enabled():
            argv = prefork.torchrun_argv(argv)
            prefork.prepare()
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


def quick_rendezvous(standalone: bool) -> None:
    """torchrun's rendezvous without its waits that serve no purpose here, in this process (the
    launcher's torchrun): the name of the method behind each of its events, which it took from
    inspect.stack() (every frame's source lines read: 0.3–0.8 s of each group's start on the CPU
    run, between a rank's death and the new group), from the frame itself; and, for a group on
    this machine alone (--standalone), the random pause of up to 0.3 s before each rendezvous
    that spreads the nodes of a group of several."""
    try:
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr
    except ImportError:
        return

    def method_name(depth: int = 2) -> str:
        try:
            return sys._getframe(depth).f_code.co_name
        except ValueError:
            return "no_method_name"

    if hasattr(dr, "get_method_name"):
        dr.get_method_name = method_name
    delay = getattr(dr, "_delay", None)
    if standalone and delay is not None:
        def no_jitter(seconds) -> None:
            if not isinstance(seconds, tuple):  # a fixed wait (polling the store) stays
                delay(seconds)

        dr._delay = no_jitter


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
