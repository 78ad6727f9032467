"""Log-likelihoods over packed sequences, rolling windows, perplexity / bits per byte, and ``k3 eval --text``."""

import json
import math

import pytest
import torch

from k3 import K3Config, K3ForCausalLM
from k3.pretrained import save_pretrained
from k3.cli import main
from k3.data.tokenizer import encode, eos_id, save_tokenizer, train_tokenizer
from k3.eval import rolling_windows, score_sequences, score_text

TEXT = "def f(x):\n    return x + 1\n\nprint(f(2))  # three\n" * 3


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tok = train_tokenizer([TEXT, "hello world, this is k3.\n" * 5], 300, min_frequency=1)
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("tiny").replace(vocab_size=tok.get_vocab_size())).eval()
    d = tmp_path_factory.mktemp("ckpt")
    save_pretrained(model, d)
    save_tokenizer(tok, d / "tokenizer.json")
    return model, tok, d


def _direct(model, tokens, n, greedy=False):
    """Log-probabilities of the last n tokens from one unpacked forward over the whole sequence (and whether each
    is the argmax)."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([tokens[:-1]])).logits[0].float(), -1)
    lp = [float(logp[i - 1, tokens[i]]) for i in range(len(tokens) - n, len(tokens))]
    return (lp, [int(logp[i - 1].argmax()) == tokens[i] for i in range(len(tokens) - n, len(tokens))]) if greedy else lp


@pytest.mark.slow
def test_packed_scoring_equals_one_forward_per_sequence(setup):
    model, tok, _ = setup
    g = torch.Generator().manual_seed(1)
    V = tok.get_vocab_size()
    items = [(torch.randint(0, V, (L,), generator=g).tolist(), n) for L, n in ((9, 3), (17, 16), (5, 1), (30, 7))]
    packed = score_sequences(model, items, max_tokens=64)  # several sequences per forward
    for (tokens, n), (lp, greedy) in zip(items, packed):
        ref, ref_greedy = _direct(model, tokens, n, greedy=True)
        torch.testing.assert_close(torch.tensor(lp), torch.tensor(ref), rtol=1e-5, atol=1e-5)
        assert greedy == ref_greedy
    with pytest.raises(ValueError, match="1 <= n <= len"):
        score_sequences(model, [([1, 2], 2)])


@pytest.mark.parametrize("n,L", [(1, 4), (4, 4), (5, 4), (11, 4), (9, 3)])
def test_rolling_windows_score_every_token_once(n, L):
    tokens = list(range(10, 10 + n))
    windows = rolling_windows(tokens, 0, L)
    scored = [t for seq, k in windows for t in seq[-k:]]
    assert scored == tokens and all(len(seq) - 1 <= L for seq, _ in windows)
    assert windows[0][0][0] == 0  # the first token is predicted from the separator


def test_score_text_is_the_mean_loss_and_bits_per_byte(setup):
    model, tok, _ = setup
    ids = encode(tok, TEXT)
    s = score_text(model, tok, TEXT, max_length=2048)  # one window: the whole text from the separator
    direct = _direct(model, [eos_id(tok)] + ids, len(ids))
    assert s.tokens == len(ids) and s.bytes == len(TEXT.encode())
    assert math.isclose(s.nll, -sum(direct), rel_tol=1e-5)
    assert math.isclose(s.bits_per_byte, -sum(direct) / math.log(2) / len(TEXT.encode()), rel_tol=1e-5)
    assert math.isclose(s.perplexity, math.exp(-sum(direct) / len(ids)), rel_tol=1e-5)
    short = score_text(model, tok, TEXT, max_length=8)  # rolling windows: less context, a worse score
    assert short.tokens == s.tokens and short.nll != s.nll


@pytest.mark.slow
def test_k3_eval_text(setup, tmp_path, capsys):
    model, tok, ck = setup
    (tmp_path / "t.txt").write_text(TEXT)
    assert main(["eval", "--checkpoint", str(ck), "--text", str(tmp_path / "t.txt"), "--max-length", "16",
                 "--output", str(tmp_path / "r.json"), "--device", "cpu"]) == 0
    assert "bits/byte" in capsys.readouterr().out
    got = json.loads((tmp_path / "r.json").read_text())
    assert math.isclose(got["bits_per_byte"], score_text(model, tok, TEXT, max_length=16).bits_per_byte,
                        rel_tol=1e-6)
    assert main(["eval", "--checkpoint", str(ck), "--text", str(tmp_path / "missing.txt")]) == 1


def test_k3_eval_names_a_binary_file_a_non_utf8_file_and_a_directory(setup, tmp_path, capsys):
    ck = setup[2]
    blob, latin = tmp_path / "a.bin", tmp_path / "old.txt"
    blob.write_bytes(b"\x7fELF\x02\x01\x01\x00" * 64)
    latin.write_bytes("café".encode("latin1"))
    for path, said in ((blob, f"--text {blob} is a binary file, not text (a NUL byte at offset 7); --text takes one "
                              "UTF-8 text file"),
                       (latin, f"--text {latin} is not UTF-8 text (byte 0xe9 at offset 3); convert it, e.g. iconv"),
                       (tmp_path, f"--text {tmp_path} is a directory; give one UTF-8 text file")):
        assert main(["eval", "--checkpoint", str(ck), "--text", str(path)]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"k3 eval: error: {said}") and len(err.splitlines()) == 1, err
