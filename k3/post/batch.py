"""Trajectories -> packed training micro-batches, and the per-token log-probabilities of a model on them.

Legend: T packed tokens (prompts + replies, documents delimited by cu_seqlens), N reply tokens, V vocabulary.

Each trajectory is one document: its prompt then its reply. Reply token i of a document starting at s with a
prompt of p tokens is predicted by the logits at s + p + i - 1, so ``pred_idx`` [N] indexes those positions and
``targets`` [N] the tokens; every per-token quantity (sampling log-prob, advantage, reference log-prob) is [N]
in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .rollout import Trajectory

__all__ = ["pack", "token_logprobs", "score"]


def pack(trajs: Sequence[Trajectory], advantages: Sequence[Sequence[float]], max_tokens: int, denom: float
         ) -> list[dict]:
    """Micro-batches of at most ``max_tokens`` packed tokens (a longer trajectory gets one of its own), each
    {"input_ids" [1,T], "cu_seqlens", "pred_idx" [N], "targets" [N], "sampled_logp" [N], "adv" [N], "denom"}.
    ``advantages``: per trajectory, one per reply token. ``denom``: what each micro-batch's summed objective is
    divided by (k3.post.objective.policy_loss)."""
    batches, cur = [], []

    def flush():
        if not cur:
            return
        ids, cu, idx, tgt, lp, adv = [], [0], [], [], [], []
        for t, a in cur:
            s, p = cu[-1], len(t.prompt_ids)
            ids += t.prompt_ids + t.tokens
            cu.append(s + p + len(t.tokens))
            idx += range(s + p - 1, s + p - 1 + len(t.tokens))
            tgt += t.tokens
            lp += t.logprobs
            adv += a
        batches.append({"input_ids": torch.tensor([ids]), "cu_seqlens": torch.tensor(cu),
                        "pred_idx": torch.tensor(idx), "targets": torch.tensor(tgt),
                        "sampled_logp": torch.tensor(lp, dtype=torch.float32),
                        "adv": torch.tensor(adv, dtype=torch.float32), "denom": denom})
        cur.clear()

    size = 0
    for t, a in zip(trajs, advantages):
        if len(a) != len(t.tokens):
            raise ValueError(f"{len(a)} advantages for a reply of {len(t.tokens)} tokens")
        if not t.tokens:
            continue
        n = len(t.prompt_ids) + len(t.tokens)
        if cur and size + n > max_tokens:
            flush()
            size = 0
        cur.append((t, a))
        size += n
    flush()
    return batches


def token_logprobs(model, batch: dict) -> torch.Tensor:
    """[N] log pi(y_t) of the batch's reply tokens under ``model`` (differentiable)."""
    return forward_logprobs(model, batch)[0]


def forward_logprobs(model, batch: dict, record: tuple[str, ...] = ()):
    """(``token_logprobs``, the model's output: the statistics of ``record``, e.g. the trainer's, for QK-clip and
    the balancer)."""
    device = next(model.parameters()).device
    out = model(batch["input_ids"].to(device), cu_seqlens=batch["cu_seqlens"].to(device), record=record)
    logits_NV = out["logits"][0][batch["pred_idx"].to(device)].float()
    return torch.log_softmax(logits_NV, dim=-1).gather(-1, batch["targets"].to(device)[:, None]).squeeze(-1), out


@torch.no_grad()
def score(model, trajs: Sequence[Trajectory], max_tokens: int) -> list[list[float]]:
    """Per trajectory, log pi(y_t) of each reply token under ``model`` (a teacher or the reference)."""
    was = model.training
    model.eval()
    zeros = [[0.0] * len(t.tokens) for t in trajs]
    out, flat = [], [t for t in trajs if t.tokens]
    for b in pack(flat, [z for z, t in zip(zeros, trajs) if t.tokens], max_tokens, 1.0):
        lp = token_logprobs(model, b).cpu().tolist()
        cu = b["cu_seqlens"].tolist()
        n_docs = len(cu) - 1
        for _ in range(n_docs):
            t = flat[len(out)]
            out.append(lp[:len(t.tokens)])
            lp = lp[len(t.tokens):]
    model.train(was)
    it = iter(out)
    return [next(it) if t.tokens else [] for t in trajs]
