"""The package's shape, as docs/architecture.md states it: dependencies point one way (no import
cycle, not even through a function-level or type-checking import), and `paratrain --help` and
config errors answer without importing torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "src" / "paratrain"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every paratrain module this file imports, anywhere in it (top level, functions,
    TYPE_CHECKING blocks)."""
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("paratrain")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("paratrain"):
                continue
            for a in node.names:  # `from . import x` names a module when x is one
                sub = f"{mod}.{a.name}"
                out.add(sub if (PKG.parent / Path(*sub.split("."))).with_suffix(".py").exists()
                        or (PKG.parent / Path(*sub.split(".")) / "__init__.py").exists() else mod)
    return out - {me}


def _graph() -> dict[str, set[str]]:
    files = sorted(PKG.rglob("*.py"))
    names = {_module_name(f) for f in files}
    return {_module_name(f): {m for m in _imports(f) if m in names} for f in files}


def test_no_import_cycles():
    graph = _graph()
    # a package's __init__ re-exporting its own modules is not a dependency of those modules
    for pkg in [m for m in graph if (PKG.parent / Path(*m.split(".")) / "__init__.py").exists()]:
        graph[pkg] = {m for m in graph[pkg] if not m.startswith(pkg + ".")}
    seen: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        seen[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if seen.get(d) == 1:
                cycle = stack[stack.index(d):] + [d]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if d not in seen:
                visit(d)
        stack.pop()
        seen[m] = 2

    for m in sorted(graph):
        if m not in seen:
            visit(m)


def _imports_torch(*args: str) -> tuple[bool, str]:
    code = ("import sys\nfrom paratrain.cli import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')")
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                       timeout=60)
    return "NO-TORCH" not in r.stdout, r.stdout + r.stderr


def test_help_config_show_and_config_errors_do_not_import_torch():
    for args in (["--help"], ["train", "--help"], ["config", "show"],
                 ["train", "trainer.max_steps=-1"], ["config", "show", "no.such=1"]):
        torch_loaded, out = _imports_torch(*args)
        assert not torch_loaded, (args, out[-2000:])


# The layers of docs/architecture.md, top to bottom, one unit (a package or a module) each: a
# module may import its own unit and the layers below it, never a layer above. `paratrain` is the
# package's own __init__ (its public names, imported lazily); config/ is the configuration tree,
# its checks, the model folder reader, the presets and the task table, all torch-free.
LAYERS = [
    "paratrain",
    "paratrain.cli_docs",  # the docs site's Command line page, made from cli's parser
    "paratrain.__main__",
    "paratrain.cli",
    "paratrain.tools",
    "paratrain.trainer",
    "paratrain.runtime",
    "paratrain.checkpoint",
    "paratrain.runplan",
    "paratrain.tasks",
    "paratrain.parallel",
    "paratrain.launch",
    "paratrain.records",
    "paratrain.models",
    "paratrain.data",
    "paratrain.config",
    "paratrain.dist",
    "paratrain.fileio",
    "paratrain.formatting",
    "paratrain.redact",
    "paratrain.errors",
]


def _place(module: str) -> int:
    """The layer a module belongs to: its unit's (the package's own __init__ is `paratrain`)."""
    for i, unit in enumerate(LAYERS):
        if module == unit or unit != "paratrain" and module.startswith(unit + "."):
            return i
    raise AssertionError(f"{module} is in no layer of LAYERS: add it there and to the map")


def test_packages_import_only_the_layers_below_them():
    wrong = []
    for module, deps in sorted(_graph().items()):
        layer = _place(module)
        for dep in sorted(deps):
            if _place(dep) < layer:
                wrong.append(f"{module} ({LAYERS[layer]}) imports {dep} "
                             f"({LAYERS[_place(dep)]}, a layer above)")
    assert not wrong, "imports that point up:\n" + "\n".join(wrong)


def test_the_task_is_decided_in_one_place():
    """`registry.for_config` (which task a config trains) is called by TrainConfig.task_spec:
    everything else reads the config's decision."""
    callers = set()
    for f in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call) and (
                    getattr(node.func, "attr", None) == "for_config"
                    or getattr(node.func, "id", None) == "for_config"):
                callers.add(_module_name(f))
    assert callers == {"paratrain.config.tree"}, callers


def _names_in(node: ast.AST) -> set[str]:
    """Every name and attribute an expression reads (`cfg.task_spec.load()`: cfg, task_spec,
    load)."""
    return {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node)
            if isinstance(n, (ast.Name, ast.Attribute))}


def test_no_task_is_asked_what_it_has_outside_its_base_class():
    """The loop, validation, the plans and the launcher read the Task contract (tasks/base.py:
    every seam with a default), never `getattr` / `hasattr` on a task."""
    asked = []
    for f in sorted(PKG.rglob("*.py")):
        if f == PKG / "tasks" / "base.py":
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in (
                    "getattr", "hasattr") and node.args and any(
                    "task" in name.lower() for name in _names_in(node.args[0])):
                asked.append(f"{f.relative_to(PKG.parent)}:{node.lineno} "
                             f"{ast.unparse(node)}")
    assert not asked, "a task asked what it has (declare it on tasks/base.Task):\n" + \
        "\n".join(asked)
