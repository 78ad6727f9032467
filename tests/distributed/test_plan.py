"""`torchrun --nproc_per_node 2 -m k3 train` with --dp 2, --cp 2 or --ep 2 (k3.distributed.plan.ParallelPlan, gloo)
against one process at the same global batch; the plan's sizes and errors.

With K3_TEST_BACKEND=nccl every run passes ``--device cuda`` (torchrun's ranks then take NCCL and cuda:LOCAL_RANK)
and K3_KDA_BACKEND=torch (unless set), the tolerances allow for bf16 autocast (below), and a test of N processes is
skipped with fewer than N GPUs."""


import pytest
import torch

from .gloo import needs_backend
from .runs import LOAD_ATOL, LOSS_RTOL, ONE, WEIGHT_ATOL, run, torchrun, train_run as _run


@pytest.mark.slow
@pytest.mark.distributed
@needs_backend(2)
def test_dp2_reproduces_the_single_process_loss_curve(tmp_path):
    single = _run(ONE + ["--batch-size", "4"], tmp_path / "one")
    dp = _run(torchrun(2) + ["--batch-size", "2", "--dp", "2"], tmp_path / "dp")
    assert [r["step"] for r in dp] == [1, 2, 3, 4]
    for a, b in zip(single, dp):
        # same samples, the global token mean in both: equal up to float summation order (stated tolerance 1e-5)
        assert abs(a["loss"] - b["loss"]) < LOSS_RTOL * a["loss"], (a, b)
        assert a.get("val_loss") == pytest.approx(b.get("val_loss"), rel=LOSS_RTOL) if "val_loss" in a else True
        # Quantile Balancing's histogram all-reduce gives the biases of the single-process global batch
        assert abs(a["load_max_over_mean"] - b["load_max_over_mean"]) <= LOAD_ATOL, (a, b)
        assert a["tokens"] == b["tokens"]
    ck = tmp_path / "dp" / "checkpoint"
    assert (ck / "optimizer.rank0.pt").exists() and (ck / "optimizer.rank1.pt").exists()
    assert (ck / "model.safetensors").exists()


def test_init_from_env_follows_the_device_argument(monkeypatch):
    """Single process (no process group): the device is the TrainConfig's; None and "auto" keep the old choice."""
    from k3.distributed.process_group import init_from_env

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    auto = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert init_from_env() == init_from_env("auto") == (0, 1, auto)
    assert init_from_env("cpu") == (0, 1, torch.device("cpu"))
    assert init_from_env("cuda:1") == (0, 1, torch.device("cuda", 1))
    monkeypatch.setenv("WORLD_SIZE", "2")  # under torchrun: refused before any process group is created
    with pytest.raises(ValueError, match="cuda:LOCAL_RANK"):
        init_from_env("cuda:1")


@pytest.mark.slow
@pytest.mark.distributed
def test_dp_refuses_a_mismatched_process_count(tmp_path):
    r = run(ONE + ["--dp", "2"], tmp_path / "x", timeout=300)
    assert r.returncode == 1 and "torchrun --nproc_per_node" in r.stderr


@pytest.mark.slow
@pytest.mark.distributed
@needs_backend(2)
def test_dp_resume_equals_uninterrupted(tmp_path):
    cmd = torchrun(2) + ["--batch-size", "2", "--dp", "2"]
    straight = _run(cmd, tmp_path / "a")
    _run(cmd + ["--stop-after", "2"], tmp_path / "b")
    resumed = _run(cmd, tmp_path / "b")  # the same command again resumes from step 2
    assert [(r["step"], r["loss"]) for r in resumed] == [(r["step"], r["loss"]) for r in straight]


@pytest.mark.slow
@pytest.mark.distributed
@needs_backend(2)
def test_cp2_reproduces_the_single_process_loss_curve(tmp_path):
    """`--cp 2`: every sequence split along time over two ranks (KCP in the KDA layers, gathered MLA latents),
    the MTP layer and QK-clip included; with `--memory-policy efficient` (its AttnRes and MoE regions, recomputed
    in the backward, sit inside the CP forward) against one process keeping everything."""
    common = ["--batch-size", "2"]
    single = _run(ONE + common, tmp_path / "one")
    cp = _run(torchrun(2) + common + ["--cp", "2", "--memory-policy", "efficient"], tmp_path / "cp")
    for a, b in zip(single, cp):
        assert abs(a["loss"] - b["loss"]) < LOSS_RTOL * a["loss"], (a, b)
        assert abs(a["load_max_over_mean"] - b["load_max_over_mean"]) <= LOAD_ATOL, (a, b)
    assert [r["step"] for r in cp] == [1, 2, 3, 4]


