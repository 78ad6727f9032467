"""Policies the harness drives: a model behind an OpenAI-compatible endpoint, or a task's scripted oracle.

A policy has one method, ``generate(messages, tools, max_tokens, temperature) -> {"message", "usage"}``, where
``message`` is an OpenAI assistant message (``content``, ``tool_calls``). The HTTP client is the ``openai``
package: the reference client of the protocol k3 serve speaks, kept in step with the API (tool calls,
usage, errors, retries), and already a test dependency; it brings httpx. Imported when a model policy is made,
so the sandbox and tasks need no network packages.
"""

from __future__ import annotations

import json

from .patch import render_replace, render_write
from .tasks.base import Instance, Replace, Shell, Submit, Write


class OpenAIPolicy:
    def __init__(self, url: str, model: str | None = None, api_key: str = "EMPTY", timeout: float = 600):
        try:
            import openai
        except ImportError:
            raise RuntimeError("the agent's HTTP client is the openai package: pip install 'k3[agent]'") from None
        self.client = openai.OpenAI(base_url=url.rstrip("/") + ("" if url.rstrip("/").endswith("/v1") else "/v1"),
                                    api_key=api_key, timeout=timeout, max_retries=2)
        self.errors = (openai.APIError,)
        if model is None:
            try:
                model = self.client.models.list().data[0].id
            except openai.APIError as e:
                raise RuntimeError(f"--url {url}: could not list the server's models ({e}); is it an "
                                   "OpenAI-compatible server? Give --model to skip the lookup") from None
        self.model = model

    def generate(self, messages: list[dict], tools: list[dict], max_tokens: int, temperature: float) -> dict:
        try:
            r = self.client.chat.completions.create(model=self.model, messages=messages, tools=tools,
                                                    max_tokens=max_tokens, temperature=temperature)
        except self.errors as e:
            raise RuntimeError(f"the model server refused a request: {e}") from None
        m = r.choices[0].message
        calls = [{"id": c.id, "type": "function",
                  "function": {"name": c.function.name, "arguments": c.function.arguments}}
                 for c in (m.tool_calls or [])]
        usage = r.usage.model_dump() if r.usage else {}
        return {"message": {"content": m.content, "tool_calls": calls}, "usage": usage}


def _call(i: int, name: str, args: dict) -> dict:
    return {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def render(actions: list, tools: tuple[str, ...], files: dict[str, str]) -> list[dict]:
    """A task's actions as tool calls in a harness's schema (edit-by-replace or apply-patch)."""
    known, out = dict(files), []
    for i, a in enumerate(actions):
        if isinstance(a, Shell):
            out.append(_call(i, "bash", {"command": a.cmd}) if "bash" in tools
                       else _call(i, "shell", {"command": ["bash", "-lc", a.cmd]}))
        elif isinstance(a, Write):
            out.append(_call(i, "create", {"path": a.path, "content": a.content}) if "create" in tools
                       else _call(i, "apply_patch", {"patch": render_write(a.path, a.content, a.path in known)}))
            known[a.path] = a.content
        elif isinstance(a, Replace):
            text = known[a.path]
            out.append(_call(i, "str_replace", {"path": a.path, "old_str": a.old, "new_str": a.new})
                       if "str_replace" in tools else
                       _call(i, "apply_patch", {"patch": render_replace(a.path, text, a.old, a.new)}))
            known[a.path] = text.replace(a.old, a.new)
        elif isinstance(a, Submit):
            out.append(_call(i, "submit", {}))
    return out


class ScriptedPolicy:
    """Replies with the given tool calls, one per turn, then a final message; tokens estimated as chars / 4."""

    def __init__(self, calls: list[dict], final: str = "done"):
        self.calls, self.final, self.i = calls, final, 0

    def generate(self, messages, tools, max_tokens, temperature) -> dict:
        if messages[1]["content"].startswith("Subagent task:"):  # nested episodes of a script just answer
            return {"message": {"content": "subagent: nothing to add", "tool_calls": []}, "usage": {}}
        if self.i < len(self.calls):
            calls, self.i = [self.calls[self.i]], self.i + 1
            msg = {"content": "", "tool_calls": calls}
        else:
            msg = {"content": self.final, "tool_calls": []}
        prompt = sum(len(json.dumps(m)) for m in messages) // 4
        return {"message": msg, "usage": {"prompt_tokens": prompt, "completion_tokens": len(json.dumps(msg)) // 4}}


def oracle(instance: Instance, tools: tuple[str, ...], actions: list | None = None) -> ScriptedPolicy:
    """The task's scripted oracle (or other ``actions``: its wrong solution, a cheat) in this harness's schema."""
    return ScriptedPolicy(render(instance.oracle if actions is None else actions, tools, instance.files))
