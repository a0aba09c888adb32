"""The requests and samples the generator serves (generate.py), and where an admission put them."""

from __future__ import annotations

import typing

from . import sampling


class Request:
    """A generate request being served: its prompt, sampling settings and samples."""

    def __init__(self, rid, prompt, n, sampling_, on_completion, on_error=None):
        self.id = rid
        self.prompt = prompt
        self.n = n
        self.sampling = sampling_
        self.on_completion = on_completion  # called with each finished Completion
        self.on_error = on_error  # called with (code, message) if the request fails
        self.cancelled = False
        self.adapter = None  # the lora.Adapter that generates it; None: the base
        self.matcher = None  # its constraint's constrain.Matcher; None: none


class Sequence:
    """One sample of a request."""

    __slots__ = ("req", "index", "max_tokens", "key", "tokens", "logprobs", "slot", "launched",
                 "done", "finish_reason", "text", "stop_scan", "has_stop", "weights", "cst")

    def __init__(self, req: Request, index: int, max_tokens: int):
        self.req = req
        self.index = index
        self.max_tokens = max_tokens
        self.key = sampling.row_key(req.sampling.seed, index)
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.slot = -1
        self.launched = 0  # tokens whose sampling has been launched (prefill counts one)
        self.done = False
        self.finish_reason = ""
        self.text = ""
        self.stop_scan = 0  # text length already searched for stop strings
        self.has_stop = bool(req.sampling.stop)
        self.weights = 0  # PrefixCache.weights when it was admitted
        # Where the response is in its constraint (constrain.State); None: unconstrained.
        self.cst = req.matcher.g.start() if req.matcher is not None else None


class Placed(typing.NamedTuple):
    """A sample admitted into its row (seq.slot): prefilled from prompt token `start` on (0: the
    whole prompt). A lead (lead is seq, the request's first sample placed in this admission) with
    start > 0 finds tokens [0, start) in row src (its own row, or one copied from first); another
    sample (a follower) gets a copy of its lead's row after the lead's prefill."""

    seq: Sequence
    start: int
    src: int
    lead: Sequence


def prompt_key(req: Request) -> tuple:
    """Requests of one key hold the same prompt keys and values: the prompt and the adapter."""
    return tuple(req.prompt), id(req.adapter)
