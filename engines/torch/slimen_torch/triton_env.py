"""Triton where the platform has it, for the worker's kernel modules (kernels, batch_invariant,
lora_kernels): the one import of it, whether its interpreter runs the kernels (TRITON_INTERPRET=1
when the worker started: the tests set it), where the kernels can run, and the power-of-two
sizes their blocks take. A module of its own so that lora_kernels (which lora, and so the model,
imports) can share it without importing the model."""

from __future__ import annotations

import os

import torch

try:  # Triton comes with PyTorch's CUDA wheels on Linux; elsewhere the fallbacks run.
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except Exception:  # pragma: no cover - depends on the platform
    triton = None
    tl = None
    HAVE_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET", "") == "1"


def available(device: torch.device | str) -> bool:
    """Whether the Triton kernels run on device: a CUDA device, or the CPU under the
    interpreter."""
    device = torch.device(device)
    return HAVE_TRITON and (device.type == "cuda" or INTERPRET)


def pow2(n: int) -> int:
    """The smallest power of two ≥ n (1 for n ≤ 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())
