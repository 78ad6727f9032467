"""k3 sft with images: the prompt tokens are those k3 serve builds for the same messages; the labels are the
assistant's tokens only (never a placeholder); packed samples cut inside an image splice the same features as the
unpacked stream; a resumed dataset yields the same next batch; a tiny run trains the tower; bad data is named."""

import dataclasses
import json
import random
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from k3 import K3Config, K3ForCausalLM
from k3.data import train_tokenizer
from k3.data.tokenizer import EOS, save_tokenizer
from k3.distributed.plan import ParallelDims, ParallelPlan
from k3.post.format import ChatFormat
from k3.post.sft_data import encode_conversation, load_conversations, prepare
from k3.post.sft_images import ImagePackedDataset, ImagePrompt
from k3.chat import ChatTemplate
from k3.pretrained import load_pretrained, save_pretrained
from k3.serve.images import chat_prompt
from k3.train.loop import TrainConfig, train
from k3.train.metrics import read_metrics
from k3.vision import K3ForConditionalGeneration, VisionConfig
from k3.vision.chat import data_url
from k3.vision.prompt import MEDIA_PAD
from tests.vision.images import CORRUPT, png, png_header

TINY = VisionConfig.preset("tiny")
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 60), "blue": (40, 60, 230)}


def image(w, h, colour="red"):
    return {"type": "image_url", "image_url": {"url": data_url(png(w, h, COLOURS[colour]))}}


def record(i: int) -> dict:
    """A conversation about one or two images of a colour; every third has a second turn."""
    colour = list(COLOURS)[i % 3]
    msgs = [{"role": "user", "content": [image(28 + 14 * (i % 3), 56, colour), {"type": "text", "text": "Colour?"}]},
            {"role": "assistant", "content": colour}]
    if i % 3 == 0:
        msgs += [{"role": "user", "content": [{"type": "text", "text": "And this one?"}, image(56, 28, "blue")]},
                 {"role": "assistant", "content": "blue"}]
    return {"messages": msgs}


@pytest.fixture(scope="module")
def tok():
    texts = [ChatTemplate().render([{"role": "user", "content": "Colour? And this one?"},
                                    {"role": "assistant", "content": c}]) for c in COLOURS] * 30
    return train_tokenizer(texts, 300, special_tokens=(EOS, MEDIA_PAD))


@pytest.fixture(scope="module")
def model(tok):
    torch.manual_seed(0)
    cfg = K3Config.preset("tiny").replace(vocab_size=tok.get_vocab_size(), num_nextn_predict_layers=0)
    return K3ForConditionalGeneration(cfg, TINY, media_placeholder_token_id=tok.token_to_id(MEDIA_PAD)).eval()


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "images.jsonl"
    path.write_text("".join(json.dumps(record(i)) + "\n" for i in range(24)))
    return path


def test_a_conversations_images_are_decoded_once_whatever_its_turns(tok, model, monkeypatch):
    """Every assistant turn renders the prompt before it, images included: they come from the read, not a decode."""
    import k3.post.sft_images as si
    import k3.vision.chat as vc

    calls = []

    def counting(load):
        def f(*a, **k):
            calls.append(k.get("name"))
            return load(*a, **k)
        return f

    monkeypatch.setattr(si, "load_image", counting(si.load_image))
    monkeypatch.setattr(vc, "load_image", counting(vc.load_image))
    msgs = [{"role": "user", "content": [image(30, 60), {"type": "text", "text": "Colour?"}]},
            {"role": "assistant", "content": "red"},
            {"role": "user", "content": [image(40, 30, "blue"), {"type": "text", "text": "And this?"}]},
            {"role": "assistant", "content": "blue"},
            {"role": "user", "content": "Sure?"},
            {"role": "assistant", "content": "yes"}]
    [doc] = encode_conversation(ChatFormat(tok), msgs, "high", ImagePrompt(TINY, model.media_placeholder_token_id))
    assert len(doc.images) == 2 and len(calls) == 2


