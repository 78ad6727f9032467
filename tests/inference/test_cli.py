import argparse
import io

import torch

from k3 import K3Config, K3ForCausalLM
from k3.checkpoint import save_pretrained
from k3.cli import chat, main
from k3.data.tokenizer import save_tokenizer, train_tokenizer


def make_checkpoint(tmp_path):
    tok = train_tokenizer(["hello world, this is k3.\n" * 5, "def f():\n    return 1\n" * 5], 300)
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("tiny").replace(vocab_size=tok.get_vocab_size()))
    save_pretrained(model, tmp_path)
    save_tokenizer(tok, tmp_path / "tokenizer.json")
    return tmp_path


def test_generate_streams_the_greedy_continuation(tmp_path, capsys):
    ck = make_checkpoint(tmp_path)
    assert main(["generate", "--checkpoint", str(ck), "--prompt", "hello", "--max-tokens", "5", "--temperature", "0"]) == 0
    first = capsys.readouterr().out
    assert main(["generate", "--checkpoint", str(ck), "--prompt", "hello", "--max-tokens", "5", "--temperature", "0"]) == 0
    assert capsys.readouterr().out == first and first.startswith("hello")


def test_chat_two_turns(tmp_path):
    ck = make_checkpoint(tmp_path)
    args = argparse.Namespace(checkpoint=str(ck), system="be brief", max_tokens=4, temperature=0.0, top_k=0,
                              top_p=1.0, seed=0, device="cpu", verify=True)
    out = io.StringIO()
    assert chat.run(args, stdin=io.StringIO("hi\nhow are you\n\n"), stdout=out) == 0
    assert out.getvalue().count("> ") == 3  # two turns answered, then the empty line quits
