"""Whether Triton imports here (the CUDA paths of the decode kernels and the packed experts need it)."""

from __future__ import annotations

import functools


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - no triton (or no driver): the references serve
        return False
    return True
