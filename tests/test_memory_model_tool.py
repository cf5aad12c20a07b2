"""tools/memory_model.py as a user reads it: a peak over the device is flagged, the plot is written.

``.venv/bin/python -m pytest tests/test_memory_model_tool.py -q`` (~10 s).
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import List

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args: str) -> str:
    env = dict(os.environ, PYTHONPATH=_ROOT)
    return subprocess.run([sys.executable, os.path.join(_ROOT, "tools", "memory_model.py"), *args], env=env,
                          check=True, capture_output=True, text=True).stdout


def _rows(text: str) -> List[List[str]]:
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[1:]]


def test_a_peak_over_the_device_is_flagged_with_the_excess() -> None:
    out = _run("--preset", "llama3-8b", "--cp", "8", "--device-gib", "80", "--tokens", "700000",
               "--method", "upipe")
    (row,) = _rows(out)
    peak, fits = float(row[-3]), row[-2]
    assert peak > 80 and fits == f"NO (+{peak - 80:.2f})", row
    out = _run("--preset", "llama3-8b", "--cp", "8", "--device-gib", "200", "--tokens", "700000", "--method", "upipe")
    (row,) = _rows(out)
    assert float(row[-3]) < 200 and row[-2] == "yes", row


def test_longest_context_rows_fit_and_the_plot_is_written(tmp_path) -> None:
    png = tmp_path / "peak.png"
    out = _run("--preset", "llama3-8b", "--cp", "8", "--device-gib", "80", "--plot", str(png))
    rows = _rows(out)
    assert [r[0] for r in rows] == ["ulysses", "ring", "hybrid", "upipe"]
    assert all(float(r[-3]) <= 80 and r[-2] == "yes" for r in rows)
    assert png.stat().st_size > 10_000
