"""No function in ``megatron_hsap`` is longer than 80 lines unless its docstring says why (docs/architecture.md,
"Function length"): a paragraph starting ``Length:``. Read with ``ast`` (methods and nested functions included).
``.venv/bin/python -m pytest tests/test_function_length.py -q`` (~1 s).
"""

import ast
import pathlib
from typing import List

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAX_LINES = 80


def long_functions(source: str, path: str, max_lines: int = MAX_LINES) -> List[str]:
    """``path::name (N lines)`` of every function in ``source`` longer than ``max_lines`` whose docstring has no
    paragraph starting ``Length:``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            doc = ast.get_docstring(node) or ""
            if lines > max_lines and not any(p.lstrip().startswith("Length:") for p in doc.split("\n\n")):
                found.append(f"{path}::{node.name} ({lines} lines)")
    return found


def test_the_scan_finds_a_long_function_and_accepts_a_stated_reason():
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_LINES))
    long_one = f"class C:\n    def run(self):\n        '''Runs.'''\n{body.replace('    ', '        ')}"
    assert long_functions(long_one, "m.py") == [f"m.py::run ({MAX_LINES + 2} lines)"]
    reasoned = f"def run():\n    '''Runs.\n\n    Length: one straight-line protocol, read top to bottom.'''\n{body}"
    assert long_functions(reasoned, "m.py") == []
    short = "".join(f"    x{i} = {i}\n" for i in range(MAX_LINES - 1))  # 80 lines with the def
    assert long_functions(f"def run():\n{short}", "m.py") == []


def test_no_function_over_80_lines_without_a_reason():
    files = sorted((ROOT / "megatron_hsap").rglob("*.py"))
    assert len(files) > 60
    found = [entry for path in files for entry in long_functions(path.read_text(), str(path.relative_to(ROOT)))]
    assert not found, f"functions over {MAX_LINES} lines without a 'Length:' paragraph in the docstring: {found}"
