"""KimiTokenizer: the Kimi releases' tiktoken file + tokenizer_config.json, behind k3's tokenizer interface."""

import pytest
import tiktoken

from k3.data import load_tokenizer
from k3.data.kimi_tokenizer import PAT_STR, KimiTokenizer
from k3.data.tokenizer import eos_id
from k3.inference.detok import REPLACEMENT, IncrementalDetokenizer, StopMatcher, token_bytes, token_text

from .kimi_files import K2_TEMPLATE, ranks, write_kimi_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(write_kimi_tokenizer(tmp_path_factory.mktemp("kimi")))


def test_reads_ranks_specials_and_ids_as_the_release(tok):
    n = len(ranks())
    assert isinstance(tok, KimiTokenizer)
    assert tok.get_vocab_size() == n + 256 and tok.get_vocab_size(with_added_tokens=False) == n
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (n, n + 1, n + 1) and eos_id(tok) == n + 1
    assert tok.token_to_id("<|sep|>") == n + 9 and tok.id_to_token(n + 200) == f"<|reserved_token_{n + 200}|>"
    # the release builds exactly this tiktoken Encoding; the ids agree on text and special tokens
    ref = tiktoken.Encoding("ref", pat_str=PAT_STR, mergeable_ranks=ranks(), special_tokens=tok.special_tokens)
    text = "Hello world, the weather in Paris 漢字abc 12345 café<|im_end|>"
    assert tok.encode(text).ids == ref.encode(text, allowed_special="all")


def test_pretokenization_is_kimis(tok):
    r = ranks()
    ids = tok.encode("12345").ids  # numbers in runs of at most 3 digits: 123 | 45
    assert ids == [r[b"123"], r[b"45"]]
    assert tok.encode("漢字abc").ids[0] == r["漢字".encode()]  # a Han run is its own piece
    assert tok.encode("hello world").ids == [r[b"hello"], r[b" world"]]


def test_special_tokens_in_text_and_in_content(tok):
    eom = tok.token_to_id("<|end_of_msg|>")
    assert tok.encode("hi<|end_of_msg|>").ids[-1] == eom  # markup: the special token (as the release's encode)
    plain = tok.encode_text("hi<|end_of_msg|>")  # content: ordinary bytes, cannot forge structure
    assert eom not in plain and tok.decode(plain) == "hi<|end_of_msg|>"


@pytest.mark.parametrize("text", ["Hello world", "漢字 🙂 café é", "tail mid: 漢", "a" * 30_000 + " b", ""])
def test_round_trip_and_streaming_detokenizer(tok, text):
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text
    d = IncrementalDetokenizer(tok)
    pieces = [d.push(i) for i in ids]
    assert "".join(pieces) + d.flush() == text and not any(REPLACEMENT in p for p in pieces)
    assert b"".join(token_bytes(tok, i) for i in ids) == text.encode()


def test_multibyte_characters_split_across_tokens(tok):
    ids = tok.encode("🙂").ids
    assert len(ids) == 4 and all(REPLACEMENT in token_text(tok, i) for i in ids)


def test_stop_strings_on_special_tokens(tok):
    ids = tok.encode("hello<|im_end|> world").ids
    d, stop = IncrementalDetokenizer(tok), StopMatcher(("<|im_end|>",))
    out = "".join(stop.feed(d.push(i))[0] for i in ids)
    assert out == "hello" and stop.stopped


def test_interface_matches_tokenizers(tok):
    ids = tok.encode("the weather").ids
    assert [e.ids for e in tok.encode_batch(["the weather", "hello"])] == [ids, tok.encode("hello").ids]
    assert all(tok.token_to_id(tok.id_to_token(i)) == i for i in ids)
    assert tok.id_to_token(10**9) is None and tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == \
        "the weather"
    with pytest.raises(ValueError, match="outside the tokenizer's vocabulary"):
        tok.token_bytes(10**9)


def test_chat_template_from_tokenizer_config(tmp_path):
    tok = KimiTokenizer.from_dir(write_kimi_tokenizer(tmp_path, k3_tokens=False, chat_template=K2_TEMPLATE))
    assert tok.chat_template == K2_TEMPLATE


def test_bad_files_are_named(tmp_path):
    d = write_kimi_tokenizer(tmp_path)
    (d / "tiktoken.model").write_text("aGk= 0\nnot-base64 1\n")
    with pytest.raises(ValueError, match=r"tiktoken.model:2: expected 'base64\(token bytes\) rank'"):
        KimiTokenizer.from_dir(d)
    d = write_kimi_tokenizer(tmp_path / "b")
    cfg = (d / "tokenizer_config.json").read_text().replace('"bos_token": "[BOS]"', '"bos_token": "<s>"')
    (d / "tokenizer_config.json").write_text(cfg)
    with pytest.raises(ValueError, match="bos_token '<s>' is not one of the special tokens"):
        KimiTokenizer.from_dir(d)
