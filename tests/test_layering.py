"""The package layering, checked on the source: no import runs up the layers, and no module imports itself round a
circle of other modules.

Layers, lowest first (docs/code-layout.md): the package root's base modules (errors, progress, quiet), `checkpoint`
(files), `models` with the architecture files in `mappings/` (what a model is), then `convert` and `engine` side by
side (the engine imports neither `convert` nor megatron-core), `megatron` (on `convert`), `bridge` (the public API,
on `megatron`), `grpo`, and the commands (`cli`, `demo`). Every import counts, including those inside functions;
only imports under `if TYPE_CHECKING:` (type-only) are exempt.

Inside `grpo`, the same by role, lowest first: its configuration error (`grpo.errors`), the algorithm's pure
functions (`algorithm`), then data and rewards (`data`) and the backend-neutral refit with its checks (`refit`) side
by side, the training backends (`backends`: megatron-core and DTensor, neither importing the other), and the run
(`run`: config, plan, trainer, launch, export), which composes them all.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).parents[1]
PACKAGE = "hf_mcore_bridge"
SOURCES = {PACKAGE: ROOT / "hf_mcore_bridge", f"{PACKAGE}.cli": ROOT / "cli", f"{PACKAGE}.mappings": ROOT / "mappings"}
"""Where each importable package's files are (`pyproject.toml` maps `cli/` and `mappings/` into the package)."""

GROUPS = {
    "": "base",
    "errors": "base",
    "progress": "base",
    "quiet": "base",
    "checkpoint": "checkpoint",
    "models": "models",
    "mappings": "models",
    "convert": "convert",
    "engine": "engine",
    "megatron": "megatron",
    "bridge": "bridge",
    "grpo": "grpo",
    "cli": "commands",
    "demo": "commands",
}
"""The layer of each top-level module or subpackage of `hf_mcore_bridge` (`""`: the package's own `__init__`)."""

ALLOWED = {
    "base": set(),
    "checkpoint": {"base"},
    "models": {"base", "checkpoint"},
    "convert": {"base", "checkpoint", "models"},
    "engine": {"base", "checkpoint", "models"},
    "megatron": {"base", "checkpoint", "models", "convert"},
    "bridge": {"base", "checkpoint", "models", "convert", "megatron"},
    "grpo": {"base", "checkpoint", "models", "convert", "engine", "megatron", "bridge"},
    "commands": {"base", "checkpoint", "models", "convert", "engine", "megatron", "bridge", "grpo"},
}
"""The layers each layer may import (besides its own)."""

GRPO_GROUPS = {
    "": "grpo-base",
    "errors": "grpo-base",
    "algorithm": "algorithm",
    "data": "data",
    "refit": "refit",
    "backends": "backends",
    "run": "run",
}
"""The role of each module or subpackage directly under `grpo` (`""`: its own `__init__`)."""

GRPO_ALLOWED = {
    "grpo-base": set(),
    "algorithm": {"grpo-base"},
    "data": {"grpo-base", "algorithm"},
    "refit": {"grpo-base", "algorithm"},
    "backends": {"grpo-base", "algorithm", "refit"},
    "run": {"grpo-base", "algorithm", "data", "refit", "backends"},
}
"""The roles of `grpo` each role may import (besides its own)."""

BACKENDS = ("megatron", "dtensor")
"""The training backends under `grpo.backends`: each may import the shared modules beside them, not the other."""

WITHOUT_MEGATRON_CORE = {"base", "models", "engine"}
"""Layers that never import megatron-core (the `megatron` distribution); `checkpoint` imports the enum classes a
checkpoint's pickles may hold, where megatron-core is installed."""


@dataclass(frozen=True)
class Import:
    """One import statement's target, as a module of the package where it names one."""

    module: str
    line: int


def modules() -> dict[str, Path]:
    """Every module of the package, by dotted name."""
    found = {}
    for package, root in SOURCES.items():
        for path in root.rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if package == PACKAGE and parts and parts[0] in ("cli", "mappings"):
                continue
            found[".".join([package, *parts])] = path
    return found


