"""The README's examples run as written: every ```python block, and every `python -c "..."` of its bash blocks.

They run in a fresh directory where `k3 demo`'s output is stood in for by a small random checkpoint (the
inference example loads runs/demo/checkpoint), each in its own interpreter, as a user would paste them.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parent.parent / "README.md"


def blocks(lang: str) -> list[str]:
    """The fenced ``lang`` blocks as they render: a block indented under a list item loses that indent."""
    found = re.findall(rf"^( *)```{lang}\n(.*?)^\1```", README.read_text(), flags=re.S | re.M)
    return ["".join(line[len(indent):] for line in body.splitlines(keepends=True)) for indent, body in found]


def python_blocks() -> list[str]:
    return blocks("python")


def python_c_snippets() -> list[str]:
    return [s for block in blocks("bash") for s in re.findall(r'python -c "(.*?)"', block, flags=re.S)]


def examples() -> list:
    found = [pytest.param(b, id=f"python-block-{i}") for i, b in enumerate(python_blocks())]
    return found + [pytest.param(s, id=f"python-c-{i}") for i, s in enumerate(python_c_snippets())]


def test_the_readme_has_the_examples_this_file_runs():
    blocks = python_blocks()
    assert any("describe_param_groups" in s for s in python_c_snippets())  # the optimiser's plan
    assert any("load_pretrained" in b and "K3ForCausalLM(cfg)" in b for b in blocks)  # the Python API
    assert any("Engine(" in b for b in blocks)  # inference
    assert not [line for b in blocks for line in b.splitlines() if line.strip().startswith("...")]


@pytest.fixture
def demo_dir(tmp_path):
    """runs/demo/checkpoint as `k3 demo` leaves it, with random weights (the examples only need it to load)."""
    from k3 import K3Config, K3ForCausalLM
    from k3.pretrained import save_pretrained
    from k3.data import save_tokenizer, train_tokenizer

    ckpt = tmp_path / "runs" / "demo" / "checkpoint"
    tok = train_tokenizer(["def fibonacci(n):\n    return n\n" * 20, "import os\nprint(os.getcwd())\n" * 20], 300)
    torch.manual_seed(0)
    save_pretrained(K3ForCausalLM(K3Config.preset("tiny").replace(vocab_size=tok.get_vocab_size())), ckpt)
    save_tokenizer(tok, ckpt)
    return tmp_path


@pytest.mark.slow
@pytest.mark.parametrize("code", examples())
def test_readme_example_runs(code, demo_dir):
    r = subprocess.run([sys.executable, "-c", code], cwd=demo_dir, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"README example failed:\n{code}\n--- stderr:\n{r.stderr[-3000:]}"
