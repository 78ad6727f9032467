import os
import signal

import pytest
import torch

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    # a suite started in the background of a non-interactive shell (``cmd &``, nohup) inherits SIGINT ignored, and
    # so would every process it starts: the Ctrl-C tests (k3 chat / generate / train) need it delivered as a
    # terminal does
    signal.signal(signal.SIGINT, signal.default_int_handler)

if not torch.cuda.is_available():
    # Triton kernels (ours and fla-core's) run on CPU tensors in Triton's interpreter: set before any kernel module
    # is imported (``@triton.jit`` reads it when a kernel is defined); tests/ops/test_decode_kernels.py uses it
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def assert_close(name, ref, tri, ratio):
    """fla's relative check: RMS of the difference over RMS of the reference must stay under ``ratio``."""
    ref, tri = ref.detach().double(), tri.detach().double()
    err = (ref - tri).pow(2).mean().sqrt().item()
    base = ref.pow(2).mean().sqrt().item() + 1e-12
    assert err / base <= ratio, f"{name}: rms err {err:.3e}, rms {base:.3e}, ratio {err / base:.3e} > {ratio}"


_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


def pytest_make_parametrize_id(config, val, argname):
    """Readable parametrised ids, flash-linear-attention's style: each value named by its argument, so that
    ``parametrize("B,T,H,K", [(2, 100, 3, 16)])`` reads ``B2-T100-H3-K16`` (explicit ``ids=`` still win). Booleans
    read as the argument or ``no_`` it, dtypes as fp32 / bf16, strings as themselves, sequences joined by ``x``,
    dicts as key=value (``default`` when empty)."""
    if isinstance(val, bool):
        return argname if val else f"no_{argname}"
    if val is None:
        return f"no_{argname}"
    if isinstance(val, torch.dtype):
        return _DTYPES.get(val, str(val).removeprefix("torch."))
    if isinstance(val, (int, float)):
        return f"{argname}{val:g}" if isinstance(val, float) else f"{argname}{val}"
    if isinstance(val, str):
        return val
    if isinstance(val, (list, tuple, range)) and all(isinstance(v, (int, float)) for v in val):
        return f"{argname}" + "x".join(f"{v:g}" for v in val)
    if isinstance(val, dict):
        return "-".join(f"{k}={v}" for k, v in val.items()) or "default"
    return None


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
