import math
import os
import random
import stat

import pytest
import torch

from k3.data import (EOS, decode, encode, encode_documents, eos_id, load_tokenizer, save_tokenizer,
                     stdlib_documents, train_tokenizer, unigram_entropy)

TEXTS = [
    "",
    "def f(x):\n\treturn x ** 2  # square\r\n",
    "héllo wörld — naïve café, Ελληνικά, русский,\n日本語のテキスト, 한국어, עברית, العربية",
    "emoji 🙂👩‍👩‍👧 flags 🇫🇷 and combining e\u0301 zero-width\u200b nul\x00 bell\x07",
    "   leading and trailing spaces   \n\n\n",
    f"a literal {EOS} inside text stays text",
    "class Foo(Bar, metaclass=Meta):\n    '''Doc.'''\n    x: dict[str, list[int]] = {}\n",
]


@pytest.fixture(scope="module")
def docs():
    return stdlib_documents(max_bytes=300_000)


@pytest.fixture(scope="module")
def tok(docs):
    return train_tokenizer(docs, vocab_size=1000)


def test_vocab_and_eos(tok):
    assert tok.get_vocab_size() == 1000
    assert eos_id(tok) == 0 and tok.id_to_token(0) == EOS


def random_text(rng: random.Random, n: int) -> str:
    planes = [(0x20, 0x7F), (0x00, 0x20), (0xA0, 0x2FF), (0x400, 0x4FF), (0x4E00, 0x9FFF), (0x1F300, 0x1FAFF)]
    out = []
    for _ in range(n):
        lo, hi = rng.choice(planes)
        out.append(chr(rng.randrange(lo, hi)))
    return "".join(out)


def test_round_trip(tok):
    rng = random.Random(0)
    for text in TEXTS + [random_text(rng, rng.randrange(1, 200)) for _ in range(50)]:
        ids = encode(tok, text)
        assert decode(tok, ids) == text
        assert eos_id(tok) not in ids  # a literal "<|endoftext|>" must not forge a separator
    assert decode(tok, torch.tensor(encode(tok, TEXTS[1]))) == TEXTS[1]
    assert encode_documents(tok, TEXTS) == [encode(tok, t) for t in TEXTS]


def test_compresses_code(tok, docs):
    text = docs[0].text
    assert len(encode(tok, text)) < len(text.encode("utf-8")) / 2


def test_deterministic(tok, docs):
    again = train_tokenizer([d.text for d in docs], vocab_size=1000)
    assert again.to_str() == tok.to_str()


def test_save_load(tok, tmp_path):
    written = save_tokenizer(tok, tmp_path / "tok")
    assert written == tmp_path / "tok" / "tokenizer.json"
    assert [p.name for p in (tmp_path / "tok").iterdir()] == ["tokenizer.json"]  # no temp file left behind
    for loaded in (load_tokenizer(tmp_path / "tok"), load_tokenizer(written)):
        assert eos_id(loaded) == 0
        for text in TEXTS:
            assert encode(loaded, text) == encode(tok, text)
            assert decode(loaded, encode(loaded, text)) == text
    save_tokenizer(tok, tmp_path / "tok")  # overwrites in place
    with pytest.raises(FileNotFoundError, match="nothing"):
        load_tokenizer(tmp_path / "nothing")


def test_vocab_too_small(docs):
    with pytest.raises(ValueError, match="257"):
        train_tokenizer(docs[:2], vocab_size=256)
    tiny = train_tokenizer(docs[:2], vocab_size=257)
    assert tiny.get_vocab_size() == 257 and decode(tiny, encode(tiny, TEXTS[2])) == TEXTS[2]


def test_unigram_entropy():
    uniform = list(range(8)) * 100
    assert unigram_entropy(uniform) == pytest.approx(math.log(8))
    assert unigram_entropy(torch.tensor(uniform)) == pytest.approx(math.log(8))
    assert unigram_entropy([5, 5, 5]) == 0.0
    assert unigram_entropy([0, 0, 0, 1]) == pytest.approx(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25)))
    with pytest.raises(ValueError, match="empty"):
        unigram_entropy([])


def test_unreadable_tokenizer_file_is_named(tmp_path):
    for content in ("", "{not json", '{"version": "1.0"}'):
        f = tmp_path / "tokenizer.json"
        f.write_text(content)
        with pytest.raises(ValueError, match="tokenizer.json is not a valid tokenizer.json"):
            load_tokenizer(f)


def test_saved_with_the_ordinary_file_mode(tok, tmp_path):
    old = os.umask(0o022)
    try:
        path = save_tokenizer(tok, tmp_path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # not mkstemp's 0600
