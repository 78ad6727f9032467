"""The one error type of checkpoint reading and writing, and the check of weights every load makes."""

import torch


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used as it is; the message names the file and what to do."""


def check_finite(state: dict, directory) -> None:
    """Refuse weights holding NaN or inf (a run that diverged, or bytes damaged before SHA256SUMS were written):
    such a model produces NaN logits, and sampling from them would print nothing and exit 0. Integer (packed)
    tensors cannot hold either and are not read."""
    bad = [k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        raise CheckpointError(f"{directory}: {len(bad)} weight tensor(s) hold NaN or inf values ({', '.join(bad[:5])}"
                              f"{', ...' if len(bad) > 5 else ''}): the run that wrote them diverged, or the file is "
                              "damaged. Use an earlier checkpoint, or retrain (a lower --lr, --qk-clip on)")
