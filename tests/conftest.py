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


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
