"""The project's modules import each other without cycles, and the fast path keeps its layers.

Every Python module of the project (the packages pyproject.toml maps, `modeling_gpn` with its subpackages,
`configuration/`, `conversion/` and `eval/` installed as `modeling_gpn.*`, and the `benchmarks/` scripts)
is read with `ast` (nothing is imported), and every import in it becomes an edge: imports inside function
bodies included, relative imports resolved, `from package import submodule` taken to the submodule, and
`importlib.import_module("...")` of a project module named by a string literal (the `gpn` command's table of
subcommands). A cycle in that graph fails, named module by module.

The fast path's layers (see `modeling_gpn/recurrence_step.py`): the reference step at the bottom imports no
project module; each backend imports only what lies below it (the reference step; Triton's kernels file its
jitted kernels), never another backend or the dispatcher; the model imports the dispatcher and the chunked
loss, no backend.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

from ..environment import REPO_ROOT

PACKAGE = "modeling_gpn"
STEP = f"{PACKAGE}.recurrence_step"
BACKENDS = {  # backend -> what it may import from the project
    f"{PACKAGE}.memory_kernels": {STEP},
    f"{PACKAGE}.triton_kernels": {STEP, f"{PACKAGE}.triton_jit"},
    f"{PACKAGE}.triton_jit": set(),
    f"{PACKAGE}.cuda_graphs": {STEP},
}
DISPATCHER = f"{PACKAGE}.fast_recurrence"
MODEL = f"{PACKAGE}.modeling_gpn"


def project_modules(root: Path) -> dict[str, Path]:
    """Module name -> file, for every .py file of the packages pyproject.toml maps (subpackages included:
    a folder below a mapped one is a subpackage of it) and of benchmarks/ (as `benchmarks.NAME`)."""
    settings = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dirs = dict(settings.get("package-dir", {}))
    listed = settings.get("packages", [])
    for package in [PACKAGE, *(listed if isinstance(listed, list) else [])]:  # (not a list: find-packages)
        package_dirs.setdefault(package, package.replace(".", "/"))
    package_dirs["benchmarks"] = "benchmarks"
    # a folder mapped to a package of its own is that package, not a subpackage of an enclosing mapped folder
    owner_of = {(root / folder).resolve(): package for package, folder in package_dirs.items()}
    modules: dict[str, Path] = {}
    for package, folder in package_dirs.items():
        base = (root / folder).resolve()
        for path in sorted(base.rglob("*.py")):
            if any(part.startswith(".") or part == "__pycache__" for part in path.relative_to(base).parts):
                continue
            nearest = next(p for p in [path.parent, *path.parent.parents] if p in owner_of)
            if owner_of[nearest] != package:  # inside a folder another package maps
                continue
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def _resolve_relative(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute name of `from <level dots><target> import ...` written in `module`."""
    base = module.split(".")
    if not is_package:
        base = base[:-1]  # a module's level 1 is its package; a package's __init__'s level 1 is itself
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `module` (at `path`) imports anywhere in its file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def add(name: str) -> None:
        if name in modules:
            found.add(name)

    dynamic = False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            source = node.module if node.level == 0 else _resolve_relative(module, is_package, node.level, node.module)
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in modules:
                    found.add(submodule)
                else:
                    add(source)
        elif (
            isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
        ):
            dynamic = True
    if dynamic:  # a module that imports by name: every project module it names in a string literal
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                add(node.value)
    found.discard(module)
    return found


