"""Print the package import graph of moestream (with its cycles) and the function-size table.

    python scripts/code_map.py [--root moestream] [--top-level-only]

Packages are the first level under moestream/ (`store`, `experts`, ...; top-level modules such as
`runtime.py` count as their own node). An edge A -> B means a module of A imports one of B; by
default imports inside functions count too (a lazy import is still a dependency)."""

from __future__ import annotations

import argparse
import ast
import statistics
import sys
from pathlib import Path


def node_of(module: str) -> str:
    """moestream.store.io -> store; moestream.runtime -> runtime."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def modules(root: Path):
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).with_suffix("")
        name = ".".join(p for p in rel.parts if p != "__init__")
        yield name, ast.parse(path.read_text(), str(path))


def imports(tree: ast.Module, top_level_only: bool):
    nodes = tree.body if top_level_only else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names)


def graph(root: Path, top_level_only: bool = False) -> dict[str, set[str]]:
    pkg = root.name
    g: dict[str, set[str]] = {}
    for name, tree in modules(root):
        src = node_of(name)
        g.setdefault(src, set())
        for mod in imports(tree, top_level_only):
            if mod.split(".")[0] == pkg and node_of(mod) != src and mod != pkg:
                g[src].add(node_of(mod))
    return g


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def function_sizes(root: Path) -> list[tuple[int, str]]:
    sizes = []
    for name, tree in modules(root):
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                sizes.append((node.end_lineno - node.lineno + 1, f"{name}.{node.name}"))
    return sorted(sizes)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", default=str(Path(__file__).resolve().parent.parent / "moestream"))
    p.add_argument("--top-level-only", action="store_true", help="ignore imports in functions")
    a = p.parse_args(argv)
    root = Path(a.root)
    g = graph(root, a.top_level_only)
    for src in sorted(g):
        print(f"{src:>10} -> {', '.join(sorted(g[src])) or '-'}")
    cyc = cycles(g)
    print("cycles:", "; ".join(" <-> ".join(c) for c in cyc) if cyc else "none")
    sizes = function_sizes(root)
    lines = [s for s, _ in sizes]
    p90 = lines[int(0.9 * (len(lines) - 1))]
    print(
        f"functions: {len(lines)}, median {statistics.median(lines):.0f} lines, p90 {p90}, "
        f"max {lines[-1]} ({sizes[-1][1]})"
    )
    return 1 if cyc else 0


if __name__ == "__main__":
    sys.exit(main())
