"""k3.env.Harness: an agent harness built from modules named in a configuration file (SPEC §9; seed 000 §7.4).

The modules: the tool interface (which tools, in which schema), the system prompt, the context manager
(context.py), skills (named instructions the model reads on demand with the ``skill`` tool), memory (a notes
file carried across episodes: read into the prompt at the start, appended to by ``remember``) and subagents
(``subagent``: a nested episode in the same sandbox with its own context and tool budget). Training switches
configurations per episode so that the policy does not overfit one tool schema.

One episode: the model generates while the sandbox is paused (no CPU spent while it thinks); each tool call runs
in the sandbox; ``submit`` runs the public verifier; the episode ends on a passing submission, a spent budget,
``max_turns``, or a sandbox killed for breaking its limits. The reward is the hidden verifier's verdict on the
final state, never the model's own claim.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from . import context
from .tasks.base import Budget, Instance, Verdict
from .tools import TOOLS, call

BUILTIN = Path(__file__).parent / "harnesses"


@dataclasses.dataclass(frozen=True)
class HarnessConfig:
    name: str
    tools: tuple[str, ...]
    system_prompt: str
    skills: dict = dataclasses.field(default_factory=dict)  # name -> instructions
    memory: bool = True
    subagent_tool_calls: int = 6
    max_turns: int = 30
    max_tokens_per_turn: int = 1024
    temperature: float = 0.0
    tool_output_chars: int = 4000
    max_exec_s: float = 60.0
    context_chars: int = 48_000
    context_keep_last: int = 6
    context_mode: str = "summarise"  # or "truncate"

    def __post_init__(self):
        unknown = [t for t in self.tools if t not in TOOLS]
        if unknown:
            raise ValueError(f"harness {self.name!r}: tools {unknown} do not exist; choose from {', '.join(TOOLS)}")
        if self.context_mode not in ("summarise", "truncate"):
            raise ValueError(f"harness {self.name!r}: context_mode must be 'summarise' or 'truncate', "
                             f"got {self.context_mode!r}")

    @classmethod
    def load(cls, name_or_path: str) -> HarnessConfig:
        """A shipped configuration by name (``edit``, ``patch``) or a JSON file with the fields above."""
        path = BUILTIN / f"{name_or_path}.json" if (BUILTIN / f"{name_or_path}.json").exists() else Path(name_or_path)
        if not path.is_file():
            raise ValueError(f"harness {name_or_path!r}: no such file and not one of "
                             f"{', '.join(p.stem for p in sorted(BUILTIN.glob('*.json')))}")
        raw = json.loads(path.read_text())
        fields = {f.name for f in dataclasses.fields(cls)}
        bad = sorted(set(raw) - fields)
        if bad:
            raise ValueError(f"{path}: unknown field(s) {bad}; the fields are {', '.join(sorted(fields))}")
        skills = raw.get("skills", {})
        for k, v in list(skills.items()):  # a skill given as "@file.md" is read from beside the config
            if isinstance(v, str) and v.startswith("@"):
                skills[k] = (path.parent / v[1:]).read_text()
        return cls(**{**raw, "tools": tuple(raw["tools"]), "skills": skills})


@dataclasses.dataclass
class Episode:
    task: str
    seed: int
    harness: str
    trajectory: list[dict]
    public: Verdict | None  # the last submission's verdict (None: never submitted)
    hidden: Verdict  # the reward: judged on the final state
    used: dict  # tokens, tool_calls, submissions (and the budget beside each)
    stop: str  # why the episode ended
    violations: list[str]
    paused_s: float  # sandbox paused while the model generated
    active_s: float  # sandbox running tool calls


class _Context:
    """What tools see during one episode (or subagent): the sandbox, the counters and the callbacks."""

    def __init__(self, harness, instance: Instance, sandbox, tools: dict, budget: Budget, events: list):
        self.harness, self.instance, self.sandbox, self.tools = harness, instance, sandbox, tools
        self.config, self.budget, self.events = harness.config, budget, events
        self.used = {"tokens": 0, "tool_calls": 0, "submissions": 0, "subagent_tool_calls": 0}
        self.public: Verdict | None = None
        self.done = self.stop = ""

    def submit(self) -> str:
        if self.used["submissions"] >= self.budget.submissions:
            self.done = "no submissions left"
            return "error: no submissions left"
        self.used["submissions"] += 1
        self.public = self.instance.public(self.sandbox)
        left = self.budget.submissions - self.used["submissions"]
        if self.public.passed:
            self.done = "submitted: public checks passed"
        elif left == 0:
            self.done = "submissions spent"
        return (f"public checks {'passed' if self.public.passed else 'failed'} (score {self.public.score:.2f}): "
                f"{self.public.feedback}. Submissions left: {left}.")

    def remember(self, note: str) -> str:
        if self.harness.memory_path is None:
            return "error: this harness runs without a memory file"
        with open(self.harness.memory_path, "a") as f:
            f.write(f"- {' '.join(note.split())}\n")
        return "noted"

    def subagent(self, task: str) -> str:
        tools = {n: t for n, t in self.tools.items() if n not in ("submit", "subagent", "remember")}
        sub = _Context(self.harness, self.instance, self.sandbox, tools,
                       Budget(self.budget.tokens // 4, self.config.subagent_tool_calls, 0), self.events)
        messages = [{"role": "system", "content": self.config.system_prompt + "\nYou are a subagent: do the task "
                     "below with the tools, then answer in one short message without tool calls."},
                    {"role": "user", "content": "Subagent task: " + task}]
        final = self.harness.loop(messages, sub, depth=1)
        self.used["subagent_tool_calls"] += sub.used["tool_calls"]
        self.used["tokens"] += sub.used["tokens"]
        return final or "(the subagent gave no answer)"


class Harness:
    def __init__(self, config: HarnessConfig, policy, memory_path: Path | str | None = None):
        self.config, self.policy = config, policy
        self.memory_path = Path(memory_path) if memory_path and config.memory else None
        self.paused_s = self.active_s = 0.0

    def system_prompt(self) -> str:
        parts = [self.config.system_prompt]
        if self.config.skills and "skill" in self.config.tools:
            parts.append("Skills (read one with the skill tool):\n" + "\n".join(
                f"- {k}: {v.strip().splitlines()[0]}" for k, v in self.config.skills.items()))
        if self.memory_path is not None and self.memory_path.exists():
            parts.append("Notes from earlier episodes:\n" + self.memory_path.read_text()[-4000:])
        return "\n\n".join(parts)

    def run(self, instance: Instance, sandbox, sink=None) -> Episode:
        """One episode of ``instance`` in ``sandbox``; each trajectory event also goes to ``sink`` if given."""
        events: list[dict] = _Sink(sink)
        events.append({"type": "episode", "task": instance.task, "seed": instance.seed, "harness": self.config.name,
                       "goal": instance.goal, "budget": dataclasses.asdict(instance.budget)})
        tools = {n: TOOLS[n] for n in self.config.tools}
        ctx = _Context(self, instance, sandbox, tools, instance.budget, events)
        messages = [{"role": "system", "content": self.system_prompt()},
                    {"role": "user", "content": instance.goal + f"\nBudget: {instance.budget.tool_calls} tool calls, "
                     f"{instance.budget.submissions} submissions."}]
        self.loop(messages, ctx, depth=0)
        hidden = instance.hidden(sandbox)
        used = {k: (v, getattr(instance.budget, k, None)) for k, v in ctx.used.items()}
        stop = ctx.done or ctx.stop
        events.append({"type": "result", "public": ctx.public and ctx.public.to_json(), "hidden": hidden.to_json(),
                       "used": used, "stop": stop, "violations": list(sandbox.violations),
                       "paused_s": round(self.paused_s, 4), "active_s": round(self.active_s, 4)})
        return Episode(instance.task, instance.seed, self.config.name, list(events), ctx.public, hidden, used, stop,
                       list(sandbox.violations), self.paused_s, self.active_s)

    def loop(self, messages: list[dict], ctx: _Context, depth: int) -> str:
        """Generate, run the calls, repeat; returns the last assistant text. Sets ``ctx.stop``."""
        cfg, specs, idle, last = self.config, [t.spec() for t in ctx.tools.values()], 0, ""
        ctx.stop = "max_turns"
        for turn in range(cfg.max_turns):
            if ctx.used["tokens"] >= ctx.budget.tokens:
                ctx.stop = "token budget spent"
                break
            visible = context.fit(messages, cfg.context_chars, cfg.context_keep_last, cfg.context_mode)
            t0 = time.perf_counter()
            ctx.sandbox.pause()  # the model thinks; the sandbox costs nothing meanwhile
            try:
                reply = self.policy.generate(visible, specs, cfg.max_tokens_per_turn, cfg.temperature)
            finally:
                ctx.sandbox.resume()
            self.paused_s += time.perf_counter() - t0
            msg, usage = reply["message"], reply.get("usage") or {}
            ctx.used["tokens"] += usage.get("total_tokens") or (usage.get("prompt_tokens", 0)
                                                                + usage.get("completion_tokens", 0))
            calls = msg.get("tool_calls") or []
            messages.append({"role": "assistant", "content": msg.get("content") or "",
                             **({"tool_calls": calls} if calls else {})})
            last = msg.get("content") or last
            ctx.events.append({"type": "assistant", "depth": depth, "turn": turn, "content": msg.get("content"),
                               "tool_calls": calls, "usage": usage, "generate_s": round(time.perf_counter() - t0, 4),
                               "context_messages": len(visible)})
            if not calls:
                idle += 1
                if depth or idle >= 3:
                    ctx.stop = "answered" if depth else "no tool calls in 3 turns"
                    break
                messages.append({"role": "user", "content": "Use the tools to work on the task; call submit when "
                                 "done."})
                continue
            idle = 0
            for c in calls:
                name, args = c["function"]["name"], c["function"].get("arguments", "{}")
                if ctx.used["tool_calls"] >= ctx.budget.tool_calls:
                    out = "error: the tool-call budget is spent"
                    ctx.stop = "tool-call budget spent"
                else:
                    ctx.used["tool_calls"] += 1
                    before, t1 = len(ctx.sandbox.violations), time.perf_counter()
                    out = call(ctx, name, args)
                    self.active_s += time.perf_counter() - t1
                    broke = ctx.sandbox.violations[before:]
                    if any(v in ("memory", "procs") for v in broke):
                        ctx.stop = f"sandbox killed: broke its {broke[-1]} limit"
                messages.append({"role": "tool", "tool_call_id": c.get("id", ""), "content": out})
                ctx.events.append({"type": "tool", "depth": depth, "turn": turn, "name": name, "arguments": args,
                                   "result": out[:4000], "violations": list(ctx.sandbox.violations)})
            if ctx.done or ctx.stop in ("tool-call budget spent",) or ctx.stop.startswith("sandbox killed"):
                break
        return last


class _Sink(list):
    """A list of events that also hands each one to a callback (the CLI writes them as JSONL lines)."""

    def __init__(self, sink):
        super().__init__()
        self.sink = sink

    def append(self, event):
        super().append(event)
        if self.sink is not None:
            self.sink(event)
