"""The package's import graph: no cycles, and no import that runs upward between layers.

Every import counts, function-level ones too: a deferred import still ties two modules
together. The layers follow the data flow of docs/architecture.md; a module may import its
own layer and the layers below it."""
from __future__ import annotations

import ast
import functools
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "slipstream"

# lowest first; a module belongs to the first prefix that matches it
LAYERS: list[tuple[str, ...]] = [
    # spec.config is EngineConfig's speculative_config: it belongs with the config
    ("slipstream.version", "slipstream.errors", "slipstream.utils", "slipstream.config",
     "slipstream.spec.config"),
    ("slipstream.ops", "slipstream.quant"),  # quant: FP8 arithmetic and formats, beside the kernels
    ("slipstream.model",),
    ("slipstream.sampling",),
    ("slipstream.spec",),  # drafters and acceptance: tensors in, tensors out, above sampling
    ("slipstream.sched",),
    ("slipstream.runner",),
    ("slipstream.executor",),
    ("slipstream.core",),
    ("slipstream.frontend",),
    ("slipstream.server",),
    ("slipstream.ray",),
    ("slipstream.bench",),
    ("slipstream.cli",),
    ("slipstream",),  # the package's public names, loaded on first use
]


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = path
    return mods


@functools.cache  # parsed once for the tests that read it (none changes it)
def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports (anywhere in its body)."""
    mods = _modules()
    graph: dict[str, set[str]] = {name: set() for name in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                targets = [module] + [f"{module}.{a.name}" for a in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in mods and t != name}
    return graph


def layer_of(module: str) -> int:
    for rank, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    raise AssertionError(f"{module} belongs to no layer: add it to LAYERS")


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_package_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_module_imports_a_layer_above_its_own():
    upward = [f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)})"
              for a, targets in import_graph().items() for b in sorted(targets)
              if layer_of(b) > layer_of(a)]
    assert not upward, "\n".join(upward)


@pytest.mark.parametrize("graph, cyclic", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, True),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, False),
])
def test_the_cycle_finder_finds_a_planted_cycle(graph, cyclic):
    assert (find_cycle(graph) is not None) == cyclic
