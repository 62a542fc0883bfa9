"""The layers that must not reach up, checked on the code: every import stays
on its floor or below (README's Layout), no import circle, the plan needs no
compiled code, storage and network never import Sandbox, the plan never
imports network.py, the store never imports the registry client (lazy
imports inside functions included)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import nsbox

PACKAGE = Path(nsbox.__file__).parent  # the checkout's, or the staged install's (tests/run.sh)


def imported(path: Path) -> list[tuple[str, str | None]]:
    """Every import of `path`, at any depth of its code, made absolute:
    (module, name) for `from module import name`, (module, None) for
    `import module`."""
    package = ".".join(("nsbox", *path.relative_to(PACKAGE).parent.parts))
    found: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found += [(base, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(a.name, None) for a in node.names]
    return found


def imports(path: Path) -> set[str]:
    """Every nsbox module `path` imports, and every name it imports from one."""
    pairs = imported(path)
    found = {m for m, _ in pairs} | {f"{m}.{n}" for m, n in pairs if n is not None}
    return {m for m in found if m.startswith("nsbox")}


@pytest.mark.parametrize("modules, forbidden", [
    ("storage/*.py", "nsbox.sandbox"),
    ("network.py", "nsbox.sandbox"),
    ("plan/*.py", "nsbox.network"),
    ("storage/store.py", "nsbox.storage.registry"),
])
def test_no_import_reaches_up(modules: str, forbidden: str) -> None:
    paths = sorted(PACKAGE.glob(modules))
    assert paths
    bad = {p.name: sorted(m for m in imports(p) if m == forbidden or m.startswith(forbidden + "."))
           for p in paths}
    assert {name: ms for name, ms in bad.items() if ms} == {}


# The floors of the package, bottom first (README's Layout): a module may
# import from its own floor and below, never above. The package face
# (nsbox/__init__.py) loads Sandbox lazily and is the one exception.
FLOORS = [
    ["errors", "_native", "_text", "_build_ffi"],
    ["host", "init"],
    ["net"],
    ["spec"],
    ["plan"],
    ["create"],
    ["manage", "network"],
    ["sandbox", "storage"],
    ["compose", "dockerfile"],
    ["cli", "inspect"],
    ["inspect_provider", "__main__"],
]
FLOOR = {name: i for i, names in enumerate(FLOORS) for name in names}
# Deeper rules than the floors: the plan is pure data (no C extension, no
# zygote), so a plan is built and tested without the compiled side.
NEVER = [("plan", "_native"), ("plan", "create")]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(("nsbox", *(parts[:-1] if parts[-1] == "__init__" else parts)))


def graph() -> dict[str, set[str]]:
    """module -> the nsbox modules it imports (a name imported from a
    package counts as its module where it is one, else as the package)."""
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    edges = {}
    for name, path in paths.items():
        if name == "nsbox":
            continue
        found = {f"{m}.{n}" if f"{m}.{n}" in paths else m for m, n in imported(path)}
        edges[name] = {m for m in found if m.startswith("nsbox.")} - {name}
    return edges


def floor_of(module: str) -> int:
    top = module.split(".")[1]
    assert top in FLOOR, f"{module}: a module of no floor: add it to FLOORS (and to README's Layout)"
    return FLOOR[top]


def test_every_import_stays_on_its_floor_or_below() -> None:
    upward = sorted(f"{m} -> {t}" for m, ts in graph().items() for t in ts if floor_of(t) > floor_of(m))
    assert upward == []


def test_the_plan_needs_no_compiled_code() -> None:
    bad = sorted(f"{m} -> {t}" for m, ts in graph().items() for t in ts for a, b in NEVER
                 if m.split(".")[1] == a and t.split(".")[1] == b)
    assert bad == []


def test_no_import_circle() -> None:
    edges = graph()
    # Tarjan's strongly connected components: any with two modules is a circle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in edges:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert circles == []


def test_at_most_twelve_modules_at_the_top() -> None:
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 12, top
