"""Spawning process groups for the multi-process tests: one rendezvous file, real tracebacks.

``K3_TEST_BACKEND`` picks the backend (read when this module is imported):
  - "gloo" (default): every rank on the CPU.
  - "nccl": rank r on cuda:r (``torch.cuda.set_device(r)`` and ``torch.set_default_device("cuda:r")``, so the
    checks' factory calls land there), TF32 off and ``K3_KDA_BACKEND=torch`` (the pure-torch reference kernels,
    fp64-capable) so that the comparisons stay exact; a test of R ranks is skipped with fewer than R GPUs.
      K3_TEST_BACKEND=nccl python -m pytest -q -m distributed tests/distributed
"""

import datetime
import inspect
import os
import sys
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BACKENDS = ("gloo", "nccl")


def backend_from_env() -> str:
    """The backend named by ``K3_TEST_BACKEND`` ("gloo" when unset or empty); ValueError for anything else."""
    name = os.environ.get("K3_TEST_BACKEND", "").strip() or "gloo"
    if name not in BACKENDS:
        raise ValueError(f"K3_TEST_BACKEND={os.environ['K3_TEST_BACKEND']!r} is not a supported test backend; "
                         f"expected one of {BACKENDS} (unset means 'gloo')")
    return name


BACKEND = backend_from_env()
NCCL = BACKEND == "nccl"


def test_device(rank: int) -> torch.device:
    """The device of rank ``rank``'s tensors in a spawned check: cuda:rank under NCCL, else the CPU."""
    return torch.device("cuda", rank) if NCCL else torch.device("cpu")


test_device.__test__ = False  # a helper: pytest must not collect it where a test module imports it


def _unavailable(world: int) -> str | None:
    """Why ``world`` ranks of BACKEND cannot run here, or None when they can."""
    if not dist.is_available():
        return "needs torch.distributed"
    if not NCCL:
        return None if dist.is_gloo_available() else "needs torch.distributed with the gloo backend"
    if not dist.is_nccl_available():
        return "K3_TEST_BACKEND=nccl: this torch build has no NCCL backend"
    gpus = torch.cuda.device_count()
    if gpus < world:
        return f"K3_TEST_BACKEND=nccl: {world} ranks need {world} CUDA GPUs (one per rank), {gpus} visible"
    return None


def needs_backend(world: int):
    """Skip unless ``world`` ranks can run on BACKEND (gloo: any CPU; nccl: at least ``world`` GPUs)."""
    reason = _unavailable(world)
    return pytest.mark.skipif(reason is not None, reason=reason or "")


def worlds(*sizes: int) -> list:
    """``@pytest.mark.parametrize("world", worlds(2, 4))``: ids R2, R4, each skipped where it cannot run."""
    return [pytest.param(w, marks=needs_backend(w), id=f"R{w}") for w in sizes]


needs_gloo = needs_backend(2)  # the historical name: a 2-rank test on BACKEND (gloo, or nccl with 2 GPUs)


def _worker(rank, check, world, init_file, backend):
    torch.set_num_threads(1)
    kwargs = {}
    if backend == "nccl":
        os.environ["K3_KDA_BACKEND"] = "torch"  # fla's Triton kernels have no fp64 and are not exact
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.cuda.set_device(rank)
        torch.set_default_device(f"cuda:{rank}")
        if "device_id" in inspect.signature(dist.init_process_group).parameters:
            kwargs["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60), **kwargs)
    try:
        check(rank, world)
        dist.barrier()  # nobody tears its process group down while a peer is still in a collective
        if backend == "nccl":
            torch.cuda.synchronize()  # surface asynchronous CUDA errors inside the try
    except BaseException:  # mp.spawn may report a peer's "connection closed" first: print the real failure
        print(f"rank {rank} of {world} ({backend}):\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        raise
    finally:
        dist.destroy_process_group()


def spawn(check, world: int, tmp_path) -> None:
    """Run ``check(rank, world)`` (a module-level function) in ``world`` processes joined by BACKEND."""
    reason = _unavailable(world)
    if reason is not None:
        pytest.skip(reason)
    mp.spawn(_worker, args=(check, world, str(tmp_path / "rendezvous"), BACKEND), nprocs=world, join=True)
