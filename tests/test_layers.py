"""The house's shape, checked on the source: imports point one way (command line on top, then
extraction, then the warehouse, then the shared ground), no module imports itself back through
another, no module imports another's private name, and no source file grows past a reading."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
# Lowest first: a package may import only itself and the packages before it.
LAYERS = ("common", "warehouse", "extract", "isotropy_warehouse")
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    out = {}
    for top in LAYERS:
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The project module a dotted import name lands in (a name imported from a module: that module)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _edges(mod: str, path: Path) -> list[tuple[str, str, int]]:
    """(imported module, name imported from it or '', line) for every project import anywhere in the file,
    including imports inside functions."""
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _resolve(a.name):
                    out.append((_resolve(a.name), "", node.lineno))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                if full in MODULES:  # `from package import module`
                    out.append((full, "", node.lineno))
                elif _resolve(base):
                    out.append((_resolve(base), a.name, node.lineno))
    return out


def _layer(mod: str) -> int:
    return LAYERS.index(mod.split(".")[0])


def test_imports_point_down_only():
    wrong = []
    for mod, path in MODULES.items():
        for target, _, line in _edges(mod, path):
            if _layer(target) > _layer(mod):
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target} (a layer above)")
    assert not wrong, "\n".join(wrong)


def _module_aliases(mod: str, path: Path) -> dict[str, str]:
    """Local names bound to project modules: `import a.b as m`, `from a import b` (a module), `from . import b`."""
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname and a.name in MODULES:
                    out[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for a in node.names:
                if f"{base}.{a.name}" in MODULES:
                    out[a.asname or a.name] = f"{base}.{a.name}"
    return out


def test_no_module_imports_a_private_name_of_another():
    wrong = []
    for mod, path in MODULES.items():
        for target, name, line in _edges(mod, path):
            if name.startswith("_") and not name.startswith("__") and target != mod:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target}.{name}")
        aliases = {k: v for k, v in _module_aliases(mod, path).items() if v != mod}
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    assert not wrong, "\n".join(wrong)


def test_the_import_graph_has_no_circle():
    graph = {m: {t for t, _, _ in _edges(m, p) if t != m} for m, p in MODULES.items()}
    # A package's __init__ re-exporting its own modules is not a circle back to it.
    for m in graph:
        graph[m] = {t for t in graph[m] if not (m.startswith(t + ".") and MODULES[t].name == "__init__.py")}
    state, stack, cycles = {}, [], []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "\n".join(cycles)


# Every Python file of the checkout: the library, the tests, the benchmarks, the entry point.
SOURCES = sorted({*MODULES.values(), *(ROOT / "tests").glob("*.py"), *(ROOT / "bench").glob("*.py"), ROOT / "cli.py"})


def test_no_source_file_is_past_a_reading():
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in SOURCES if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not long, "\n".join(long)


def test_no_test_imports_a_private_name_of_another_module():
    """(Tests may reach into a module's internals through its attributes — to patch them, say — but
    what several test files share is a public helper.)"""
    wrong = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module != "__future__":
                wrong += [f"{path.relative_to(ROOT)}:{node.lineno} imports {node.module}.{a.name}"
                          for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    assert not wrong, "\n".join(wrong)


def test_every_module_says_what_it_is_for():
    bare = [str(p.relative_to(ROOT)) for p in MODULES.values()
            if p.read_text().strip() and not ast.get_docstring(ast.parse(p.read_text()))]
    assert not bare, bare


def test_every_package_is_in_the_wheel():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {m for m, p in MODULES.items() if p.name == "__init__.py"}
    assert packages <= listed, sorted(packages - listed)


def test_the_measures_do_no_io():
    src = (ROOT / "warehouse" / "measures.py").read_text()
    assert not any(w in src for w in ("open(", "pyarrow", "duckdb", "Path(")), "measures.py does I/O"