def test_prompts_are_what_serve_builds_and_labels_only_the_assistant(tok, model, tmp_path):
    (tmp_path / "cat.png").write_bytes(png(40, 30, (0, 255, 0)))
    (tmp_path / "chat.jsonl").write_text(json.dumps({"effort": "high", "messages": [
        {"role": "user", "content": [image(30, 60), {"type": "text", "text": "Colour?"}]},
        {"role": "assistant", "content": "red"},
        {"role": "user", "content": [{"type": "text", "text": "And "}, {"type": "image", "path": "cat.png"}]},
        {"role": "assistant", "content": "green", "reasoning_content": "it is green"}]}) + "\n" +
        json.dumps(record(1)) + "\n")
    conv = load_conversations(tmp_path / "chat.jsonl")[0]
    fmt, pad = ChatFormat(tok), model.media_placeholder_token_id
    [doc] = encode_conversation(fmt, conv.messages, conv.effort, ImagePrompt(TINY, pad), conv.where)
    engine = SimpleNamespace(tokenizer=tok, model=model)
    msgs, prompt_len = conv.messages, {}
    for turn in (1, 3):  # each assistant turn's prompt: the ids, images and runs serve builds for that request
        served, reasoning_effort = fmt.messages(msgs[:turn], "high")
        ids, _, images = chat_prompt(engine, fmt.template, served, reasoning_effort=reasoning_effort)
        assert doc.ids[:len(ids)] == ids
        prompt_len[turn] = len(ids)
        assert [im.start for im in images] == list(doc.starts[:len(images)])
        for im, ref in zip(images, doc.images):
            assert torch.equal(ref.pixels(TINY), im.pixels) and ref.digest == im.digest
    assert len(doc.images) == 2
    assert doc.images[1].name.endswith(f"chat.jsonl:1: messages[2].content[1] ({tmp_path / 'cat.png'})")
    # labels: exactly the assistant's completions; -100 on every prompt token, the placeholders included
    p1 = prompt_len[1]
    c1, c2 = fmt.completion_ids(msgs[1], "high"), fmt.completion_ids(msgs[3], "high")
    assert doc.labels[p1:p1 + len(c1)] == c1 and doc.labels[-len(c2):] == c2
    assert [t for t in doc.labels if t != -100] == c1 + c2
    assert all(lab == -100 for t, lab in zip(doc.ids, doc.labels) if t == pad)
    assert sum(t == pad for t in doc.ids) == sum(r.grid[0] * r.grid[1] // 4 for r in doc.images)


def test_packed_samples_splice_the_features_of_the_unpacked_stream(tok, model, jsonl):
    """Samples of 16 tokens cut documents and image runs; each batch's embeddings (its images through the tower
    with per-image attention, the tokens it holds spliced in) equal those of the whole stream at once."""
    fmt, pad = ChatFormat(tok), model.media_placeholder_token_id
    docs = [d for c in load_conversations(jsonl) for d in
            encode_conversation(fmt, c.messages, c.effort, ImagePrompt(TINY, pad), c.where)]
    ds = ImagePackedDataset(docs, 16, tok.token_to_id(EOS), TINY, shuffle_seed=3)
    with torch.no_grad():
        refs = ds.images
        pixels = torch.cat([r.pixels(TINY) for r in refs])
        whole = model.embed(ds.tokens.long()[None], pixels, [r.grid for r in refs])[0]
        cut = 0
        for _ in range(6):
            idx = ds.order(ds.epoch)[ds.position: ds.position + 3].tolist()
            b = ds.collate(idx)
            got = model.embed(b["input_ids"], **b["media"])[0]
            windows = [int(ds._window[i]) for i in idx]
            want = torch.cat([whole[w * 16:(w + 1) * 16] for w in windows])
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            m = b["media"]
            cut += len(m["image_tokens"]) < sum(g[0] * g[1] // 4 for g in m["grids"])
            ds.position += 3
    assert cut, "no batch held part of an image: the test would not check the cut runs"


def test_a_restored_dataset_yields_the_same_next_batch(tok, jsonl):
    fmt, pad = ChatFormat(tok), tok.token_to_id(MEDIA_PAD)
    docs = [d for c in load_conversations(jsonl) for d in
            encode_conversation(fmt, c.messages, c.effort, ImagePrompt(TINY, pad), c.where)]
    a = ImagePackedDataset(docs, 16, 0, TINY, shuffle_seed=1)
    it = a.batches(4)
    for _ in range(5):
        next(it)
    state = a.state_dict()
    want = next(it)
    b = ImagePackedDataset(docs, 16, 0, TINY, shuffle_seed=1)
    b.load_state_dict(state)
    got = next(b.batches(4))
    for key in ("input_ids", "labels", "cu_seqlens"):
        assert torch.equal(got[key], want[key])
    assert got["media"]["grids"] == want["media"]["grids"] and want["media"]["grids"]
    assert torch.equal(got["media"]["pixels"], want["media"]["pixels"])
    assert torch.equal(got["media"]["image_tokens"], want["media"]["image_tokens"])


SFT = TrainConfig(out="", preset="tiny", chat=True, vocab_size=300, steps=8, batch_size=2, seq_len=64, lr=3e-3,
                  eval_every=4, eval_batches=2, log_every=1, save_every=100, val_fraction=0.1, vision="tiny")


def sft(tmp_path, data, name, **kw):
    cfg = dataclasses.replace(SFT, out=str(tmp_path / name), data=str(data), **kw)
    return cfg, train(cfg, ParallelPlan(ParallelDims(), cfg.device), log=lambda *a: None, prepare=prepare)


@pytest.mark.slow
def test_a_tiny_run_trains_the_tower_saves_the_multimodal_layout_and_resumes(tmp_path, jsonl):
    cfg, _ = sft(tmp_path, jsonl, "straight", steps=12)
    recs = read_metrics(cfg.out)
    assert sum(r["loss"] for r in recs[-3:]) / 3 < 0.7 * recs[0]["loss"], [r["loss"] for r in recs]
    ckpt = tmp_path / "straight" / "checkpoint"
    trained = load_pretrained(ckpt, dtype=torch.float32, vision=True)
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert {n.split(".")[0] for n in names} == {"language_model", "vision_tower", "mm_projector"}
    torch.manual_seed(cfg.seed)  # the run's initialisation: the same seed, the same model built
    init = K3ForConditionalGeneration(trained.config.replace(top_level=None), TINY,
                                      trained.media_placeholder_token_id)
    moved = {n: not torch.equal(p, dict(init.named_parameters())[n])
             for n, p in trained.named_parameters() if n.startswith(("vision_tower.", "mm_projector."))}
    assert all(moved.values()), [n for n, m in moved.items() if not m]
    # stopped after step 4 and resumed: the same losses as the uninterrupted run
    a, _ = sft(tmp_path, jsonl, "a")
    sft(tmp_path, jsonl, "b", stop_after=4)
    b, _ = sft(tmp_path, jsonl, "b")
    key = lambda out: [(r["step"], r["loss"], r.get("val_loss")) for r in read_metrics(out)]  # noqa: E731
    assert key(a.out) == key(b.out) and len(key(a.out)) == 8


def write_bad(tmp_path, part, role="user") -> str:
    """A good line, then a line with ``part`` in a ``role`` message."""
    msgs = {"user": [{"role": "user", "content": [{"type": "text", "text": "look"}, part]}],
            "system": [{"role": "system", "content": [part]}, {"role": "user", "content": "hi"}],
            "assistant": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [part]},
                          {"role": "user", "content": "and?"}]}[role]
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(record(0)) + "\n" + json.dumps({"messages": [*msgs, {"role": "assistant",
                                                                                   "content": "red"}]}) + "\n")
    return str(path)


