"""The engine with images (SPEC §7, §10): greedy tokens equal K3ForConditionalGeneration's full forward, whether the
prefill chunks cut an image or not; the prefix cache hashes images, so a prompt that differs only in its image never
reuses the other image's cache, and the same image hits."""

import pytest
import torch

from k3 import K3Config
from k3.data.tokenizer import train_tokenizer
from k3.inference.api import GenerationRequest, PromptImage, SamplingParams
from k3.inference.engine import Engine, EngineConfig
from k3.vision import K3ForConditionalGeneration, VisionConfig

PLACEHOLDER = 1
GREEDY = SamplingParams(max_tokens=5, temperature=0)


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(["a red circle", "the number 42", "what shape is it?"] * 20, 300,
                           special_tokens=("<|endoftext|>", "<|media_pad|>"))


@pytest.fixture(scope="module")
def model(tok):
    torch.manual_seed(0)
    cfg = K3Config.preset("tiny").replace(vocab_size=tok.get_vocab_size(), num_nextn_predict_layers=0)
    return K3ForConditionalGeneration(cfg, VisionConfig.preset("tiny"), media_placeholder_token_id=PLACEHOLDER).eval()


def image(grid, seed):
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randn(grid[0] * grid[1], 3, 14, 14, generator=g)
    return pixels, grid, seed.to_bytes(16, "little")


def request(text_before, images, text_after):
    """ids: text, each image's placeholder run, ..., text; with the PromptImages."""
    ids, prompt_images = list(text_before), []
    for k, (pixels, grid, digest) in enumerate(images):
        n = grid[0] * grid[1] // 4
        prompt_images.append(PromptImage(len(ids), n, pixels, grid, digest))
        ids += [PLACEHOLDER] * n + [10 + k]
    return ids + list(text_after), tuple(prompt_images)


def reference_greedy(model, ids, images, n):
    pixels = torch.cat([im.pixels for im in images]) if images else None
    ids, out = list(ids), []
    with torch.no_grad():
        for _ in range(n):
            t = int(model(torch.tensor([ids]), pixels, [im.grid for im in images]).logits[0, -1].argmax())
            ids.append(t)
            out.append(t)
    return out


def run(eng, reqs, params=GREEDY):
    handles = [eng.submit(GenerationRequest(tuple(ids), params, images=ims)) for ids, ims in reqs]
    while eng.has_work:
        eng.step()
    events = [list(h) for h in handles]
    return [ev[-1] for ev in events], [[e.token_id for e in ev[:-1]] for ev in events]


@pytest.mark.parametrize("chunk", [64, 5, 3])
def test_greedy_with_images_equals_full_forward(model, tok, chunk):
    eng = Engine(model, tok, EngineConfig(num_pages=128, page_tokens=32, hash_block=8, checkpoint_every=1,
                                          prefill_chunk=chunk, step_tokens=64, max_batch=4))
    reqs = [request([20, 21, 22], [image((4, 6), 1), image((2, 2), 2)], [23, 24]),
            request([30], [image((6, 4), 3)], [31, 32, 33]),
            request([40, 41], [], [42])]
    finishes, tokens = run(eng, reqs, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    for (ids, ims), got in zip(reqs, tokens):
        assert got == reference_greedy(model, ids, ims, 5)
    assert not eng.runner.images.features and not eng.runner.images.jobs  # all dropped once prefilled
    assert eng.pool.pages_in_use == 0


def test_prefix_cache_tells_images_apart(model, tok):
    eng = Engine(model, tok, EngineConfig(num_pages=128, page_tokens=32, hash_block=4, checkpoint_every=1,
                                          prefill_chunk=64, step_tokens=64, max_batch=4))
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    text = list(range(20, 28))  # two full blocks before the image
    first = request(text, [image((4, 4), 5)], [50, 51, 52, 53, 54, 55, 56, 57])
    same_tokens_other_image = request(text, [image((4, 4), 6)], [50, 51, 52, 53, 54, 55, 56, 57])
    (f1,), (t1,) = run(eng, [first], params)
    (f2,), (t2,) = run(eng, [same_tokens_other_image], params)
    assert f1.cached_tokens == 0
    assert f2.cached_tokens == 8  # the two text blocks; nothing from the first image on
    assert t2 == reference_greedy(model, *same_tokens_other_image, 3)
    (f3,), (t3,) = run(eng, [first], params)  # the same image again: the cache covers it
    assert f3.cached_tokens > 8 + 4 and t3 == t1 == reference_greedy(model, *first, 3)


def test_image_requests_are_checked(model, tok):
    eng = Engine(model, tok, EngineConfig(num_pages=64, page_tokens=32, hash_block=8))
    ids, ims = request([20], [image((4, 4), 1)], [21])
    bad = PromptImage(ims[0].start + 1, ims[0].length, ims[0].pixels, ims[0].grid, ims[0].digest)
    with pytest.raises(ValueError, match="must all be the media placeholder token"):
        eng.submit(GenerationRequest(tuple(ids), GREEDY, images=(bad,)))
    short = PromptImage(ims[0].start, 3, ims[0].pixels, ims[0].grid, ims[0].digest)
    with pytest.raises(ValueError, match="do not fit its grid of 4 x 4"):
        eng.submit(GenerationRequest(tuple(ids), GREEDY, images=(short,)))
    text_only = Engine(model.language_model, tok, EngineConfig(num_pages=64, page_tokens=32, hash_block=8))
    with pytest.raises(ValueError, match="no vision tower"):
        text_only.submit(GenerationRequest(tuple(ids), GREEDY, images=ims))
