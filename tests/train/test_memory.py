"""Activation memory policies (k3.train.memory) against keeping everything: the same loss and gradients, less saved.

The tiny model with its MTP layer on packed documents. The loss is exact (bitwise): recomputation repeats the same
operations, offloading moves exact copies. Gradients agree to float rounding (stated: RMS ratio 1e-6; measured 0
here): a recomputed region can change the order in which autograd sums a tensor's gradient contributions. What is
saved is measured through the saved-tensor hooks themselves (``SavedStats``: each storage once, at the end of the
forward), deterministically.
"""

import gc
import warnings

import pytest
import torch

from k3.config import K3Config
from k3.model.transformer import K3ForCausalLM
from k3.train.memory import POLICIES, ActivationManager, MemoryPolicy
from tests.conftest import assert_close

VOCAB = 128
ALL_OFFLOADED = MemoryPolicy(POLICIES["efficient"].regions, layers="offload", offload_min_bytes=0)


_RUNS = {}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny shapes: one intra-op thread is fastest, and much steadier on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run(policy, attn_res="block"):
    """(loss, gradients, SavedStats) of one training forward and backward under ``policy`` (computed once)."""
    key = (repr(policy), attn_res)
    if key not in _RUNS:
        _RUNS[key] = _run(policy, attn_res)
    return _RUNS[key]


def _run(policy, attn_res):
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("tiny").replace(vocab_size=VOCAB).variant(attn_res=attn_res)).train()
    manager = ActivationManager(policy)
    manager.attach(model)
    ids, cu = torch.randint(0, VOCAB, (1, 64)), torch.tensor([0, 20, 21, 45, 64])
    with manager.forward() as stats:
        out = model(ids, cu_seqlens=cu, labels=ids, mtp_weight=0.3, return_logits=False)
    out["loss"].backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return out["loss"].detach(), grads, stats


@pytest.mark.parametrize("policy", ["efficient", "offload", "recompute", ALL_OFFLOADED],
                         ids=["efficient", "offload", "recompute", "offload-everything"])
def test_every_policy_gives_the_loss_and_gradients_of_keeping_everything(policy):
    loss, grads, _ = run(policy)
    ref_loss, ref_grads, _ = run("keep")
    assert torch.equal(loss, ref_loss)
    assert set(grads) == set(ref_grads) and any(n.startswith("mtp.") for n in grads)
    for name, g in ref_grads.items():
        assert_close(name, g, grads[name], 1e-6)


def test_policies_lower_what_is_saved():
    keep = run("keep")[2]
    efficient, offload, recompute = (run(p)[2] for p in ("efficient", ALL_OFFLOADED, "recompute"))
    assert keep.offloaded_bytes == keep.recompute_input_bytes == 0
    assert efficient.kept_bytes < keep.kept_bytes and efficient.recompute_input_bytes > 0
    assert offload.kept_bytes < efficient.kept_bytes / 10 and offload.offloaded_bytes > 0
    assert recompute.kept_bytes < keep.kept_bytes / 10
    assert _run("keep", "block")[2].kept_bytes == keep.kept_bytes  # deterministic


def test_offload_respects_its_size_threshold():
    small_kept = run(MemoryPolicy(layers="offload", offload_min_bytes=1 << 40))[2]  # nothing is that large
    assert small_kept.offloaded_bytes == 0


@pytest.mark.parametrize("attn_res", ["block", "full"])
def test_recomputed_attn_res_saves_no_more_than_a_plain_residual(attn_res):
    """SPEC §8: with the AttnRes mix (and the pre-norm after it) recomputed, a layer saves what a plain residual
    layer saves (the depth sources are the residual stream's own tensors): no more bytes than attn_res="none"."""
    attn_res_only = MemoryPolicy({"attn_res": "recompute"})
    plain = run("keep", attn_res="none")[2].kept_bytes
    assert run("keep", attn_res=attn_res)[2].kept_bytes > plain
    assert run(attn_res_only, attn_res=attn_res)[2].kept_bytes <= plain


def test_recomputed_moe_keeps_only_its_dispatch_input():
    moe_only = MemoryPolicy({"moe_experts": "recompute"})
    keep, moe = run("keep")[2], run(moe_only)[2]
    assert moe.kept_bytes < keep.kept_bytes and 0 < moe.recompute_input_bytes


def test_policy_errors_name_the_choice():
    with pytest.raises(ValueError, match="unknown memory policy 'fast'"):
        ActivationManager("fast")
    with pytest.raises(ValueError, match="region 'mlp'"):
        MemoryPolicy({"mlp": "recompute"})
    with pytest.raises(ValueError, match="choose one"):
        MemoryPolicy({"attn_res": "recompute"}, layers="recompute")


class _Stop(Exception):
    pass


def _graph_tensors() -> int:
    """Tensors alive with a grad_fn: activations of some autograd graph."""
    gc.collect()
    with warnings.catch_warnings():  # (isinstance on every object touches torch.distributed's deprecated names)
        warnings.simplefilter("ignore", FutureWarning)
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.grad_fn is not None)


@pytest.mark.parametrize("policy", ["keep", "efficient", "offload", "recompute"])
def test_a_forward_that_fails_frees_its_activations(policy):
    """A forward that stops half-way (out of memory, say) leaves no activation alive once its exception is gone:
    the next step, or the next policy of a benchmark, gets the memory back. (Two cycles through C++ that no
    collector breaks did not: the saved-tensor hook saving the activation itself, not a detached alias, so a node
    saving its own output held its grad_fn; and a recomputed layer's checkpointed function closing over the depth
    stream that holds the function's own outputs.)"""
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("tiny").replace(vocab_size=VOCAB)).train()
    manager = ActivationManager(policy)
    manager.attach(model)

    def stop(m, a):
        raise _Stop

    model.model.layers[-1].register_forward_pre_hook(stop)
    ids = torch.randint(0, VOCAB, (1, 64))
    before = _graph_tensors()
    with pytest.raises(_Stop), manager.forward():
        model(ids, cu_seqlens=torch.tensor([0, 30, 64]), labels=ids, return_logits=False)
    assert _graph_tensors() == before, "activations of the failed forward outlived it"
