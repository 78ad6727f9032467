"""Spawning gloo process groups for the multi-process CPU tests: one rendezvous file, real tracebacks."""

import datetime
import sys
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

needs_gloo = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="needs torch.distributed with the gloo backend")


def _worker(rank, check, world, init_file):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        check(rank, world)
    except BaseException:  # mp.spawn may report a peer's "connection closed" first: print the real failure
        print(f"rank {rank} of {world}:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        raise
    finally:
        dist.destroy_process_group()


def spawn(check, world: int, tmp_path) -> None:
    """Run ``check(rank, world)`` (a module-level function) in ``world`` processes joined by gloo."""
    mp.spawn(_worker, args=(check, world, str(tmp_path / "rendezvous")), nprocs=world, join=True)