@pytest.mark.slow
@pytest.mark.distributed
@needs_backend(2)
def test_ep2_reproduces_the_single_process_loss_curve_and_saves_full_experts(tmp_path):
    """`--ep 2`: routed experts sharded over two ranks, MoonEP-balanced all-to-all dispatch; with `--memory-policy
    efficient`, whose recomputed MoE region runs the dispatch's all-to-alls again in the backward."""
    single = _run(ONE + ["--batch-size", "4"], tmp_path / "one")
    ep = _run(torchrun(2) + ["--batch-size", "2", "--ep", "2", "--memory-policy", "efficient"], tmp_path / "ep")
    for a, b in zip(single, ep):
        assert abs(a["loss"] - b["loss"]) < LOSS_RTOL * a["loss"], (a, b)
        assert abs(a["load_max_over_mean"] - b["load_max_over_mean"]) <= LOAD_ATOL, (a, b)
    from k3.pretrained import load_pretrained

    full = load_pretrained(tmp_path / "ep" / "checkpoint")  # the experts were gathered back to [E, ...]
    assert full.model.layers[1].block_sparse_moe.experts.w1.shape[0] == full.config.num_experts
    ref = load_pretrained(tmp_path / "one" / "checkpoint").state_dict()
    worst, name = max(((v - ref[k]).abs().max().item(), k) for k, v in full.state_dict().items())
    assert worst < WEIGHT_ATOL, (worst, name)  # every weight, MTP and router biases included, after 4 steps (CPU ~1e-5)


@pytest.mark.slow
@pytest.mark.distributed
@needs_backend(2)
def test_ep2_compiled_reproduces_the_single_process_loss_curve(tmp_path):
    """`--ep 2 --compile`: the compiled FFN runs the expert-parallel bank (host-planned splits, all-to-alls)
    eagerly inside it, as `bench_scale.py` measures it; inductor only reorders float sums (tolerance 1e-4)."""
    single = _run(ONE + ["--batch-size", "4"], tmp_path / "one")
    ep = _run(torchrun(2) + ["--batch-size", "2", "--ep", "2", "--compile"], tmp_path / "ep")
    assert [r["step"] for r in ep] == [1, 2, 3, 4]
    for a, b in zip(single, ep):
        assert abs(a["loss"] - b["loss"]) < max(LOSS_RTOL, 1e-4) * a["loss"], (a, b)


def test_parallel_dims_sizes_and_errors():
    from k3.distributed.plan import ParallelDims

    dims = ParallelDims(2, 3, 4)
    assert (dims.world, dims.batch_slices) == (24, 6)  # every (dp, ep) pair trains on its own slice
    assert ParallelDims().world == 1
    with pytest.raises(ValueError, match="--ep must be a positive integer"):
        ParallelDims(ep=0)
    with pytest.raises(ValueError, match=r"--dp 2 x --ep 3 x --cp 4 needs 24 processes but 2 are running: .*"
                                         r"torchrun --nproc_per_node 24"):
        dims.check(2)


def test_one_process_plan_is_the_plain_model_loss(monkeypatch):
    """Sizes 1: no process group, nothing sharded, and the loss, the logged losses and the gradients are exactly
    (bitwise) the model's own; ``mean`` is the identity."""
    from k3.config import K3Config
    from k3.distributed.plan import ParallelDims, ParallelPlan
    from k3.model.transformer import K3ForCausalLM
    from k3.train.plan import TrainingPlan

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    plan = ParallelPlan(ParallelDims(), device="cpu")
    assert isinstance(plan, TrainingPlan) and (plan.rank, plan.world, plan.batch_slices) == (0, 1, 1)
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("tiny").replace(vocab_size=128)).train()
    names = [n for n, _ in model.named_parameters()]
    plan.shard(model)
    assert [n for n, _ in model.named_parameters()] == names
    batch = {"input_ids": torch.randint(0, 128, (1, 48)), "cu_seqlens": torch.tensor([0, 17, 48])}
    step = plan.loss(model, batch, 0.3)
    step.loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    ids, cu = batch["input_ids"], batch["cu_seqlens"]
    ref = model(ids, cu_seqlens=cu, labels=ids, mtp_weight=0.3, return_logits=False)
    ref["loss"].backward()
    assert torch.equal(step.loss, ref["loss"]) and torch.equal(step.lm_loss, ref["lm_loss"])
    assert torch.equal(step.mtp_loss, ref["mtp_loss"]) and step.tokens == 48
    assert all(torch.equal(g, model.get_parameter(n).grad) for n, g in got.items())
    x = torch.tensor(2.5)
    assert plan.mean(x) is x
