"""IncrementalDetokenizer (UTF-8 split across byte-level tokens), StopMatcher (stops split across deltas)."""

import random

import pytest

from k3.data.tokenizer import EOS, decode, encode, train_tokenizer
from k3.inference.detok import REPLACEMENT, IncrementalDetokenizer, StopMatcher, token_bytes, token_text

CORPUS = ["café crème brûlée, naïve résumé é è ê", "漢字 かな カナ 한국어 Ελληνικά русский",
          "emoji 🙂 🚀 👩‍👩‍👧 🇫🇷", "plain ascii text with spaces and words and more words"] * 3
SAMPLES = ["café 漢字 🙂 done", "é", "🙂🚀👩‍👩‍👧🇫🇷", "tail ends mid: 漢", "ascii only",
           "漢字漢字é🙂 " * 4, "unseen: ☃ ∮ 𝄞 Ωμέγα"]


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(CORPUS, vocab_size=300, min_frequency=1)


def _stream(tok, ids):
    d = IncrementalDetokenizer(tok)
    pieces = [d.push(i) for i in ids]
    return d, pieces, d.flush()


@pytest.mark.parametrize("text", SAMPLES)
def test_joined_pieces_equal_decode_and_never_fffd(tok, text):
    ids = encode(tok, text)
    d, pieces, tail = _stream(tok, ids)
    assert "".join(pieces) + tail == decode(tok, ids) == text
    assert tail == ""
    assert not any(REPLACEMENT in p for p in pieces)
    assert d.text == text


def test_multibyte_characters_really_split(tok):
    # the test is only meaningful if some token holds part of a character: check the tokenizer does that
    ids = encode(tok, "unseen: ☃ ∮ 𝄞")
    assert any(REPLACEMENT in token_text(tok, i) for i in ids)
    d = IncrementalDetokenizer(tok)
    assert "" in [d.push(i) for i in ids]


def test_random_byte_sequences_round_trip(tok):
    rng = random.Random(0)
    alphabet = "aé漢🙂 ☃x"
    for _ in range(50):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 20)))
        ids = encode(tok, text)
        _, pieces, tail = _stream(tok, ids)
        assert "".join(pieces) + tail == text


def test_incomplete_tail_held_then_flushed(tok):
    ids = encode(tok, "ok ☃")  # the snowman is not in the corpus: it is split into byte tokens
    # drop the snowman's last token: its bytes stay incomplete forever
    d, pieces, tail = _stream(tok, ids[:-1])
    assert "".join(pieces) == "ok "
    assert tail.endswith(REPLACEMENT)


def test_special_tokens_kept(tok):
    eos = tok.token_to_id(EOS)
    _, pieces, tail = _stream(tok, encode(tok, "a é") + [eos])
    assert "".join(pieces) + tail == "a é" + EOS


def test_token_bytes(tok):
    for text in SAMPLES:
        ids = encode(tok, text)
        assert b"".join(token_bytes(tok, i) for i in ids) == text.encode()
    assert token_bytes(tok, tok.token_to_id(EOS)) == EOS.encode()
    with pytest.raises(ValueError, match="outside the tokenizer's vocabulary"):
        token_bytes(tok, 10**6)


def _run(stops, deltas):
    m = StopMatcher(stops)
    out, stopped = [], False
    for d in deltas:
        text, stopped = m.feed(d)
        out.append(text)
        if stopped:
            break
    return "".join(out) + ("" if stopped else m.flush()), stopped, out


@pytest.mark.parametrize("stops,deltas,want,stopped", [
    (["STOP"], ["hello ", "ST", "O", "P and more"], "hello ", True),
    (["STOP"], ["hello S", "T", "OP"], "hello ", True),
    (["STOP"], ["hello ST", "OX done"], "hello STOX done", False),
    (["STOP"], ["S", "S", "T", "S", "TOP"], "SST", True),
    (["<|im_end|>"], ["answer<|im", "_end|>junk"], "answer", True),
    (["b", "ab"], ["xa", "b"], "x", True),  # the earliest start wins, whatever the list order
    (["abc", "bcd"], ["xab", "cd"], "x", True),
    (["end"], ["no stop here, but the text closes with en"], "no stop here, but the text closes with en", False),
    ([], ["anything"], "anything", False),
    (["é漢"], ["caf", "é", "漢", "!"], "caf", True),
])
def test_stop_matcher(stops, deltas, want, stopped):
    text, got_stopped, _ = _run(stops, deltas)
    assert (text, got_stopped) == (want, stopped)


def test_stop_matcher_holds_back_only_possible_prefixes():
    m = StopMatcher(["STOP", "xyz"])
    assert m.feed("abc S") == ("abc ", False)
    assert m.feed("x") == ("S", False)  # "Sx" cannot start a stop; "x" can
    assert m.feed("y") == ("", False)
    assert m.feed("!") == ("xy!", False)
    assert m.feed("STOP") == ("", True)
    assert m.feed("more") == ("", True) and m.flush() == ""


def test_stop_matcher_every_split():
    text, stop = "alpha beta STOP gamma", "STOP"
    for cut1 in range(len(text)):
        for cut2 in range(cut1, len(text)):
            got, stopped, _ = _run([stop], [text[:cut1], text[cut1:cut2], text[cut2:]])
            assert (got, stopped) == ("alpha beta ", True)


def test_stop_matcher_rejects_empty():
    with pytest.raises(ValueError, match="non-empty"):
        StopMatcher(["", "x"])
