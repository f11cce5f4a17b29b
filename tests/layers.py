"""The floor plan as a check: every project import points down, and none closes a cycle.

``python -m tests.layers`` (run by ``make lint``) reads every module under the product
folders with `ast`, collects its imports of project modules (top-level and
function-local alike; ``if TYPE_CHECKING:`` blocks are skipped, they never run), and fails
on an import that climbs a floor or on any cycle between modules. The floors are
`FLOORS`: each may import itself and those it names. Written by hand because the rule is
ours; the parsing is the standard library's.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("runtime", "actors", "jobs", "cluster")

# Inside the foundation, its subsystems in the order they stack: the shared core at the
# bottom (errors, hooks, waiting, ...), pure data and durable state on it, supervision over
# state, the config (which names every subsystem's settings) above those, then NATS, geo
# replication and the engines that start them all.
RUNTIME_FLOORS: Mapping[str, frozenset[str]] = {
    "runtime": frozenset(),
    "runtime.data": frozenset({"runtime"}),
    "runtime.state": frozenset({"runtime"}),
    "runtime.supervision": frozenset({"runtime", "runtime.state"}),
    "runtime.geo.config": frozenset({"runtime"}),
    "runtime.engines.class_archive": frozenset({"runtime"}),
    "runtime.config": frozenset(
        {
            "runtime",
            "runtime.data",
            "runtime.state",
            "runtime.supervision",
            "runtime.geo.config",
            "runtime.engines.class_archive",
        }
    ),
    "runtime.tls": frozenset({"runtime", "runtime.config"}),
    "runtime.roles": frozenset({"runtime", "runtime.config"}),
    "runtime.runstate": frozenset({"runtime", "runtime.config", "runtime.state"}),
    "runtime.nats": frozenset(
        {
            "runtime",
            "runtime.config",
            "runtime.tls",
            "runtime.roles",
            "runtime.data",
            "runtime.supervision",
        }
    ),
    "runtime.geo": frozenset(
        {
            "runtime",
            "runtime.config",
            "runtime.tls",
            "runtime.data",
            "runtime.nats",
            "runtime.geo.config",
        }
    ),
    "runtime.engines": frozenset(
        {
            "runtime",
            "runtime.config",
            "runtime.tls",
            "runtime.data",
            "runtime.nats",
            "runtime.geo",
            "runtime.engines.class_archive",
        }
    ),
}
RUNTIME = frozenset(RUNTIME_FLOORS)

# floor -> the floors it may import (besides itself). Longest prefix decides a module's floor.
FLOORS: Mapping[str, frozenset[str]] = {
    **RUNTIME_FLOORS,
    "actors": frozenset(),  # the bare package: its floors are the tiers below
    "actors.queue": RUNTIME,
    "actors.collection": RUNTIME | {"actors.queue"},
    "jobs": RUNTIME,
    "actors.access": RUNTIME,
    "cluster": RUNTIME | {"actors.queue", "actors.collection", "jobs", "actors.access"},
}


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def floor_of(module: str) -> str | None:
    best = None
    for floor in FLOORS:
        if (module == floor or module.startswith(floor + ".")) and (
            best is None or len(floor) > len(best)
        ):
            best = floor
    return best


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> Iterator[tuple[int, str, list[str]]]:
    """(line, module, imported names) for every import that runs."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module, [a.name for a in node.names]
        stack.extend(ast.iter_child_nodes(node))


def graph(root: Path = ROOT) -> dict[str, dict[str, int]]:
    """module -> {imported project module: first line}."""
    files = {module_name(p, root): p for pkg in PACKAGES for p in (root / pkg).rglob("*.py")}
    out: dict[str, dict[str, int]] = {}
    for mod, path in sorted(files.items()):
        edges: dict[str, int] = {}
        for line, target, names in _imports(ast.parse(path.read_text(), str(path))):
            if target.split(".")[0] not in PACKAGES:
                continue
            # `from pkg import mod` imports the module pkg.mod when there is one
            hits = [f"{target}.{n}" for n in names if f"{target}.{n}" in files] or [target]
            for hit in hits:
                if hit in files and hit != mod:
                    edges.setdefault(hit, line)
        out[mod] = edges
    return out


def upward(g: Mapping[str, Mapping[str, int]]) -> list[str]:
    errors = []
    for mod, edges in g.items():
        mine = floor_of(mod)
        if mine is None:
            errors.append(f"{mod}: in no floor of tests/layers.py FLOORS")
            continue
        for target, line in edges.items():
            theirs = floor_of(target)
            if theirs != mine and theirs not in FLOORS[mine]:
                errors.append(f"{mod}:{line} imports {target}: {mine} may not import {theirs}")
    return errors


def cycles(g: Mapping[str, Mapping[str, int]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in g:
        if start in index:
            continue
        work = [(start, iter(g[start]))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in g:
                    continue
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(g[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
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
    return found


def check(root: Path = ROOT) -> list[str]:
    g = graph(root)
    return upward(g) + [f"import cycle: {' -> '.join(c)}" for c in cycles(g)]


def main() -> int:
    errors = check()
    for err in errors:
        print(err, file=sys.stderr)
    if not errors:
        print(f"layers: {len(graph())} modules, every import points down, no cycles")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
