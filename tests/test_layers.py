"""The import contract: k3's packages form layers, and no module imports a package of its own layer or above.

This file is the one statement of the layer order (docs/contributing.md ``## Layers`` explains it; DESIGN.md's
``ops <- layers <- model <- {train, inference, vision} <- {distributed, serve, post, env, cli}`` is the sketch it
refines). Every ``import`` and ``from ... import`` of every module under k3/ counts, including those inside
functions and under ``if TYPE_CHECKING``: a lazy import still ties the lower layer to the higher one.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]

# Lowest first. A module may import its own package and packages of lower rows, never a sibling of its row.
# A "unit" is k3's top-level package or module (k3/config_hf.py belongs to "config"; k3/__init__.py is "k3").
LAYERS: tuple[tuple[str, ...], ...] = (
    ("ops", "config", "atomic"),  # tensor functions; the frozen config; atomic file writes
    ("layers", "data", "checkpoint"),  # nn.Modules of one layer; corpus/tokenizer/packing; names, shards, checksums
    ("model", "quant"),  # K3ForCausalLM; MXFP4 (packed expert banks replace the layers' banks)
    ("vision",),  # K3ForConditionalGeneration: a tower on the text model
    ("pretrained",),  # the one loader: a checkpoint directory -> the model class it holds (text, vision, packed)
    ("train", "inference"),  # what runs a model: the training loop, the engine
    ("chat",),  # chat formats (ChatML, Jinja, XTML, tools), below post and serve
    ("distributed", "serve", "post", "eval", "env"),  # parallel plans; HTTP; SFT/RL; evaluation; agent sandboxes
    ("router",),  # k3 router: a proxy over k3 serve replicas (it may import serve's protocol pieces)
    ("k3",),  # the package's public names (k3/__init__.py)
    ("cli",),  # every command builds what the layers below receive (e.g. the parallel plan)
    ("__main__",),
)
ALIASES = {"config_hf": "config", "config_strict": "config"}
# (file, imported module) back-edges still being removed, each with the branch that removes it. Keep it empty on main.
KNOWN: dict[tuple[str, str], str] = {}


class Edge(NamedTuple):
    file: str  # relative to the tree's root
    line: int
    target: str  # the imported module, absolute
    src: str  # the importing module's unit
    dst: str  # the imported module's unit
    src_rank: int
    dst_rank: int

    def __str__(self) -> str:
        return (f"{self.file}:{self.line} imports {self.target}: layer {self.src_rank} ({self.src}) may not import "
                f"layer {self.dst_rank} ({self.dst})")


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, root: Path):
    """(line, absolute module) for every import in the file, at any depth of the tree."""
    module = _module_name(path, root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if node.module is None or "." not in target:  # `from .. import x`: x may be a submodule
                for a in node.names:
                    sub = root.joinpath(*target.split("."), a.name)
                    yield node.lineno, f"{target}.{a.name}" if sub.is_dir() or sub.with_suffix(".py").exists() \
                        else target
            else:
                yield node.lineno, target


def _unit(module: str, package: str, aliases: dict[str, str]) -> str | None:
    """``package.x.y`` -> "x" (or its alias); the package itself -> its own name; another library -> None."""
    parts = module.split(".")
    if parts[0] != package:
        return None
    if len(parts) == 1:
        return package
    return aliases.get(parts[1], parts[1])


def back_edges(root: Path, package: str, layers=LAYERS, aliases=ALIASES) -> tuple[list[Edge], list[str]]:
    """(every import of ``root/package`` that goes to its own layer or above, units in no layer)."""
    rank = {u: i for i, row in enumerate(layers) for u in row}
    edges, unplaced = [], set()
    for path in sorted((root / package).rglob("*.py")):
        src = _unit(_module_name(path, root), package, aliases)
        if src not in rank:
            unplaced.add(f"{path.relative_to(root)} (unit {src})")
            continue
        for line, target in _imports(path, root):
            dst = _unit(target, package, aliases)
            if dst is None or dst == src:
                continue
            if dst not in rank:
                unplaced.add(f"{path.relative_to(root)}:{line} imports {target} (unit {dst})")
            elif rank[dst] >= rank[src]:
                edges.append(Edge(str(path.relative_to(root)), line, target, src, dst, rank[src], rank[dst]))
    return edges, sorted(unplaced)


def test_k3_has_no_back_edges():
    edges, unplaced = back_edges(ROOT, "k3")
    assert not unplaced, "k3 units missing from LAYERS in tests/test_layers.py (add them to a row):\n" + \
        "\n".join(unplaced)
    bad = [e for e in edges if (e.file, e.target) not in KNOWN]
    assert not bad, ("imports against the layer order (tests/test_layers.py LAYERS, docs/contributing.md ## Layers); "
                     "move the code down, or pass it in from above:\n" + "\n".join(map(str, bad)))
    stale = sorted(set(KNOWN) - {(e.file, e.target) for e in edges})
    assert not stale, f"KNOWN lists back-edges that are gone: delete {stale} from tests/test_layers.py"


def test_every_unit_of_the_order_is_named_once():
    units = [u for row in LAYERS for u in row]
    assert len(units) == len(set(units)), f"a unit is in two rows of LAYERS: {sorted(units)}"


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def test_checker_reports_a_planted_back_edge(tmp_path):
    """A synthetic package: one allowed import, a sibling import, and a back-edge hidden in a function body."""
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/ops/__init__.py": "",
        "pkg/ops/a.py": "import torch\n\ndef f():\n    from ..layers.b import g  # planted\n    return g\n",
        "pkg/layers/__init__.py": "",
        "pkg/layers/b.py": "from pkg.ops import a\nfrom . import c\n\ndef g():\n    return a\n",
        "pkg/layers/c.py": "",
        "pkg/data.py": "from .layers import c\n",
        "pkg/train/__init__.py": "from .. import data\n",
    })
    layers = (("ops",), ("layers", "data"), ("train",))
    edges, unplaced = back_edges(tmp_path, "pkg", layers, {})
    assert unplaced == ["pkg/__init__.py (unit pkg)"]
    assert sorted(e[:5] for e in edges) == [
        ("pkg/data.py", 1, "pkg.layers", "data", "layers"),  # a sibling of its row
        ("pkg/ops/a.py", 4, "pkg.layers.b", "ops", "layers"),  # inside a function: still an edge
    ]
    msg = str(next(e for e in edges if e.src == "ops"))
    assert msg == "pkg/ops/a.py:4 imports pkg.layers.b: layer 0 (ops) may not import layer 1 (layers)", msg
