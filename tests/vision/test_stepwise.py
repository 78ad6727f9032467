"""The tower in bounded pieces (k3.vision.stepwise) and the engine that runs them between steps (k3.inference.images):
the pieces give encode_images' result, each about the FLOPs asked; while a large image encodes, a running text
request decodes a token every step, and each step spends at most about its image budget."""

import pytest
import torch

from k3 import K3Config
from k3.data.tokenizer import train_tokenizer
from k3.inference.api import GenerationRequest, PromptImage, SamplingParams
from k3.inference.engine import Engine, EngineConfig
from k3.vision import K3ForConditionalGeneration, VisionConfig

PLACEHOLDER = 1


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(["a red circle", "the number 42", "what shape is it?"] * 20, 300,
                           special_tokens=("<|endoftext|>", "<|media_pad|>"))


@pytest.fixture(scope="module")
def model(tok):
    torch.manual_seed(0)
    cfg = K3Config.preset("tiny").replace(vocab_size=tok.get_vocab_size(), num_nextn_predict_layers=0)
    return K3ForConditionalGeneration(cfg, VisionConfig.preset("tiny"), media_placeholder_token_id=PLACEHOLDER).eval()


@pytest.mark.parametrize("grid,piece_flops", [((6, 8), 2e5), ((6, 8), 1e12), ((2, 2), 1.0)])
@torch.no_grad()
def test_pieces_equal_encode_images(model, grid, piece_flops):
    pixels = torch.randn(grid[0] * grid[1], 3, 14, 14, generator=torch.Generator().manual_seed(1))
    want = model.encode_images(pixels, [grid])
    job = model.encode_image_pieces(pixels, grid, piece_flops)
    costs = []
    while True:
        try:
            costs.append(next(job))
        except StopIteration as done:
            got = done.value
            break
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    layers = model.vision_config.vt_num_hidden_layers
    assert len(costs) >= 2 + 2 * layers  # embed, q/k/v and attention passes of every layer, projector
    if piece_flops == 2e5:  # above any one row's cost: C rows per piece, none over the ask
        assert len(costs) > 4 * (2 + 2 * layers) and max(costs) <= piece_flops


def _image(grid, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(grid[0] * grid[1], 3, 14, 14, generator=g)


@torch.no_grad()
def test_text_request_keeps_decoding_while_an_image_encodes(model, tok):
    budget = 5e6
    eng = Engine(model, tok, EngineConfig(num_pages=64, page_tokens=64, hash_block=16, prefill_chunk=64,
                                          step_tokens=128, max_batch=4, image_step_flops=budget))
    spent, real = [], eng.runner.images.encode
    eng.runner.images.encode = lambda wanted, b: spent.append(real(wanted, b)) or spent[-1]
    text = eng.submit(GenerationRequest((20, 21, 22), SamplingParams(max_tokens=40, temperature=0,
                                                                     ignore_eos=True)))
    eng.step()  # the text request is decoding
    grid = (16, 16)  # 256 patches: the tower costs many budgets
    n = grid[0] * grid[1] // 4
    ids = (30,) + (PLACEHOLDER,) * n + (31,)
    pixels = _image(grid, 3)
    img = eng.submit(GenerationRequest(ids, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),
                                       images=(PromptImage(1, n, pixels, grid, b"\x03" * 16),)))
    img_seq, text_seq = eng.seqs[img.id], eng.seqs[text.id]
    steps = 0
    while img_seq.num_computed <= 1 and steps < 500:  # its prefill waits before the image until it is encoded
        before = text_seq.generated
        eng.step()
        steps += 1
        assert text_seq.generated == before + 1  # a token every step while the image encodes
    # the image took many steps (from the one after its admission), the text request decoded in each
    assert steps > 10 and len(spent) == steps - 1
    assert spent and max(spent) <= 1.25 * budget  # pieces of a quarter of the budget: at most one over
    while eng.has_work:
        eng.step()
    got = [e.token_id for e in list(img)[:-1]]
    ref_ids, ref = list(ids), []
    for _ in range(2):  # the full forward with the image at once
        t = int(model(torch.tensor([ref_ids]), pixels, [grid]).logits[0, -1].argmax())
        ref_ids.append(t)
        ref.append(t)
    assert got == ref