@pytest.mark.parametrize("part, role, match", [
    (image(30, 30), "assistant", r"bad.jsonl:2: messages\[1\].content\[0\] is an image in an assistant message"),
    ({"type": "audio"}, "user", r"bad.jsonl:2: messages\[0\].content\[1\] must be \{\"type\": \"text\""),
    ({"type": "image_url", "image_url": {"url": data_url(CORRUPT)}}, "user",
     r"bad.jsonl:2: messages\[0\].content\[1\] is not an image k3 can read"),
    ({"type": "image_url", "image_url": {"url": data_url(png_header(0, 4))}}, "user",
     r"bad.jsonl:2: messages\[0\].content\[1\] has zero size"),
    ({"type": "image_url", "image_url": {"url": data_url(png_header(10_000, 10_000))}}, "user",
     r"bad.jsonl:2: messages\[0\].content\[1\] is 10000 x 10000 = 100.0 megapixels"),
    ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, "user",
     r"bad.jsonl:2: messages\[0\].content\[1\].image_url.url: k3 does not fetch URLs"),
    ({"type": "image", "path": "missing.png"}, "user",
     r"bad.jsonl:2: messages\[0\].content\[1\] \(.*missing.png\): cannot read"),
])
def test_bad_image_data_names_the_line_and_the_part(tmp_path, part, role, match):
    cfg = dataclasses.replace(SFT, out=str(tmp_path / "run"), data=write_bad(tmp_path, part, role))
    (tmp_path / "run").mkdir()
    with pytest.raises(ValueError, match=match):
        prepare(cfg, tmp_path / "run", None, ParallelPlan(ParallelDims(), "cpu"))


