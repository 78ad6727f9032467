import pytest
import torch
import torch.nn.functional as F

from k3 import K3Config, K3ForCausalLM

VARIANTS = {
    "k3": {},
    "attn_res=full": {"attn_res": "full"},
    "attn_res=none": {"attn_res": "none"},
    "gate=softplus": {"gate": "softplus"},
    "swiglu": {"activation": "swiglu"},
    "no-latent-moe": {"latent_moe": False},
    "no-latent-norm": {"latent_moe_norm": False},
    "all-mla": {"layers": "all-mla"},
    "all-kda": {"layers": "all-kda"},
}


def tiny_model(**variant):
    torch.manual_seed(0)
    return K3ForCausalLM(K3Config.preset("tiny").variant(**variant)).eval()


@pytest.mark.slow
@pytest.mark.parametrize("name", list(VARIANTS))
def test_causal_for_every_variant(name):
    model = tiny_model(**VARIANTS[name])
    x = torch.randint(0, 1024, (2, 40))
    base = model(x)["logits"]
    for t in (0, 17, 38):
        y = x.clone()
        y[:, t + 1:] = torch.randint(0, 1024, y[:, t + 1:].shape)
        other = model(y)["logits"]
        torch.testing.assert_close(other[:, : t + 1], base[:, : t + 1], atol=1e-5, rtol=1e-5)
        assert not torch.allclose(other[:, t + 1:], base[:, t + 1:])


@pytest.mark.parametrize("name", ["k3", "attn_res=full", "all-mla"])
def test_packed_documents_do_not_see_each_other(name):
    model = tiny_model(**VARIANTS[name])
    docs = [torch.randint(0, 1024, (1, n)) for n in (13, 1, 30)]
    cu = torch.tensor([0, 13, 14, 44])
    packed = model(torch.cat(docs, 1), cu_seqlens=cu)["logits"]
    for d, a in zip(docs, cu[:-1]):
        alone = model(d)["logits"]
        torch.testing.assert_close(packed[:, a:a + d.shape[1]], alone, atol=1e-5, rtol=1e-4)


def test_loss_is_mean_next_token_ce_and_mtp_is_added():
    model = tiny_model()
    x = torch.randint(0, 1024, (2, 24))
    out = model(x, labels=x)
    ref = F.cross_entropy(out["logits"][:, :-1].reshape(-1, 1024), x[:, 1:].reshape(-1))
    torch.testing.assert_close(out["lm_loss"], ref)
    assert "mtp_loss" in out
    torch.testing.assert_close(out["loss"], out["lm_loss"] + 0.3 * out["mtp_loss"])
    torch.testing.assert_close(model(x, labels=x, mtp_weight=0.0)["loss"], ref)


def test_packed_loss_never_predicts_across_a_boundary():
    model = K3ForCausalLM(K3Config.preset("tiny").replace(num_nextn_predict_layers=0)).eval()
    a, b = torch.randint(0, 1024, (1, 10)), torch.randint(0, 1024, (1, 7))
    packed = model(torch.cat([a, b], 1), cu_seqlens=torch.tensor([0, 10, 17]), labels=torch.cat([a, b], 1))
    la, lb = model(a, labels=a)["loss"], model(b, labels=b)["loss"]
    torch.testing.assert_close(packed["loss"], (la * 9 + lb * 6) / 15, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk", [7, 64])
def test_chunked_head_loss_equals_the_full_logits_loss_and_gradients(chunk):
    """return_logits=False (training): the CE chunk by chunk with the head recomputed in the backward, never the
    [B,T,V] logits; packed documents, MTP on, a chunk size that does not divide T (7) and one larger than T (64)."""
    model = tiny_model().train()
    x = torch.randint(0, 1024, (1, 40))
    cu = torch.tensor([0, 11, 12, 30, 40])  # a one-token document too: it predicts nothing
    full = model(x, cu_seqlens=cu, labels=x)
    full["loss"].backward()
    g_full = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    out = model(x, cu_seqlens=cu, labels=x, return_logits=False, loss_chunk=chunk)
    assert "logits" not in out
    for key in ("loss", "lm_loss", "mtp_loss"):
        torch.testing.assert_close(out[key], full[key], atol=1e-6, rtol=1e-6)
    out["loss"].backward()
    g = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(g) == set(g_full)
    for n in g:
        torch.testing.assert_close(g[n], g_full[n], atol=1e-6, rtol=1e-5, msg=n)
    with pytest.raises(ValueError, match="pass labels"):
        model(x, return_logits=False)
    with pytest.raises(ValueError, match="loss_chunk"):
        model(x, labels=x, return_logits=False, loss_chunk=0)


def test_activation_checkpointing_gives_identical_gradients():
    model = tiny_model().train()
    x = torch.randint(0, 1024, (2, 20))
    model(x, labels=x)["loss"].backward()
    g1 = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model.model.gradient_checkpointing = True
    model(x, labels=x)["loss"].backward()
    for n, p in model.named_parameters():
        if n in g1:
            torch.testing.assert_close(p.grad, g1[n], atol=1e-6, rtol=1e-5)


def test_every_parameter_learns_except_the_single_source_query():
    model = tiny_model().train()
    with torch.no_grad():  # pseudo-queries start at zero, where their key norms get no gradient yet
        for n, p in model.named_parameters():
            if n.endswith("_res_proj.weight"):
                p.normal_()
    x = torch.randint(0, 1024, (2, 20))
    model(x, labels=x)["loss"].backward()
    no_grad = [n for n, p in model.named_parameters() if p.grad is None or p.grad.abs().sum() == 0]
    # layer 0's attention input is the embedding alone (one source), so its pseudo-query has nothing to weigh
    assert set(no_grad) <= {"model.layers.0.self_attention_res_proj.weight",
                            "model.layers.0.self_attention_res_norm.weight"}, no_grad


def test_bad_input_shapes_are_explained():
    model = tiny_model()
    with pytest.raises(ValueError, match=r"\[B,T\]"):
        model(torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="batch 1"):
        model(torch.zeros(2, 5, dtype=torch.long), cu_seqlens=torch.tensor([0, 5]))


def test_the_depth_stream_is_in_autocast_dtype():
    """Under bf16 autocast (how k3 trains on CUDA) the embedding enters the depth stream in bf16, so every AttnRes
    source, block sum and the trunk's output are bf16 (not the fp32 of the embedding table); the loss stays within
    bf16 rounding of the fp32 forward's. Outside autocast nothing changes."""
    model = tiny_model()
    x = torch.randint(0, 1024, (2, 24))
    seen = []
    hook = model.model.layers[2].register_forward_pre_hook(lambda m, args: seen.append(args[0].partial.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = model.model(x)
        loss_bf16 = model(x, labels=x)["loss"]
    hook.remove()
    assert h.dtype == torch.bfloat16 and set(seen) == {torch.bfloat16}
    assert model.model(x).dtype == torch.float32
    loss = model(x, labels=x)["loss"]
    assert abs(loss_bf16.item() - loss.item()) < 0.02 * loss.item()
