"""The ranks of a worker group forked from a process that has imported them already (PREFORK_ENV):
torchrun (slimen_torch.launch) runs each rank as a function (its --run-path, this file) in a
child of multiprocessing's fork server (its --start-method forkserver), which imported torch, the
worker's modules and the compiler (PRELOAD) once, at the group's first start, and lives as long as
torchrun. A group that torchrun starts again after a rank died then skips every rank's imports:
9.2 s of the 27.3 s a SIGKILLed rank took to come back on two H200s, plus the compiler's import
while the ranks meet; its ranks are forked in milliseconds.

The fork server never touches the GPU (a process that initialised CUDA cannot fork a child that
uses it): PRELOAD imports modules only, and each rank makes its own CUDA context, as a rank that
torchrun started as a program does. A rank forked so is a child of the fork server, not of
torchrun, and its environment (RANK, …) is set in the process, not at its exec: its
/proc/PID/environ and command line are the fork server's (multi_gpu.sh finds a rank from its
"serve: process N began (rank R of W)" line). Off by default: on the CPU, where a rank's imports
took ~10 s of a busy two-core machine, a SIGKILLed rank is back in about half the time; a GPU
measurement decides (docs/gpus.md)."""

from __future__ import annotations

import os
import sys

PREFORK_ENV = "SLIMEN_TORCH_PREFORK"
# What the fork server imports before it forks the first rank: everything a rank imports on its
# way to serving (server, dist: torch, gRPC, Triton, the engine) and the compiler that
# train.import_compiler_later would import on a thread, with FSDP and DTensor. An ImportError is
# skipped by multiprocessing (the rank then imports what it needs itself).
# torchrun's own modules, which a forked rank imports to run its function (multiprocessing runs
# torchrun's main module again there, as __mp_main__), come too: their imports, not the main
# module itself, which runpy would warn of finding imported already.
PRELOAD = ["torch", "slimen_torch.server", "slimen_torch.dist", "torch._inductor.config",
           "torch._dynamo", "torch.distributed.fsdp", "torch.distributed.tensor",
           "torch.distributed.launcher.api", "torch.distributed.elastic.multiprocessing"]


def enabled() -> bool:
    return os.environ.get(PREFORK_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def torchrun_argv(argv: list[str]) -> list[str]:
    """torchrun's arguments (argv[0] the module, torch.distributed.run) with its program, `-m
    slimen_torch ARGS…` (as engines/torchproc gives it), run as a function in forked children
    (this file, --run-path, with --start-method forkserver) instead; argv as it is when its
    program is another."""
    for i in range(1, len(argv) - 1):
        if argv[i] in ("-m", "--module") and argv[i + 1] == "slimen_torch":
            return argv[:i] + ["--run-path", "--start-method", "forkserver",
                               os.path.abspath(__file__)] + argv[i + 2:]
    return argv


def prepare() -> None:
    """Before torchrun runs: the fork server's preload (it starts at the group's first start,
    after torchrun has set the ranks' OMP_NUM_THREADS in this environment, which it inherits),
    and torchrun's report of a failed rank without its traceback (_Untraced)."""
    import logging
    import multiprocessing

    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_Untraced())


class _Untraced:
    """A logging filter: a record's exception in its message, not as a traceback. torchrun logs
    a rank of a function (this module's) that failed with logger.exception, and torch's log
    formatter imports Dynamo to format a traceback: 5.4 s of torchrun's own, between a rank's
    death and the new group's start, on the CPU run. The traceback says only where torchrun
    noticed (its join); the message says which rank failed and how."""

    def filter(self, record) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            e = record.exc_info[1]
            record.msg, record.args = f"{record.getMessage()} ({type(e).__name__}: {e})", ()
            record.exc_info = record.exc_text = None
        return True


def rank_main(argv: list[str]) -> None:
    """A forked rank: `python -m slimen_torch ARGS…` in this process (launch.run), ending it as
    the launcher ends its program (launch.exit_now: the interpreter's finalization skipped; a
    normal return would wait on torchrun's return-value queue until torchrun gave up on it)."""
    from slimen_torch import launch

    launch.exit_now(launch.run(["slimen_torch", *argv]))


if __name__ == "__main__":  # torchrun's run_script_path: argv[0] this file, the rest the program's
    rank_main(sys.argv[1:])
