import argparse
import io
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from k3 import K3Config, K3ForCausalLM
from k3.cli import chat, main
from k3.data.tokenizer import save_tokenizer, train_tokenizer
from k3.pretrained import load_pretrained, save_pretrained


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


class CtrlCAt(io.StringIO):
    """A terminal where Ctrl-C is pressed just before the ``n``-th write (once)."""

    def __init__(self, n: int):
        super().__init__()
        self.writes, self.n = 0, n

    def write(self, s):
        self.writes += 1
        if self.writes == self.n:
            raise KeyboardInterrupt
        return super().write(s)


def test_ctrl_c_during_a_reply_stops_that_reply_only(monkeypatch):
    """The request is cancelled through its handle, what was printed stays in the conversation, the chat goes on."""
    from tests.serve.fake_engine import FakeEngine

    engine = FakeEngine(step_delay=0.01)
    monkeypatch.setattr(chat, "load_for_inference", lambda *a, **k: (None, engine.tokenizer))
    monkeypatch.setattr(chat, "make_engine", lambda *a, **k: engine)
    args = argparse.Namespace(checkpoint="x", system=None, max_tokens=50, temperature=0.0, top_k=0, top_p=1.0, seed=0,
                              device="cpu", verify=True)
    out = CtrlCAt(6)  # banner, "> ", then tokens: Ctrl-C after the first three tokens of the reply
    assert chat.run(args, stdin=io.StringIO("hi\nmore\n\n"), stdout=out) == 0
    first, second = engine.submitted
    assert engine.cancelled == [first.request_id] and len(engine.cancelled) == 1
    shown = out.getvalue().split("> ")[1]
    partial = shown[: shown.index(" [stopped]")]
    assert partial and engine.expected_text().startswith(partial) and partial != engine.expected_text()
    context = engine.tokenizer.decode(list(second.prompt_ids))
    assert f"hi<|im_end|>\n<|im_start|>assistant\n{partial}<|im_end|>" in context and "more" in context
    assert out.getvalue().count("> ") == 3  # the second reply was answered, then the empty line quit


def test_ctrl_c_at_the_prompt_interrupts_and_ctrl_d_quits():
    import pytest

    class CtrlCStdin(io.StringIO):
        def readline(self, *a):
            raise KeyboardInterrupt

    out = io.StringIO()
    from k3.cli.chat import _read_line

    with pytest.raises(KeyboardInterrupt):  # k3's main turns it into "k3 chat: interrupted" and status 130
        _read_line(CtrlCStdin(), out)
    assert out.getvalue() == "> \n"
    assert _read_line(io.StringIO(""), out) is None  # Ctrl-D


def test_a_line_that_is_not_utf8_is_refused_and_the_chat_goes_on(tmp_path):
    ck = make_checkpoint(tmp_path)
    args = argparse.Namespace(checkpoint=str(ck), system=None, max_tokens=3, temperature=0.0, top_k=0,
                              top_p=1.0, seed=0, device="cpu", verify=True)
    out = io.StringIO()
    stdin = io.TextIOWrapper(io.BytesIO(b"hi\n\xff\xfe bad\nmore\n\n"), encoding="utf-8")
    assert chat.run(args, stdin=stdin, stdout=out) == 0
    text = out.getvalue()
    assert "(not sent: that line is not UTF-8 text (byte 0xff at byte 1)" in text
    assert text.count("> ") == 4  # hi answered, the bad line asked again, more answered, the empty line quit


