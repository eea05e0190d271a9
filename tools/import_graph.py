"""The import structure of ``plainrl/`` from its source (nothing is imported): edges between its
top-level packages and modules, import circles among them, imports that break
docs/architecture.md's "must not import" column, modules over a line count, and lines of code.

    python tools/import_graph.py            # the figures
    python tools/import_graph.py --edges    # and every edge with the modules that make it

A circle is a strongly connected set of top-level units (``rollout``, ``run``, ``types.py``...);
an import inside a function counts like one at the top (it runs when that code runs).
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "plainrl"

# docs/architecture.md, "Folders and what they own": a unit and the units it must not import
# ("anything else in plainrl": every unit but itself; types.py imports nothing of plainrl)
MUST_NOT_IMPORT: dict[str, set[str] | str] = {
    "config": "all", "types": "all", "durable": "all", "intervals": "all", "user_code": "all",
    "data": {"rollout", "train", "run"},
    "models": {"train", "run"},
    "rollout": {"train", "run"},
    "rewards": {"train", "run"},
    "algorithms": {"train", "run", "rollout"},
    "samples": {"train", "run", "rollout"},
    "frames": {"train", "run"},
    "train": {"run"},
    "checkpoint": {"run"},
    "tracking": {"run"},
    "report": {"run", "train", "rollout"},
    "tinker": {"run"},
}


def unit_of(module: str) -> str:
    """``plainrl.rollout.engines.hf`` -> ``rollout``; ``plainrl.types`` -> ``types``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "plainrl"


def module_name(path: Path, pkg: Path = PKG) -> str:
    rel = path.relative_to(pkg.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, pkg: Path = PKG) -> set[str]:
    """The ``plainrl...`` modules a source file imports, relative imports resolved."""
    tree = ast.parse(path.read_text(), str(path))
    me = module_name(path, pkg)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("plainrl"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.startswith("plainrl"):
                found.add(mod)
    return found


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's algorithm: the graph's components of more than one node."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    sys.setrecursionlimit(10_000)
    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def analyse(long_lines: int = 400, pkg: Path = PKG) -> dict:
    """The figures (see the module docstring) as a dict, for the package directory ``pkg``."""
    files = sorted(pkg.rglob("*.py"))
    edges: dict[tuple[str, str], set[str]] = defaultdict(set)
    lines, long_modules = 0, []
    for f in files:
        n = len(f.read_text().splitlines())
        lines += n
        if n > long_lines:
            long_modules.append((n, str(f.relative_to(pkg.parent))))
        src = module_name(f, pkg)
        for mod in imports_of(f, pkg):
            a, b = unit_of(src), unit_of(mod)
            if a != b and b != "plainrl":
                edges[(a, b)].add(f"{src} -> {mod}")
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
    broken = []
    for (a, b), how in sorted(edges.items()):
        rule = MUST_NOT_IMPORT.get(a)
        if rule == "all" or (isinstance(rule, set) and b in rule):
            broken.extend(sorted(how))
    return {"files": len(files), "lines": lines, "edges": edges, "circles": strongly_connected(graph),
            "broken": broken, "long_modules": sorted(long_modules, reverse=True)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--edges", action="store_true", help="print every edge and the imports that make it")
    p.add_argument("--long", type=int, default=400, help="list modules longer than this many lines")
    args = p.parse_args(argv)
    r = analyse(args.long)
    print(f"plainrl/: {r['files']} modules, {r['lines']} lines")
    print(f"import edges between top-level units: {len(r['edges'])}")
    print(f"circles: {len(r['circles'])}" + "".join(f"\n  {' <-> '.join(sorted(c))}" for c in r["circles"]))
    print(f"imports against docs/architecture.md's rules: {len(r['broken'])}"
          + "".join(f"\n  {b}" for b in r["broken"]))
    print(f"modules over {args.long} lines: {len(r['long_modules'])}"
          + "".join(f"\n  {n} {m}" for n, m in r["long_modules"]))
    if args.edges:
        for (a, b), how in sorted(r["edges"].items()):
            print(f"{a} -> {b}: " + ", ".join(sorted(how)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
