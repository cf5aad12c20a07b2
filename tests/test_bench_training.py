"""tools/bench_training.py: a shrunk run prints (and writes) the table with the loss matching CP 1, and the
loss check rejects a configuration that drifts beyond fp32 round-off."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "bench_training.py")


def _tool():
    spec = importlib.util.spec_from_file_location("bench_training_tool", TOOL)
    tool = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = tool  # dataclasses look their module up by name
    spec.loader.exec_module(tool)
    return tool


def test_shrunk_benchmark_prints_and_writes_the_table(tmp_path):
    tool = _tool()
    doc = tmp_path / "bench.md"
    doc.write_text(f"# t\n\nbefore\n\n{tool.MARK_BEGIN}\nold table\n{tool.MARK_END}\n\nafter\n")
    env = dict(os.environ, PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, TOOL, "--shapes", "4:2:256:1", "--configs", "hsap (sequence-aware)",
                           "--iters", "2", "--data-cache-path", str(tmp_path / "cache"), "--markdown", str(doc)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("|")]
    assert lines[0] == tool.HEADER and set(lines[1]) <= set("|-")
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]
    assert [row[:2] for row in rows] == [["CP 4 (2 nodes x 2), 1 x 256", "CP 1"],
                                         ["CP 4 (2 nodes x 2), 1 x 256", "hsap (sequence-aware)"]]
    assert all(len(row) == tool.HEADER.count("|") - 1 for row in rows)
    cp1, hsap = rows
    assert float(cp1[5]) == 0.0 and float(hsap[5]) > 0.0  # inter-node MB: CP 1 sends nothing, 2 nodes do
    assert 0.0 < float(hsap[8]) <= 1.0  # plan inter-node bytes x zigzag
    assert float(cp1[9]) == 0.0 and float(hsap[9]) <= tool.LOSS_RTOL
    text = doc.read_text()
    assert text.startswith("# t\n\nbefore\n\n") and text.endswith("\n\nafter\n") and "old table" not in text
    assert "\n".join(lines) in text


def _result(tool, config: str, rel: float):
    shape = tool.Shape(4, 2, 256, 1)
    return tool.Result(shape=shape, config=config, tokens_per_s=1.0, step_ms=1.0, bytes_inter=0, bytes_intra=0,
                       peak_mb=1.0, plan_inter_vs_zigzag=None, loss_rel_diff=rel, losses=[1.0])


def test_loss_check_rejects_drift_beyond_fp32_round_off():
    tool = _tool()
    assert tool.loss_rel_diff([2.0, 3.0], [2.0, 3.0 * (1 + 4e-6)]) == pytest.approx(4e-6 / (1 + 4e-6), rel=1e-9)
    tool.check_losses([_result(tool, "ring (zigzag)", 9e-6), _result(tool, "ulysses", 0.0)])
    for bad in (3e-5, float("nan")):
        with pytest.raises(AssertionError, match="ulysses"):
            tool.check_losses([_result(tool, "ring (zigzag)", 0.0), _result(tool, "ulysses", bad)])
    with pytest.raises(ValueError, match="iterations"):
        tool.loss_rel_diff([1.0], [1.0, 2.0])
