"""The manual's examples run as written: every ```python block of README.md and of each docs/*.md page, and every
`python -c "..."` of their bash blocks. A ```python block is a promise that it runs on a CPU in seconds; an example
that cannot (a GPU, a download, a long run) is written as ```bash or as a fence without a language.

They run in a fresh directory where `k3 demo`'s output is stood in for by a small random checkpoint (the
inference example loads runs/demo/checkpoint), each in its own interpreter, as a user would paste them.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]


def blocks(lang: str, page: Path = README) -> list[str]:
    """The fenced ``lang`` blocks of ``page`` as they render: a block indented under a list item loses that indent."""
    found = re.findall(rf"^( *)```{lang}\n(.*?)^\1```", page.read_text(), flags=re.S | re.M)
    return ["".join(line[len(indent):] for line in body.splitlines(keepends=True)) for indent, body in found]


def python_blocks(page: Path = README) -> list[str]:
    return blocks("python", page)


def python_c_snippets(page: Path = README) -> list[str]:
    return [s for block in blocks("bash", page) for s in re.findall(r'python -c "(.*?)"', block, flags=re.S)]


def examples() -> list:
    found = []
    for page in PAGES:
        name = page.stem.lower()
        found += [pytest.param(b, id=f"{name}-python-{i}") for i, b in enumerate(python_blocks(page))]
        found += [pytest.param(s, id=f"{name}-python-c-{i}") for i, s in enumerate(python_c_snippets(page))]
    return found


def page(name: str) -> Path:
    return ROOT / "docs" / f"{name}.md"


def test_the_manual_has_the_examples_this_file_runs():
    readme = python_blocks()
    assert README.read_text().count("\n") <= 350  # a manual, not a log
    first = "\n".join(README.read_text().splitlines()[:60])
    assert "k3 demo" in first and "pytest" in first and "```python" in first  # quick start + example on screen one
    assert any("generate(" in b and "backward()" in b and "K3Config" in b for b in readme)  # the ten-line example
    assert any("load_pretrained" in b and "K3ForCausalLM(cfg)" in b for b in readme)  # the Python API
    assert any("describe_param_groups" in b for b in python_blocks(page("training")))  # the optimiser's plan
    assert any("Engine(" in b for b in python_blocks(page("inference")))
    assert any("K3ForConditionalGeneration" in b for b in python_blocks(page("vision")))
    assert any("pack_experts" in b for b in python_blocks(page("quantisation")))
    assert any("policy_loss" in b for b in python_blocks(page("post-training")))
    every = [b for p in PAGES for b in python_blocks(p)]
    assert not [line for b in every for line in b.splitlines() if line.strip().startswith("...")]


def anchors(page: Path) -> set[str]:
    """The `#fragment`s GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    heads = re.findall(r"^#+ (.+)$", page.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_the_manual_links_to_pages_and_sections_that_exist():
    for p in [*PAGES, ROOT / "benchmarks" / "RESULTS.md"]:
        for target, fragment in re.findall(r"\]\(([^)#\s]+)(?:#([^)\s]+))?\)", p.read_text()):
            if target.startswith("http"):
                continue
            linked = (p.parent / target).resolve()
            assert linked.exists(), f"{p.name} links to {target}, which does not exist"
            if fragment:
                assert fragment in anchors(linked), f"{p.name} links to {target}#{fragment}: no such heading there"


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
def test_manual_example_runs(code, demo_dir):
    r = subprocess.run([sys.executable, "-c", code], cwd=demo_dir, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"manual example failed:\n{code}\n--- stderr:\n{r.stderr[-3000:]}"
