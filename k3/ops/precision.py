"""One rule for reductions and nonlinearities: compute in fp32 at least (fp64 stays fp64, for gradcheck)."""

import torch


def upcast(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.float()
