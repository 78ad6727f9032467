"""``K3_KDA_BACKEND`` overrides what ``resolve_backend("auto", x)`` picks, read at every call (CPU only)."""

import pytest
import torch

from k3.ops import kda as kda_ops
from k3.ops.kda import resolve_backend


def test_unset_or_auto_keeps_the_automatic_choice(monkeypatch):
    x = torch.zeros(1)  # a CPU tensor: "auto" means the reference
    monkeypatch.delenv("K3_KDA_BACKEND", raising=False)
    assert resolve_backend("auto", x) == "torch"
    for value in ("auto", "", " auto "):
        monkeypatch.setenv("K3_KDA_BACKEND", value)
        assert resolve_backend("auto", x) == "torch"


def test_the_variable_overrides_auto_and_is_read_at_call_time(monkeypatch):
    x = torch.zeros(1)
    monkeypatch.setenv("K3_KDA_BACKEND", "fla")
    assert resolve_backend("auto", x) == "fla"  # resolution only: fla-core need not be installed
    monkeypatch.setenv("K3_KDA_BACKEND", "torch")
    assert resolve_backend("auto", x) == "torch"
    monkeypatch.setattr(kda_ops, "fla_available", lambda t: True)  # as on a GPU with fla-core
    assert resolve_backend("auto", x) == "torch"
    monkeypatch.delenv("K3_KDA_BACKEND")
    assert resolve_backend("auto", x) == "fla"


def test_an_explicit_backend_wins_over_the_variable(monkeypatch):
    x = torch.zeros(1)
    monkeypatch.setenv("K3_KDA_BACKEND", "fla")
    assert resolve_backend("torch", x) == "torch"
    monkeypatch.setenv("K3_KDA_BACKEND", "torch")
    assert resolve_backend("fla", x) == "fla"


def test_the_variable_routes_the_ops(monkeypatch):
    calls = []
    monkeypatch.setattr(kda_ops, "fla_chunk_kda", lambda *a, **kw: calls.append("fla") or "fla-out")
    q = torch.zeros(1, 4, 1, 2)
    monkeypatch.setenv("K3_KDA_BACKEND", "fla")
    assert kda_ops.chunk_kda(q, q, q, q, q[..., 0]) == "fla-out" and calls == ["fla"]


@pytest.mark.parametrize("value", ["cuda", "FLA", "triton", "torch,fla"])
def test_an_unknown_value_names_the_variable_and_the_choices(monkeypatch, value):
    monkeypatch.setenv("K3_KDA_BACKEND", value)
    with pytest.raises(ValueError, match=r"K3_KDA_BACKEND=.*expected one of \('auto', 'torch', 'fla'\)"):
        resolve_backend("auto", torch.zeros(1))
    assert resolve_backend("torch", torch.zeros(1)) == "torch"  # only "auto" reads it


def test_fla_takes_only_the_dtypes_its_kernels_compute_in(monkeypatch):
    """fp64 (the reference's exact mode) never reaches fla-core: "auto" falls back to the reference, and an
    explicit backend="fla" says what to use instead (under NCCL a rank stuck in Triton would hang the others)."""
    from types import SimpleNamespace

    from k3.ops.kda import fla

    monkeypatch.setattr(fla, "_fla_ops", lambda: ("chunk", "recurrent"))  # as on a GPU with fla-core
    for dtype in fla.FLA_DTYPES:
        assert fla.fla_dtype_error(torch.zeros(1, dtype=dtype)) is None
        assert fla.fla_available(SimpleNamespace(is_cuda=True, dtype=dtype))
    assert not fla.fla_available(SimpleNamespace(is_cuda=True, dtype=torch.float64))
    monkeypatch.delenv("K3_KDA_BACKEND", raising=False)
    monkeypatch.setattr(kda_ops, "fla_available", fla.fla_available)
    assert resolve_backend("auto", SimpleNamespace(is_cuda=True, dtype=torch.float64)) == "torch"
    assert resolve_backend("auto", SimpleNamespace(is_cuda=True, dtype=torch.bfloat16)) == "fla"
    q = torch.zeros(1, 4, 1, 2, dtype=torch.float64)
    for call in (fla.fla_chunk_kda, fla.fla_fused_recurrent_kda):
        with pytest.raises(ValueError, match=r"backend='fla': .*bf16, fp16 or fp32.*not torch.float64.*'torch'"):
            call(q, q, q, q, q[..., 0])
