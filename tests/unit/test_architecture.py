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


# The layers of docs/architecture.md, top to bottom: a module may import its own package and the
# layers below its own, never a layer above or a sibling package of the same layer (the top and
# bottom layers are loose modules, which may import each other; the cycle test covers them).
# Two tables with no dependencies of their own sit at the bottom beside config, which reads
# them: models.presets (model sizes) and tasks.registry (task names).
LAYERS = [
    ("paratrain.cli_docs",),  # the docs site's Command line page, made from cli's parser
    ("paratrain.cli", "paratrain.__main__"),
    ("paratrain.tools",),
    ("paratrain.trainer",),
    ("paratrain.runtime",),
    ("paratrain.checkpoint",),
    ("paratrain.runplan",),
    ("paratrain.tasks",),
    ("paratrain.parallel",),
    ("paratrain.launch",),
    ("paratrain.records",),
    ("paratrain.models",),
    ("paratrain.data",),
    ("paratrain.config", "paratrain.config_docs", "paratrain.config_checks", "paratrain.finetune_checks",
     "paratrain.models.presets",
     "paratrain.tasks.registry", "paratrain.dist", "paratrain.errors", "paratrain.fileio",
     "paratrain.formatting", "paratrain.redact", "paratrain.model_folder", "paratrain"),
]


def _place(module: str) -> tuple[int, str]:
    """(layer index, the unit it belongs to): the longest prefix named in LAYERS."""
    best = None
    for i, units in enumerate(LAYERS):
        for unit in units:
            if (module == unit or module.startswith(unit + ".")) and \
                    (best is None or len(unit) > len(best[1])):
                best = (i, unit)
    assert best is not None, f"{module} is in no layer of LAYERS: add it there and to the map"
    return best


def test_packages_import_only_the_layers_below_them():
    wrong = []
    for module, deps in sorted(_graph().items()):
        layer, unit = _place(module)
        for dep in sorted(deps):
            dep_layer, dep_unit = _place(dep)
            loose = len(LAYERS[layer]) > 1  # a layer of single modules, not one package
            if dep_unit != unit and (dep_layer < layer or dep_layer == layer and not loose):
                wrong.append(f"{module} (layer {layer}: {unit}) imports {dep} "
                             f"(layer {dep_layer}: {dep_unit})")
    assert not wrong, "imports that point up or sideways:\n" + "\n".join(wrong)
