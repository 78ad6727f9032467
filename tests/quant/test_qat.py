"""Quantisation-aware training (SPEC §6): the routed experts' forward is exactly dequant(quant(.)) of the MXFP4 weights
and MXFP8 inputs, the gradients are straight-through, Muon keeps high-precision masters, and `k3 train --qat mxfp4`
(from scratch, resumed, or fine-tuning with --init-from) trains and records the scheme in config.json."""

import dataclasses
import json

import pytest
import torch

from k3.cli import main
from k3.config import K3Config
from k3.distributed.plan import ParallelDims, ParallelPlan
from k3.layers.width.latent_moe import ExpertBank, LatentMoE
from k3.model.transformer import K3ForCausalLM
from k3.ops.mx import (E2M1, dequantize_mxfp4, dequantize_mxfp8, fake_quant_mxfp8, mx_round, quantize_mxfp4,
                       quantize_mxfp8)
from k3.ops.situ import glu
from k3.train.loop import TrainConfig, train
from k3.train.metrics import read_metrics
from k3.train.optim import build_optimizer

CFG = K3Config.preset("tiny").replace(qat="mxfp4", moe_intermediate_size=64, routed_expert_hidden_size=64)
COUNTS = torch.tensor([5, 0, 9, 1, 3, 0, 7, 2])


def _deq4(w):
    return dequantize_mxfp4(*quantize_mxfp4(w), torch.float32)


def _deq8(x):
    return dequantize_mxfp8(*quantize_mxfp8(x), torch.float32)


def test_qat_forward_is_the_matmul_of_dequantised_weights_and_inputs():
    torch.manual_seed(0)
    bank = ExpertBank(CFG)
    x = torch.randn(int(COUNTS.sum()), CFG.expert_dim)
    got = bank.compute(x, COUNTS)
    want, start = [], 0
    for e, n in enumerate(COUNTS.tolist()):
        xe = _deq8(x[start:start + n])
        start += n
        h = glu(xe @ _deq4(bank.w1[e].detach()).T, xe @ _deq4(bank.w3[e].detach()).T, "situ", CFG.activation_situ_beta,
                CFG.activation_situ_linear_beta)
        want.append(_deq8(h) @ _deq4(bank.w2[e].detach()).T)
    assert torch.equal(got, torch.cat(want))
    plain = ExpertBank(CFG.replace(qat=None))
    plain.load_state_dict(bank.state_dict())
    assert not torch.allclose(plain.compute(x, COUNTS), got, atol=1e-3)  # QAT changes the numbers


def test_qat_gradients_are_the_unquantised_gradients_at_the_fake_quant_outputs():
    torch.manual_seed(0)
    bank = ExpertBank(CFG)
    x = torch.randn(int(COUNTS.sum()), CFG.expert_dim, requires_grad=True)
    dy = torch.randn(x.shape)
    (bank.compute(x, COUNTS) * dy).sum().backward()
    # the same computation on leaves that ARE the fake-quant outputs (h's rounding is the op's own STE)
    q = {n: mx_round(getattr(bank, n).detach(), E2M1).requires_grad_() for n in ("w1", "w3", "w2")}
    xq = _deq8(x.detach()).requires_grad_()
    outs, start = [], 0
    for e, n in enumerate(COUNTS.tolist()):
        xe = xq[start:start + n]
        start += n
        h = glu(xe @ q["w1"][e].T, xe @ q["w3"][e].T, "situ", CFG.activation_situ_beta, CFG.activation_situ_linear_beta)
        outs.append(fake_quant_mxfp8(h) @ q["w2"][e].T)
    (torch.cat(outs) * dy).sum().backward()
    for n in ("w1", "w3", "w2"):
        torch.testing.assert_close(getattr(bank, n).grad, q[n].grad, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(x.grad, xq.grad, rtol=1e-6, atol=1e-7)


def test_muon_step_under_qat_keeps_high_precision_masters():
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("tiny").replace(qat="mxfp4", vocab_size=128))
    ids = torch.randint(0, 128, (1, 64))
    opt = build_optimizer(model, lr=1e-2, weight_decay=0.1)
    bank = model.model.layers[1].block_sparse_moe.experts
    before = bank.w1.detach().clone()
    model(ids, labels=ids)["loss"].backward()
    assert bank.w1.grad is not None and bank.w1.grad.abs().sum() > 0
    opt.step()
    w = bank.w1.detach()
    assert w.dtype == torch.float32 and not torch.equal(w, before)
    assert (mx_round(w, E2M1) != w).float().mean() > 0.9  # the masters are not snapped to the MXFP4 grid


