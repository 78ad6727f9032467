"""One rule for reductions and nonlinearities: compute in fp32 at least (fp64 stays fp64, for gradcheck); and the
dtype activations travel in between (``compute_dtype``)."""

import torch


def upcast(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def compute_dtype(x: torch.Tensor) -> torch.Tensor:
    """``x`` in autocast's dtype where autocast is on for its device, else as is. The depth stream (the embedding,
    every sub-layer output, AttnRes's block sums) then lives in bf16 under bf16 autocast, as every matmul's output
    does, instead of in the fp32 of the embedding table: half the bytes for each AttnRes mix and residual add, and
    no cast of the stream (nor of its gradient) before each projection. Norms, AttnRes logits and softmax still
    compute in fp32 (k3.ops.norms, k3.ops.attn_res)."""
    return x.to(autocast_dtype(x)) if x.is_floating_point() else x


def autocast_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype autocast runs a matmul of ``x`` in: autocast's where it is on for x's device, else x's own."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