def test_a_prompt_that_is_not_utf8_is_refused_naming_the_byte(tmp_path):
    ck = make_checkpoint(tmp_path)
    r = subprocess.run([sys.executable, "-m", "k3", "generate", "--checkpoint", str(ck), "--prompt",
                        os.fsdecode(b"\xffabc")], capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.startswith("k3 generate: error: --prompt is not UTF-8 text (byte 0xff at "
                                                     "character 1"), r.stderr


def test_ctrl_c_while_k3_starts_is_one_line_and_130():
    """SIGINT while the modules import (as `timeout -s INT` sends it): no traceback, status 130."""
    p = subprocess.Popen([sys.executable, "-m", "k3", "params", "--preset", "tiny"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while "libtorch" not in open(f"/proc/{p.pid}/maps").read() and time.time() < deadline:
        time.sleep(0.01)  # until torch is loading: inside `python -m k3`'s imports, before any command runs
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130 and "Traceback" not in err and "Exception ignored" not in err, err


class Terminal:
    """A `python -m k3 ...` process driven like a terminal: type lines, press Ctrl-C, watch what it prints."""

    def __init__(self, argv):
        self.p = subprocess.Popen([sys.executable, "-m", "k3", *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, bufsize=0)
        self.out = b""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        while chunk := os.read(self.p.stdout.fileno(), 4096):
            self.out += chunk

    def wait_for(self, test, timeout=240):
        deadline = time.time() + timeout
        while not test(self.out.decode(errors="replace")):
            if self.p.poll() is not None or time.time() >= deadline:
                exited = self.p.poll()
                self.p.kill()  # (reading stderr of a live process would wait for it forever)
                self.p.wait(timeout=30)
                why = f"exited with {exited}" if exited is not None else f"no match in {timeout} s"
                raise AssertionError(f"{why}; stdout {self.out!r}; stderr {self.p.stderr.read()!r}")
            time.sleep(0.05)

    def type(self, line):
        self.p.stdin.write(line.encode())
        self.p.stdin.flush()

    def ctrl_c(self):
        self.p.send_signal(signal.SIGINT)

    def finish(self):
        code = self.p.wait(timeout=120)
        self._reader.join(timeout=10)
        return code, self.out.decode(errors="replace"), self.p.stderr.read().decode()


@pytest.mark.slow
def test_k3_generate_ctrl_c_ends_cleanly(tmp_path):
    ck = make_checkpoint(tmp_path)
    t = Terminal(["generate", "--checkpoint", str(ck), "--prompt", "hello", "--max-tokens", "100000",
                  "--temperature", "0"])
    t.wait_for(lambda out: len(out) > len("hello") + 1)  # a few tokens in
    t.ctrl_c()
    code, out, err = t.finish()
    assert code == 130 and err == "k3 generate: interrupted\n" and out.startswith("hello") and out.endswith("\n")


@pytest.mark.slow
def test_k3_chat_ctrl_c_stops_the_reply_and_the_next_prompt_works(tmp_path):
    ck = make_checkpoint(tmp_path)
    t = Terminal(["chat", "--checkpoint", str(ck), "--max-tokens", "100000", "--temperature", "0"])
    t.wait_for(lambda out: out.endswith("> "))
    for turn in (1, 2):
        t.type("hi\n")
        t.wait_for(lambda out: not out.endswith("> "))  # the reply is streaming
        t.ctrl_c()
        t.wait_for(lambda out: out.count(" [stopped]\n> ") == turn)
    t.ctrl_c()  # at the prompt: quit, as an interrupted command
    code, out, err = t.finish()
    assert code == 130 and err == "k3 chat: interrupted\n" and out.endswith("> \n"), (out, err)


def test_a_changed_byte_is_named_and_no_verify_loads_anyway(tmp_path, capsys):
    from tests.checkpoint.test_manifest import flip_tensor_byte

    ck = make_checkpoint(tmp_path)
    flip_tensor_byte(ck / "model.safetensors")
    argv = ["generate", "--checkpoint", str(ck), "--prompt", "hello", "--max-tokens", "2", "--temperature", "0"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "model.safetensors does not match its sha256" in err and "--no-verify" in err
    assert main(argv + ["--no-verify"]) == 0


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
    model = load_pretrained(ck).eval()
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
    from k3.cli.generate import make_engine
    from k3.inference.load import load_for_inference
    from k3.inference.api import SamplingParams
    from k3.serve import create_app
    from k3.chat.xtml import KimiK3Chat

    ck, _ = make_kimi_checkpoint(tmp_path)
    model, tok = load_for_inference(ck, "cpu")
    engine = make_engine(model, tok)
    seen = []
    submit = engine.submit
    engine.submit = lambda req, *rest: seen.append(req) or submit(req, *rest)
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
                              seed=0, device="cpu", verify=True)
    out = io.StringIO()
    assert chat.run(args, stdin=io.StringIO("hello\n\n"), stdout=out) == 0 and out.getvalue().count("> ") == 2


def test_nan_weights_are_refused_naming_the_tensors(tmp_path, capsys):
    """A diverged run's checkpoint: an error naming the tensors and a non-zero exit, not empty output and 0."""
    import pytest

    from k3.checkpoint import CheckpointError
    from k3.pretrained import load_pretrained

    ck = make_checkpoint(tmp_path)
    model = load_pretrained(ck)
    with torch.no_grad():
        name = next(n for n, p in model.named_parameters() if "layers.2." in n and p.is_floating_point())
        dict(model.named_parameters())[name][0].fill_(float("inf"))
    save_pretrained(model, ck)
    with pytest.raises(CheckpointError, match=r"weight tensor\(s\) hold NaN or inf values \(.*layers\.2\."):
        load_pretrained(ck)
    assert main(["generate", "--checkpoint", str(ck), "--prompt", "hello", "--max-tokens", "3"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and "hold NaN or inf values" in err and "Use an earlier checkpoint" in err
