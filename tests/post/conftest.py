"""Shared fixtures for post-training tests: a small chat dataset and a ChatML tokenizer learned from it."""

import json

import pytest

from k3.data import train_tokenizer
from k3.chat import ChatTemplate


def sum_records(n: int, seed: int = 0) -> list[dict]:
    """Chat records "What is a + b?" -> reasoning and answer, with an effort tag (a stand-in for k3.post.tasks)."""
    import random

    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randrange(10), rng.randrange(10)
        out.append({"id": f"sum{i}", "effort": rng.choice(["low", "high", "max"]),
                    "messages": [{"role": "user", "content": f"What is {a} + {b}?"},
                                 {"role": "assistant", "content": f"Answer: {a + b}",
                                  "reasoning_content": f"{a} plus {b} makes {a + b}"}]})
    return out


@pytest.fixture(scope="session")
def chat_tokenizer():
    texts = [ChatTemplate().render([{"role": "system", "content": "Reasoning effort: max."}, *r["messages"]])
             for r in sum_records(200)]
    return train_tokenizer(texts, 300)


@pytest.fixture
def chat_jsonl(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in sum_records(64)))
    return path
