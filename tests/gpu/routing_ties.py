"""Near-ties of a random MoE router, for the GPU exactness tests: two computations of the same forward that differ
by float rounding route a token to another expert when its top-k margin is under that rounding, and that token
then moves the last logits by ~4e-3 even in float32 (measured on the H200: the 2,100-token prompt routes a token
of layer 7 at a margin of 6e-8, and the divergence spreads to ~20 rows of the later layers through attention).
A sequence whose reference forward routes any token with a margin under ``NEAR_TIE`` is held to ``TIE_BOUND``
instead of the tight bound (still far below a wrong page or state, which is O(1))."""

from contextlib import contextmanager

import torch

from k3.layers.width.router import Router

NEAR_TIE = 2e-6  # a top-k margin of the router scores that fp32 rounding differences between two paths may cross
TIE_BOUND = 2e-2


@contextmanager
def router_margins(model):
    """Collects, while active, the smallest top-k margin (k-th minus (k+1)-th of score + bias) of each router call
    of ``model`` into the yielded list."""
    margins = []

    def hook(mod, _, out):
        s = (out[2] + mod.e_score_correction_bias).topk(mod.top_k + 1, -1).values
        margins.append(float((s[:, -2] - s[:, -1]).min()))

    hooks = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, Router)]
    try:
        yield margins
    finally:
        for h in hooks:
            h.remove()


def last_logits(model, tokens: list[int]) -> tuple[torch.Tensor, bool]:
    """The full forward's last-position logits of ``tokens`` (on CUDA) and whether it routed any token on a
    near-tie (a margin under ``NEAR_TIE``)."""
    with router_margins(model) as margins:
        logits = model(torch.tensor([tokens], device="cuda"))["logits"][0, -1]
    return logits, min(margins) < NEAR_TIE
