"""Processes for the tests' ranks and push members, forked by a fork server that imported torch
and slimen_torch once for the session. Spawned, each process imported them again: 4 s of CPU a
process on a 2-core machine, for 20 processes (test_dist.py, test_sharded_step.py,
test_push.py). A forked process has the server's environment, the test's as it was when the
server started: each gets the test's own as it is when it starts."""

import os

import torch.multiprocessing as mp

# What the fork server imports. (Python 3.11's server has the path it was started with, not the
# test process's: slimen_torch is found from engines/torch, where the suite runs; where it is
# not, each process imports it.)
PRELOAD = ["pytest", "torch.distributed.tensor", "torch.distributed.fsdp", "slimen_torch.dist",
           "slimen_torch.engine"]


def context():
    """The fork server's multiprocessing context."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # (no effect once the server runs)
    return ctx


def call_in_env(env, fn, *args):
    """fn(*args) in the environment env."""
    os.environ.clear()
    os.environ.update(env)
    return fn(*args)


def _rank_in_env(rank, env, fn, *args):
    call_in_env(env, fn, rank, *args)


def start_processes(fn, args, nprocs):
    """torch.multiprocessing.start_processes(fn, args, nprocs), joined, through the fork server,
    each process in this process's environment."""
    context()
    mp.start_processes(_rank_in_env, args=(dict(os.environ), fn, *args), nprocs=nprocs,
                       start_method="forkserver", join=True)


def process(target, args):
    """A process (not started) that runs target(*args) in this process's environment, through
    the fork server."""
    ctx = context()
    return ctx.Process(target=call_in_env, args=(dict(os.environ), target, *args))