def test_a_system_image_is_part_of_the_prompt(tmp_path):
    cfg = dataclasses.replace(SFT, out=str(tmp_path / "run"), data=write_bad(tmp_path, image(28, 28), "system"))
    (tmp_path / "run").mkdir()
    data = prepare(cfg, tmp_path / "run", None, ParallelPlan(ParallelDims(), "cpu"))
    assert len(data.train.images) + len(data.val.images) == 3  # record(0)'s two and the system message's


def test_which_model_image_data_trains(tmp_path, jsonl, tok):
    """A text checkpoint gets a new tower only when --vision asks for one; a multimodal one brings its own."""
    plan = ParallelPlan(ParallelDims(), "cpu")
    text = tmp_path / "text"
    save_pretrained(K3ForCausalLM(K3Config.preset("tiny").replace(vocab_size=tok.get_vocab_size())), text)
    save_tokenizer(tok, text / "tokenizer.json")
    (tmp_path / "r").mkdir()
    no_tower = dataclasses.replace(SFT, out=str(tmp_path / "r"), data=str(jsonl), init_from=str(text), vision=None)
    with pytest.raises(ValueError, match=r"images.jsonl:1: the data has images but the model has no vision tower "
                                         r"\(--init-from .* is a text model\); add --vision tiny"):
        prepare(no_tower, tmp_path / "r", None, plan)
    cfg, _ = sft(tmp_path, jsonl, "grown", init_from=str(text), steps=2)
    mm = tmp_path / "grown" / "checkpoint"
    assert load_pretrained(mm, vision=True).vision_config == TINY
    with pytest.raises(ValueError, match="already has a vision tower.*drop --vision"):
        prepare(dataclasses.replace(cfg, init_from=str(mm)), tmp_path / "r", None, plan)
    sft(tmp_path, jsonl, "again", init_from=str(mm), vision=None, steps=2)  # fine-tunes the tower it has
    ckpt = tmp_path / "again" / "checkpoint"
    assert load_pretrained(ckpt, vision=True).media_placeholder_token_id == tok.token_to_id(MEDIA_PAD)
    plain = train_tokenizer(["Colour? red green blue"] * 20, 300)  # k3 train's: no image placeholder token
    save_tokenizer(plain, text / "tokenizer.json")
    with pytest.raises(ValueError, match=r"--vision tiny: the tokenizer of --init-from .* has no <\|media_pad\|>"):
        prepare(dataclasses.replace(cfg, out=str(tmp_path / "r")), tmp_path / "r", None, plan)


@pytest.mark.slow
def test_sft_on_images_teaches_the_model_to_read_them(tmp_path):
    """40 steps on "Colour?" about solid red, green or blue pictures: on held-out conversations the answer loss with
    each one's own image is far below that with another's (the model answers from the image, not from the prior)."""
    from k3.cli.demo_vision import answer_stats
    from k3.cli.demo_vision_sft import held_out

    rng = random.Random(0)

    def lines(n):
        out = []
        for _ in range(n):
            c = rng.choice(list(COLOURS))
            question = [image(56, 28, c), {"type": "text", "text": "Colour?"}]
            out.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": c}]})
        return "".join(json.dumps(x) + "\n" for x in out)

    (tmp_path / "train.jsonl").write_text(lines(96))
    (tmp_path / "val.jsonl").write_text(lines(24))
    sft(tmp_path, tmp_path / "train.jsonl", "run", steps=40, batch_size=4, lr=6e-3, eval_every=40)
    model, ex = held_out(tmp_path / "run" / "checkpoint", tmp_path / "val.jsonl")
    own, right = answer_stats(model, ex)
    other, _ = answer_stats(model, ex, shuffle=1)
    assert own < 0.3 * other and right.float().mean() > 0.9, (own, other)