def test_moe_with_qat_differs_only_through_the_experts():
    torch.manual_seed(0)
    qat = LatentMoE(CFG)
    plain = LatentMoE(CFG.replace(qat=None))
    plain.load_state_dict(qat.state_dict())
    x = torch.randn(16, CFG.hidden_size)
    w, idx, _ = qat.gate(x)
    z = qat.routed_expert_down_proj(x)
    assert torch.equal(qat.shared_experts(x), plain.shared_experts(x))
    assert not torch.equal(qat.experts(z, w, idx), plain.experts(z, w, idx))


BASE = TrainConfig(out="", preset="tiny", data_max_bytes=300_000, tokenizer_bytes=100_000, vocab_size=512, steps=12,
                   batch_size=2, seq_len=64, lr=1e-2, eval_every=6, eval_batches=2, log_every=1, save_every=100)


def _run(out, **kw):
    cfg = dataclasses.replace(BASE, out=str(out), **kw)
    train(cfg, ParallelPlan(ParallelDims(), "cpu"), log=lambda *a: None)
    return read_metrics(cfg.out)


def _text_config(checkpoint) -> dict:
    """The text model's config.json fields (nested under text_config in the K3 release layout)."""
    d = json.loads((checkpoint / "config.json").read_text())
    return d.get("text_config", d)


@pytest.mark.slow
def test_qat_training_learns_resumes_and_records_the_scheme(tmp_path):
    loss = [r["loss"] for r in _run(tmp_path / "qat", qat="mxfp4")]
    assert sum(loss[-3:]) / 3 < loss[0] - 0.2, loss
    assert _text_config(tmp_path / "qat" / "checkpoint")["k3_qat"] == "mxfp4"
    assert len(_run(tmp_path / "cut", qat="mxfp4", stop_after=4)) == 4
    assert [r["loss"] for r in _run(tmp_path / "cut", qat="mxfp4")] == loss  # resumed bit-identically


def test_qat_fine_tuning_from_a_checkpoint_with_the_cli(tmp_path, capsys):
    base = _run(tmp_path / "base")
    assert "k3_qat" not in _text_config(tmp_path / "base" / "checkpoint")
    args = ["train", "--preset", "tiny", "--init-from", str(tmp_path / "base"), "--qat", "mxfp4", "--steps", "4",
            "--lr", "1e-3", "--batch-size", "2", "--seq-len", "64", "--data-max-bytes", "300000", "--eval-every", "4",
            "--log-every", "1", "--out", str(tmp_path / "ft")]
    assert main(args) == 0
    ft = read_metrics(tmp_path / "ft")
    # it starts from the trained weights, not from scratch (a fresh model's first loss is base[0]'s)
    assert ft[0]["loss"] < base[0]["loss"] - 0.2 and ft[-1]["val_loss"] < base[0]["loss"] - 0.2, (base, ft)
    ck = tmp_path / "ft" / "checkpoint"
    assert _text_config(ck)["k3_qat"] == "mxfp4"
    assert (ck / "tokenizer.json").read_text() == (tmp_path / "base" / "checkpoint" / "tokenizer.json").read_text()
    bad = args[:4] + [str(tmp_path / "nowhere")] + args[5:-1] + [str(tmp_path / "bad")]
    assert main(bad) == 1
    assert "--init-from" in capsys.readouterr().err
