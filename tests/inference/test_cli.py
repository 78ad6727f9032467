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
                              top_p=1.0, seed=0, device="cpu")
    out = io.StringIO()
    assert chat.run(args, stdin=io.StringIO("hi\nhow are you\n\n"), stdout=out) == 0
    assert out.getvalue().count("> ") == 3  # two turns answered, then the empty line quits


def make_kimi_checkpoint(tmp_path):
    """A checkpoint directory as the Kimi releases ship it: tiktoken.model + tokenizer_config.json, no tokenizer.json."""
    from k3.data.kimi_tokenizer import KimiTokenizer
    from tests.data.kimi_files import write_kimi_tokenizer

    tok = KimiTokenizer.from_dir(write_kimi_tokenizer(tmp_path))
    torch.manual_seed(0)
    save_pretrained(K3ForCausalLM(K3Config.preset("tiny").replace(vocab_size=tok.get_vocab_size())), tmp_path)
    return tmp_path, tok


def test_generate_with_the_kimi_tokenizer(tmp_path, capsys):
    ck, tok = make_kimi_checkpoint(tmp_path)
    assert main(["generate", "--checkpoint", str(ck), "--prompt", "hello world", "--max-tokens", "4",
                 "--temperature", "0"]) == 0
    model = K3ForCausalLM.from_pretrained(ck).eval()
    ids = tok.encode("hello world").ids
    for _ in range(4):  # greedy by full recompute
        with torch.no_grad():
            nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        if nxt == tok.eos_token_id:
            break
        ids.append(nxt)
    assert capsys.readouterr().out == tok.decode(ids) + "\n"


def test_chat_and_serve_use_the_checkpoints_chat_format(tmp_path):
    from starlette.testclient import TestClient

    from k3.cli.chat import reply
    from k3.cli.generate import load_for_inference, make_engine
    from k3.inference.api import SamplingParams
    from k3.serve import create_app
    from k3.serve.xtml import KimiK3Chat

    ck, _ = make_kimi_checkpoint(tmp_path)
    model, tok = load_for_inference(ck, "cpu")
    engine = make_engine(model, tok)
    seen = []
    submit = engine.submit
    engine.submit = lambda req: seen.append(req) or submit(req)
    engine.start()
    try:
        msgs = [{"role": "user", "content": "hello"}]
        reply(engine, KimiK3Chat(), msgs, SamplingParams(max_tokens=3, temperature=0.0), io.StringIO())
        assert tok.decode(list(seen[-1].prompt_ids)) == (
            '<|open|>message role="user"<|sep|>hello<|close|>message<|sep|><|end_of_msg|>'
            '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>')
        r = TestClient(create_app(engine)).post("/v1/chat/completions", json={
            "model": "k3", "messages": msgs, "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and list(seen[-1].prompt_ids) == KimiK3Chat().prompt(tok, msgs).ids
    finally:
        engine.stop()
    args = argparse.Namespace(checkpoint=str(ck), system=None, max_tokens=3, temperature=0.0, top_k=0, top_p=1.0,
                              seed=0, device="cpu")
    out = io.StringIO()
    assert chat.run(args, stdin=io.StringIO("hello\n\n"), stdout=out) == 0 and out.getvalue().count("> ") == 2
