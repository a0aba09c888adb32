"""Triton where the platform has it, for the worker's kernel modules (kernels, batch_invariant,
lora_kernels): the one import of it, whether its interpreter runs the kernels (TRITON_INTERPRET=1
when the worker started: the tests set it), where the kernels can run, the power-of-two
sizes their blocks take, and whether they launch with programmatic dependent launch (`_pdl`:
kernels' decode kernels and lora_kernels' expand, whose grid dependency control, gdc_wait and
gdc_launch_dependents, is imported here). A module of its own so that lora_kernels (which lora,
and so the model, imports) can share it without importing the model."""

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

try:  # Grid dependency control (Hopper and later), for programmatic dependent launch.
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    HAVE_GDC = True
except Exception:  # pragma: no cover - another Triton version
    HAVE_GDC = False

INTERPRET = os.environ.get("TRITON_INTERPRET", "") == "1"


def available(device: torch.device | str) -> bool:
    """Whether the Triton kernels run on device: a CUDA device, or the CPU under the
    interpreter."""
    device = torch.device(device)
    return HAVE_TRITON and (device.type == "cuda" or INTERPRET)


def pow2(n: int) -> int:
    """The smallest power of two ≥ n (1 for n ≤ 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())


_PDL: dict = {}


def _pdl(device: torch.device) -> bool:
    """Whether the decode kernels use programmatic dependent launch on this device: a kernel is
    launched while the previous one still runs, starts the loads that do not depend on it (the
    batch-1 products' weights) and waits for it with griddepcontrol.wait. At batch 1 a decode step
    is ~170 short kernels, each of which otherwise starts only when the previous one has finished.
    Needs compute capability 9.0 (Hopper) or later; SLIMEN_PDL=0 turns it off."""
    if device.type != "cuda" or INTERPRET or not HAVE_GDC:
        return False
    on = _PDL.get(device.index)
    if on is None:
        on = (os.environ.get("SLIMEN_PDL", "1") != "0"
              and torch.cuda.get_device_capability(device)[0] >= 9)
        _PDL[device.index] = on
    return on