def _type_only(tree: ast.AST) -> set[int]:
    """The nodes under `if TYPE_CHECKING:` (not their `else`)."""
    nodes: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            nodes |= {id(inner) for statement in node.body for inner in ast.walk(statement)}
    return nodes


def imports(path: Path, known: set[str]) -> Iterator[Import]:
    """The modules a file imports at run time: `from a.b import c` is `a.b.c` where that is a module, else `a.b`."""
    tree = ast.parse(path.read_text())
    skipped = _type_only(tree)
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            yield from (Import(alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                yield Import(name if name in known else node.module, node.lineno)


def layer(module: str) -> str:
    """The layer of a module of the package (a KeyError names a top-level module no layer claims)."""
    parts = module.split(".")
    return GROUPS[parts[1] if len(parts) > 1 else ""]


def grpo_role(module: str) -> str | None:
    """The role of a module of `grpo` (None outside `grpo`; a KeyError names a module no role claims)."""
    parts = module.split(".")
    if parts[1:2] != ["grpo"]:
        return None
    return GRPO_GROUPS[parts[2] if len(parts) > 2 else ""]


def _backend(module: str) -> str | None:
    """The training backend a module of `grpo.backends` belongs to (None for the modules they share)."""
    parts = module.split(".")
    return parts[3] if parts[1:3] == ["grpo", "backends"] and len(parts) > 3 and parts[3] in BACKENDS else None


def grpo_upward_imports(sources: dict[str, Path], root: Path = ROOT) -> list[str]:
    """Imports of a `grpo` role the importing module's role may not import, and imports of one backend by the
    other."""
    known = set(sources)
    found: list[str] = []
    for module, path in sorted(sources.items()):
        own = grpo_role(module)
        if own is None:
            continue
        for target in imports(path, known):
            role = grpo_role(target.module) if target.module in known else None
            if role is None:
                continue
            where = f"{path.relative_to(root)}:{target.line} imports {target.module}"
            if role not in GRPO_ALLOWED[own] | {own}:
                found.append(f"{where} ({own} -> {role})")
            elif _backend(module) and _backend(target.module) not in (None, _backend(module)):
                found.append(f"{where} (backend {_backend(module)} -> {_backend(target.module)})")
    return list(dict.fromkeys(found))


def upward_imports(sources: dict[str, Path], root: Path = ROOT) -> list[str]:
    """Imports of a layer the importing module's layer may not import, and megatron-core imports where it may not
    be imported."""
    known = set(sources)
    found: list[str] = []
    for module, path in sorted(sources.items()):
        own = layer(module)
        for target in imports(path, known):
            where = f"{path.relative_to(root)}:{target.line} imports {target.module}"
            if target.module.split(".")[0] == "megatron" and own in WITHOUT_MEGATRON_CORE:
                found.append(f"{where} (megatron-core, in {own})")
            elif target.module in known and layer(target.module) not in ALLOWED[own] | {own}:
                found.append(f"{where} ({own} -> {layer(target.module)})")
    return list(dict.fromkeys(found))


def cycles(sources: dict[str, Path]) -> list[list[str]]:
    """The import circles between modules: strongly connected components of more than one module (Tarjan's)."""
    known = set(sources)
    graph = {
        m: {t.module for t in imports(p, known) if t.module in known and t.module != m} for m, p in sources.items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_every_top_level_module_has_a_layer() -> None:
    sources = modules()
    assert len(sources) > 100
    assert {module.split(".")[1] for module in sources if module.count(".")} <= set(GROUPS)


def test_no_import_runs_up_the_layers() -> None:
    assert upward_imports(modules()) == []


def test_every_grpo_module_has_a_role() -> None:
    sources = modules()
    grpo = [module for module in sources if grpo_role(module) is not None]
    assert len(grpo) > 40
    assert {module.split(".")[2] for module in grpo if module.count(".") > 1} <= set(GRPO_GROUPS)


def test_no_import_runs_up_the_grpo_roles() -> None:
    assert grpo_upward_imports(modules()) == []


def test_no_import_circles() -> None:
    assert cycles(modules()) == []


def test_the_engine_imports_nothing_from_convert() -> None:
    sources = modules()
    engine = {m: p for m, p in sources.items() if m.startswith(f"{PACKAGE}.engine")}
    assert len(engine) > 10
    targets = {t.module for path in engine.values() for t in imports(path, set(sources))}
    assert not any(t.startswith((f"{PACKAGE}.convert", f"{PACKAGE}.megatron", "megatron")) for t in targets)
    assert f"{PACKAGE}.models.spec" in targets  # it reads the one description


def _probe(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    sources = {}
    for module, text in files.items():
        path = tmp_path / f"{module.replace('.', '_')}.py"
        path.write_text(text)
        sources[module] = path
    return sources


def test_the_checks_see_what_they_forbid(tmp_path: Path) -> None:
    """An upward import (also inside a function), megatron-core in the engine, and a circle are each found; a
    type-only import and a downward one are not."""
    sources = _probe(
        tmp_path,
        {
            f"{PACKAGE}.checkpoint.low": f"def f():\n    from {PACKAGE}.convert.high import g\n",
            f"{PACKAGE}.convert.high": f"from {PACKAGE}.checkpoint.low import f\n",
            f"{PACKAGE}.engine.a": (
                "from typing import TYPE_CHECKING\n"
                f"from {PACKAGE}.engine.b import x\n"
                f"if TYPE_CHECKING:\n    from {PACKAGE}.convert.high import g\n"
                "import megatron.core\n"
            ),
            f"{PACKAGE}.engine.b": f"def x():\n    from {PACKAGE}.engine.a import y\n",
            f"{PACKAGE}.models.c": f"from {PACKAGE}.models.d import z\n",
            f"{PACKAGE}.models.d": (
                f"from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from {PACKAGE}.models.c import w\n"
            ),
        },
    )
    upward = upward_imports(sources, tmp_path)
    assert [hit.split(" imports ")[1] for hit in upward] == [
        f"{PACKAGE}.convert.high (checkpoint -> convert)",
        "megatron.core (megatron-core, in engine)",
    ]
    assert cycles(sources) == [
        sorted([f"{PACKAGE}.checkpoint.low", f"{PACKAGE}.convert.high"]),
        sorted([f"{PACKAGE}.engine.a", f"{PACKAGE}.engine.b"]),
    ]


def test_the_grpo_checks_see_what_they_forbid(tmp_path: Path) -> None:
    """The algorithm importing the run (also inside a function) and one backend importing the other are found; a
    type-only import of the run, the run importing a backend and a backend importing the modules they share are
    not."""
    grpo = f"{PACKAGE}.grpo"
    sources = _probe(
        tmp_path,
        {
            f"{grpo}.algorithm.losses": (
                "from typing import TYPE_CHECKING\n"
                f"if TYPE_CHECKING:\n    from {grpo}.run.config import GRPOConfig\n"
                f"def f():\n    from {grpo}.run.plan import g\n"
            ),
            f"{grpo}.run.config": f"from {grpo}.backends.megatron.config import MegatronConfig\n",
            f"{grpo}.run.plan": "",
            f"{grpo}.backends.base": "",
            f"{grpo}.backends.megatron.config": f"from {grpo}.backends.base import x\n",
            f"{grpo}.backends.dtensor.policy": f"from {grpo}.backends.megatron.config import MegatronConfig\n",
        },
    )
    upward = grpo_upward_imports(sources, tmp_path)
    assert [hit.split(" imports ")[1] for hit in upward] == [
        f"{grpo}.run.plan (algorithm -> run)",
        f"{grpo}.backends.megatron.config (backend dtensor -> megatron)",
    ]
