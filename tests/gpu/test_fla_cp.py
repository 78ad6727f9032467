"""Context parallelism for KDA on 2 GPUs (NCCL): fla-core's CP and k3's KCP against single-process fla chunk_kda.

Two processes, one GPU each, build the same global inputs (bf16 q/k/v as in test_fla.py, H=16, K=V=128, T=2*4096,
packed documents) and run, behind the GLOBAL interface ``k3.distributed.kcp.cp_chunk_kda``:
  (a) impl="fla": fla's own CP (``build_cp_context`` + ``chunk_kda(..., cp_context=...)``);
  (b) impl="k3", backend="fla": fla's kernels for the local chunks, our scan for the cross-rank state;
  (c) fla's chunk_kda on the whole sequence in one process (the reference);
and compare o and the gradients of q, k, v, g, beta of (a) and (b) with (c) on each rank's slice (RMS relative
error, test_fla.py's metric), over the whole slice and over the 256 tokens next to the cut, where the carried
state (forward) and its adjoint (backward) matter. Gates in (-0.1, 0): the state lives for ~100s of tokens, so a
wrong cross-rank state cannot hide behind the decay. Only H=16, K=V=128 (test_fla.py's kernel keys): each process
autotunes fla's kernels once (KCP's summary pass adds V=256 keys, fla's CP its merge kernels).
"""

import datetime
import sys
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = [pytest.mark.gpu, pytest.mark.distributed]
pytest.importorskip("fla.ops.kda")
pytest.importorskip("fla.ops.cp")

WORLD, T, H, D = 2, 2 * 4096, 16, 128
LO, LOWER_BOUND, TOL, NEAR = -0.1, -5.0, 0.02, 256
# global layouts (cut at 4096): a document crossing the cut plus boundaries that do not; a document starting exactly
# at the cut; one document over everything
LAYOUTS = [[0, 1000, 5000, 6500, T], [0, 2000, 4096, T], [0, T]]
NAMES = ["o", "dq", "dk", "dv", "dg", "dbeta"]


def _ratio(ref, out) -> float:
    """tests.conftest.assert_close's metric: RMS(out - ref) / RMS(ref)."""
    ref, out = ref.detach().double(), out.detach().double()
    return (ref - out).pow(2).mean().sqrt().item() / (ref.pow(2).mean().sqrt().item() + 1e-12)


def _run(fn, xs, do):
    """(o, grads of q, k, v, g, beta) of loss <o, do> for fresh leaves of ``xs``."""
    leaves = [x.detach().clone().requires_grad_() for x in xs]
    o = fn(*leaves)
    grads = torch.autograd.grad((o.float() * do.float()).sum(), leaves)
    return [o.detach(), *grads]


def _check(rank):
    from k3.distributed.kcp import cp_chunk_kda, equal_split
    from k3.ops.kda import chunk_kda
    from tests.gpu.test_fla import inputs

    start, end = equal_split(T, WORLD, rank)
    near = slice(0, NEAR) if rank else slice(-NEAR, None)
    failures, lines = [], []
    for layout in LAYOUTS:
        torch.manual_seed(0)
        xs = [x.detach() for x in inputs(1, T, H, D, lo=LO)]
        do = torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16)
        for x in xs + [do]:  # the same global inputs on both ranks whatever each device's generator does
            dist.broadcast(x, 0)
        cu = torch.tensor(layout, device="cuda")
        ref = _run(lambda *a: chunk_kda(*a, cu_seqlens=cu, lower_bound=LOWER_BOUND, backend="fla")[0], xs, do)
        ref = [r[:, start:end] for r in ref]
        local = [x[:, start:end] for x in xs]
        for impl in ("fla", "k3"):
            t0 = time.perf_counter()
            out = _run(lambda *a: cp_chunk_kda(*a, cu, impl=impl, lower_bound=LOWER_BOUND, backend="fla"),
                       local, do[:, start:end])
            for name, r, x in zip(NAMES, ref, out):
                whole, cut = _ratio(r, x), _ratio(r[:, near], x[:, near])
                lines.append(f"rank {rank} {impl:3s} {str(layout):28s} {name:5s} slice {whole:.2e}  near cut {cut:.2e}"
                             f"  ({time.perf_counter() - t0:.0f} s, the first call of each impl autotunes)")
                print(lines[-1], flush=True)  # as it comes (run with -s): a run stopped at a limit says how far it got
                if not (whole <= TOL and cut <= TOL):  # also catches NaN
                    failures.append(lines[-1])
    assert not failures, f"relative RMS error above {TOL}:\n" + "\n".join(failures)


def _worker(rank, init_file):
    torch.cuda.set_device(rank)
    # generous timeout: each rank autotunes fla's kernels (minutes) between collectives
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(minutes=20), device_id=torch.device("cuda", rank))
    try:
        _check(rank)
    except BaseException:
        print(f"rank {rank} of {WORLD}:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        raise
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < WORLD
                    or not dist.is_available() or not dist.is_nccl_available(),
                    reason=f"needs {WORLD} CUDA devices and NCCL")
def test_fla_cp_and_kcp_match_single_process_fla(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "rendezvous"),), nprocs=WORLD, join=True)
