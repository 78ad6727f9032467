"""One path per layer (issue 43, item 4): no module under k3/layers or k3/model chooses its path by grad mode
(``torch.is_grad_enabled()``) or by ``hasattr(self, ...)`` standing in for a config flag, and none dispatches to an
inference decode kernel by itself: those predicates (``*_applies`` of k3.ops.moe_decode, proj_decode, router_decode,
attn_res) are inference's, through the mixer hook (k3.inference.fast). The test walks the syntax tree of every module
and names the ``file:line`` of each violation."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ("k3/layers", "k3/model")
DECODE_PREDICATES = {"proj_decode_applies", "decode_applies", "router_decode_applies", "kernel_applies"}


def violations(source: str, name: str = "<string>") -> list[str]:
    """Each path choice of ``source`` that this contract forbids, as "name:line what"."""
    found = []
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Attribute) and node.attr == "is_grad_enabled":
            found.append(f"{name}:{node.lineno} reads torch.is_grad_enabled()")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr") \
                and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id == "self" and \
                (node.func.id == "hasattr" or len(node.args) == 3):
            found.append(f"{name}:{node.lineno} {node.func.id}(self, ...) stands in for a config flag")
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if alias.name in DECODE_PREDICATES:
                    found.append(f"{name}:{node.lineno} imports {alias.name}: a decode kernel's predicate "
                                 "(inference's, k3.inference.fast)")
    return found


def test_no_layer_module_chooses_its_path_by_grad_mode_or_hasattr():
    found = []
    for top in CHECKED:
        for path in sorted((ROOT / top).rglob("*.py")):
            found += violations(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    assert not found, "one path per layer; move these to a config flag or to inference's mixer:\n" + "\n".join(found)


def test_the_check_finds_a_planted_violation():
    planted = ("import torch\nfrom ...ops.moe_decode import decode_applies\nclass L:\n    def forward(self, x):\n"
               "        if torch.is_grad_enabled() and hasattr(self, 'g_proj') and getattr(self, 'q', None):\n"
               "            return x\n")
    assert [v.split(" ", 1)[0] for v in violations(planted, "m.py")] == ["m.py:2", "m.py:5", "m.py:5", "m.py:5"]
