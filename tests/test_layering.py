"""The context-parallel library imports nothing from the training framework (docs/architecture.md, "Layering").

The library is ``megatron_hsap`` minus ``megatron_hsap/training/``; the framework is ``megatron_hsap.training``
(``pretrain_gpt_hsap.py``'s modules, the Megatron-LM and Megatron-Bridge entry points). Two checks: every import
statement of every library module, at any depth (function-level imports included, relative imports resolved,
``importlib.import_module("...")`` with a literal name too), read with ``ast``; and importing every library
module in a fresh interpreter leaves no ``megatron_hsap.training`` module in ``sys.modules``.
``.venv/bin/python -m pytest tests/test_layering.py -q`` (~15 s).
"""

import ast
import pathlib
import subprocess
import sys
import textwrap
from typing import List, Tuple

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megatron_hsap"
FRAMEWORK = "megatron_hsap.training"


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def library_files() -> List[pathlib.Path]:
    """Every module of the package outside ``megatron_hsap/training/``."""
    return sorted(p for p in PACKAGE.rglob("*.py") if "training" not in p.relative_to(PACKAGE).parts[:-1])


def imported_names(source: str, module: str, is_package: bool) -> List[Tuple[int, str]]:
    """(line, absolute module name) of every import in ``source`` (the module ``module``), at any depth."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolved against the importing module's package
                package = module.split(".") if is_package else module.split(".")[:-1]
                base = package[:len(package) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((node.lineno, name))
            found += [(node.lineno, f"{name}.{alias.name}") for alias in node.names]  # from pkg import submodule
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and (getattr(node.func, "attr", None) == "import_module" or getattr(node.func, "id", None)
                   in ("import_module", "__import__"))):
            found.append((node.lineno, node.args[0].value))
    return found


def framework_imports(source: str, module: str, is_package: bool = False) -> List[str]:
    return [f"line {line}: {name}" for line, name in imported_names(source, module, is_package)
            if name == FRAMEWORK or name.startswith(FRAMEWORK + ".")]


def test_the_library_is_the_package_minus_training():
    names = {module_name(p) for p in library_files()}
    assert {"megatron_hsap", "megatron_hsap.attention.ring", "megatron_hsap.megatron.cpu_shim",
            "megatron_hsap.configurator", "megatron_hsap.sequence.plan"} <= names
    assert not any(n.startswith(FRAMEWORK) for n in names)
    assert len(names) >= 40
    assert (PACKAGE / "training" / "megatron_lm.py").exists() and (PACKAGE / "training" / "bridge.py").exists()


@pytest.mark.parametrize("source, module, is_package", [
    ("from megatron_hsap.training.loop import forward_packed", "megatron_hsap.functional", False),
    ("import megatron_hsap.training.arguments as a", "megatron_hsap.config", False),
    ("from megatron_hsap import training", "megatron_hsap.config", False),
    ("def f():\n    if True:\n        from megatron_hsap.training import packing", "megatron_hsap.config", False),
    ("from .training import loop", "megatron_hsap.config", False),
    ("from ..training.bridge import forward_step", "megatron_hsap.megatron.spec", False),
    ("from . import bridge", "megatron_hsap.training", True),
    ("import importlib\nimportlib.import_module('megatron_hsap.training.loop')", "megatron_hsap.config", False),
])
def test_the_scan_sees_every_form_of_import(source, module, is_package):
    assert framework_imports(source, module, is_package), source


@pytest.mark.parametrize("source, module", [
    ("from megatron_hsap.sequence.plan import plan_batch", "megatron_hsap.functional"),
    ("from ..sequence import plan", "megatron_hsap.megatron.spec"),
    ("from megatron.training import get_args", "megatron_hsap.megatron.cpu_shim"),  # Megatron-LM's, not ours
    ("import megatron_hsap.trainingx", "megatron_hsap.config"),
])
def test_the_scan_leaves_other_imports_alone(source, module):
    assert framework_imports(source, module) == []


def test_no_library_module_imports_the_framework():
    offenders = {}
    for path in library_files():
        found = framework_imports(path.read_text(), module_name(path), path.name == "__init__.py")
        if found:
            offenders[str(path.relative_to(ROOT))] = found
    assert not offenders, f"library modules import the training framework: {offenders}"


def test_importing_the_library_loads_no_framework_module():
    """Every library module imported in a fresh interpreter (optional GPU packages may be absent: the modules
    that need them import them on use). Catches imports the static scan cannot see (built names)."""
    modules = [module_name(p) for p in library_files()]
    script = textwrap.dedent(f"""
        import importlib, sys
        for name in {modules!r}:
            importlib.import_module(name)
        loaded = sorted(m for m in sys.modules if m == {FRAMEWORK!r} or m.startswith({FRAMEWORK + "."!r}))
        print("imported", len({modules!r}), "loaded framework:", loaded)
        sys.exit(1 if loaded else 0)
    """)
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"imported {len(modules)} loaded framework: []" in run.stdout