def import_graph(root: Path = REPO_ROOT) -> dict[str, set[str]]:
    modules = project_modules(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def components(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm): the modules that
    import each other, directly or around a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:  # (recursive: the graph is a few dozen modules)
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a closed list of modules) through each component of `components`: the shortest path
    inside it from its first module back to that module."""
    found = []
    for component in components(graph):
        members, start = set(component), component[0]
        paths, seen = [[start]], {start}
        while paths:  # breadth first: the shortest cycle through `start` within the component
            path = paths.pop(0)
            targets = sorted(graph[path[-1]] & members)
            if start in targets:
                found.append([*path, start])
                break
            for target in targets:
                if target not in seen:
                    seen.add(target)
                    paths.append([*path, target])
    return found


def test_the_project_has_no_import_cycle():
    graph = import_graph()
    assert {DISPATCHER, MODEL, f"{PACKAGE}.train", f"{PACKAGE}.evaluation.cli", "benchmarks.gpu_check"} <= graph.keys()
    assert DISPATCHER in graph[MODEL] and f"{PACKAGE}.train" in graph["gpn_cli"]  # (imports are seen at all)
    found = [
        f"{' -> '.join(cycle)} (modules in this cycle: {', '.join(component)})"
        for cycle, component in zip(cycles(graph), components(graph))
    ]
    assert not found, "import cycles: " + "; ".join(found)


def test_the_fast_path_keeps_its_layers():
    graph = import_graph()
    assert not graph[STEP], f"the reference step imports {sorted(graph[STEP])}: it must import no project module"
    for backend, allowed in BACKENDS.items():
        extra = graph[backend] - allowed
        assert not extra, f"{backend} imports {sorted(extra)}: a backend imports only the layers below it"
    assert graph[f"{PACKAGE}.chunked_loss"] == set()
    fast_path = {STEP, DISPATCHER, f"{PACKAGE}.chunked_loss", *BACKENDS}
    assert graph[MODEL] & fast_path == {DISPATCHER, f"{PACKAGE}.chunked_loss"}, sorted(graph[MODEL] & fast_path)


def test_the_walk_finds_cycles_through_deferred_and_relative_imports(tmp_path):
    """The checker itself, on a made-up project: a cycle closed by an import inside a function and a
    relative `from . import` of a subpackage's module is found and named; the same project without it passes."""
    (tmp_path / "pyproject.toml").write_text('[tool.setuptools]\npackages = ["pkg", "pkg.sub"]\n')
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("from .a import f\n")
    (tmp_path / "pkg" / "a.py").write_text("from .sub import b\n\ndef f():\n    return b\n")
    (tmp_path / "pkg" / "sub" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "sub" / "b.py").write_text("def g():\n    from ..sub import c\n    return c\n")
    (tmp_path / "pkg" / "sub" / "c.py").write_text("import os\n\ndef h():\n    from pkg import a\n    return a\n")
    graph = import_graph(tmp_path)
    assert graph["pkg"] == {"pkg.a"} and graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.sub.c"}
    assert cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.sub.c", "pkg.a"]]
    (tmp_path / "pkg" / "sub" / "c.py").write_text("import os\n")
    assert cycles(import_graph(tmp_path)) == []


@pytest.mark.parametrize("name", ["recurrence_step.py", "chunked_loss.py", "derived_weights.py"])
def test_the_new_fast_path_modules_ship_with_the_model(name):
    """The remote code (`save_pretrained`'s copies, the Hub upload) is the model file and every file it
    imports relatively, transitively: the new layers are among them."""
    from transformers.dynamic_module_utils import get_relative_import_files

    import modeling_gpn.modeling_gpn as modeling

    shipped = {Path(f).name for f in get_relative_import_files(modeling.__file__)}
    assert name in shipped, sorted(shipped)


def test_the_top_of_the_package_holds_exactly_the_remote_code():
    """issue 19: the top level of `modeling_gpn/` is what ships to the Hub (the modeling file and every file
    it imports relatively, as transformers' loader collects them) plus the package's `__init__.py`; every
    tool lives in a subpackage, and every documented entry point still imports from there."""
    import importlib

    from transformers.dynamic_module_utils import get_relative_import_files

    import modeling_gpn.modeling_gpn as modeling

    package = Path(modeling.__file__).parent
    shipped = {Path(f).name for f in get_relative_import_files(modeling.__file__)} | {"modeling_gpn.py"}
    top = {f.name for f in package.glob("*.py")} - {"__init__.py"}
    assert top == shipped, (
        f"not shipped, so not at the top: {sorted(top - shipped)}; shipped but missing: {sorted(shipped - top)}"
    )
    for tool in (
        "cli",
        "cli.generate",
        "train",
        "data",
        "study",
        "inspect",
        "analysis",
        "hub",
        "hub.model_card",
        "bench",
    ):
        module = importlib.import_module(f"modeling_gpn.{tool}")
        assert Path(module.__file__).parent != package, f"modeling_gpn.{tool} is a module at the top of the package"
    assert importlib.util.find_spec("modeling_gpn.train.__main__") is not None  # python -m modeling_gpn.train
