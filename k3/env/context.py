"""The harness's context manager: what of a long episode the model still sees.

Two stages, cheapest first, applied before every generation to a copy (the trajectory keeps everything):
1. tool outputs older than the last ``keep_last`` turns are cut to their first lines;
2. if the history is still over ``max_chars``, whole turns are dropped oldest first (an assistant message and
   its tool results go together, so every tool result keeps its call), down to ``keep_last`` turns, and one
   message says what was dropped: in "summarise" mode the dropped calls and their exit lines, in "truncate"
   mode only how many turns.
The system prompt and the task (the first two messages) are always kept. Length is counted in characters, a
stand-in for tokens that needs no tokenizer (about 4 characters per token for English and code).
"""

from __future__ import annotations

import json


def _turns(body: list[dict]) -> list[list[dict]]:
    turns: list[list[dict]] = []
    for m in body:
        if m["role"] == "assistant" or not turns:
            turns.append([m])
        else:
            turns[-1].append(m)
    return turns


def _size(messages: list[dict]) -> int:
    return sum(len(json.dumps(m)) for m in messages)


def _summary(dropped: list[list[dict]], mode: str) -> dict:
    text = f"[context manager: {len(dropped)} earlier turns were removed to fit the context"
    if mode == "summarise":
        lines = []
        for turn in dropped:
            results = [m["content"].rstrip().rsplit("\n", 1)[-1][:60] for m in turn[1:] if m["role"] == "tool"]
            for i, c in enumerate(turn[0].get("tool_calls") or []):
                f = c["function"]
                lines.append(f"- {f['name']}({f['arguments'][:80]}) -> {results[i] if i < len(results) else '?'}")
        text += ". Calls made there:\n" + "\n".join(lines[-30:]) if lines else ""
    return {"role": "user", "content": text + "]"}


def fit(messages: list[dict], max_chars: int, keep_last: int, mode: str = "summarise") -> list[dict]:
    head, body = messages[:2], messages[2:]
    turns = _turns(body)
    old, recent = turns[:-keep_last] if keep_last else turns, turns[-keep_last:] if keep_last else []
    old = [[m if m["role"] != "tool" or len(m["content"]) < 400 else
            {**m, "content": m["content"][:300] + "\n... [old output cut]"} for m in t] for t in old]
    kept = old + recent
    dropped: list[list[dict]] = []
    while len(kept) > keep_last and _size(head + [m for t in kept for m in t]) > max_chars:
        dropped.append(kept.pop(0))
    out = head + ([_summary(dropped, mode)] if dropped else [])
    return out + [m for t in kept for m in t]
