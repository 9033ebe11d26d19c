"""The house's shape: no import circles, runtime's folders import only lower layers, schema/ never imports
torch or the runtime, few loose modules, and every folder says what lives there."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
RUNTIME = SRC / "arealcli" / "runtime"
# runtime/__init__.py's table: a package imports (anywhere in its code) only packages of lower layers
LAYERS = {
    "wire": 0, "tools": 0, "vision": 0,
    "algo": 1, "models": 1, "data": 1, "rewards": 1, "console": 1, "optim": 1, "registry": 1,
    "generation": 2, "distributed": 2,
    "engines": 3,
    "clients": 4, "eval": 4,
    "backends": 5, "agents": 5, "interfaces": 5,
    "run": 6, "serve": 6,
    "launchers": 7, "evaluate": 7,
}  # fmt: skip


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in SRC.rglob("*.py")}


def imports(path: Path, module_level: bool = True) -> set[str]:
    """The arealcli modules `path` imports (at module level, or anywhere)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if module_level else list(ast.walk(tree))
    out: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("arealcli"):
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                out.add(name if name in MODULES else node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("arealcli")}
    return out


def test_no_import_circles():
    """None at any level: an import inside a function (kept lazy for the start-up time of `areal
    --help` and the torch-free `areal check`) still ties its module to the one it imports."""
    graph = {m: imports(p, module_level=False) & set(MODULES) for m, p in MODULES.items()}
    state: dict[str, int] = {}  # 1 on the path, 2 done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            assert state.get(n) != 1, "import circle: " + " -> ".join(path[path.index(n) :] + [n])
            if n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_runtime_folders_import_only_lower_layers():
    up = []
    for m, p in MODULES.items():
        parts = m.split(".")
        if parts[:2] != ["arealcli", "runtime"] or len(parts) < 3:
            continue
        mine = LAYERS[parts[2].removesuffix(".py")]
        for n in imports(p, module_level=False):  # function-level imports too
            target = n.split(".")
            if target[:2] == ["arealcli", "runtime"] and len(target) > 2 and target[2] != parts[2]:
                if LAYERS[target[2]] >= mine:
                    up.append(f"{m} imports {n}")
    assert not up, "\n".join(up)


def test_schema_imports_neither_torch_nor_the_runtime():
    for m, p in MODULES.items():
        if m.startswith("arealcli.schema"):
            text = p.read_text()
            assert "arealcli.runtime" not in {".".join(n.split(".")[:2]) for n in imports(p, False)}, m
            assert "import torch" not in text, m


def test_few_loose_modules_and_every_folder_says_what_lives_there():
    loose = [p.name for p in RUNTIME.glob("*.py") if p.name != "__init__.py"]
    assert len(loose) <= 8, loose
    assert {p.stem for p in RUNTIME.glob("*.py")} - {"__init__"} <= set(LAYERS)
    assert {p.name for p in RUNTIME.iterdir() if p.is_dir() and p.name != "__pycache__"} <= set(LAYERS)
    for init in SRC.rglob("__init__.py"):
        assert ast.get_docstring(ast.parse(init.read_text())), f"{init} has no docstring"


def test_commands_only_parse_call_and_print():
    """Every `commands/*.py` parses, calls one function of the runtime and prints: each file under 200
    lines, its longest function (a typer command's parameter list included) under 60."""
    commands = sorted((SRC / "arealcli" / "commands").glob("*.py"))
    long_files = [f"{p.name}: {n} lines" for p in commands if (n := len(p.read_text().splitlines())) >= 200]
    assert not long_files, long_files
    long_functions = [
        f"{p.name}: {node.name} is {node.end_lineno - node.lineno + 1} lines"
        for p in commands
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 >= 60
    ]
    assert not long_functions, long_functions


def test_every_folder_says_its_layer_as_the_table_has_it():
    """Each runtime folder's docstring names its layer (`Layer N of runtime/__init__.py's table`), and
    the number is the one the layer check above enforces."""
    import re

    for folder in sorted(p for p in RUNTIME.iterdir() if (p / "__init__.py").exists()):
        doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
        said = re.findall(r"\bLayer (\d+)\b", doc)
        assert said == [str(LAYERS[folder.name])], (
            f"{folder.name}: says layer {said}, the table {LAYERS[folder.name]}"
        )
