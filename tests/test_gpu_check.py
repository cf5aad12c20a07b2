"""``tools/gpu_check.py --dry-run``: every stage of the GPU validation on CPU (gloo, the reference kernel, tiny
shapes), each in its own process (forked from the orchestrator), one line per stage, JSON results after each stage."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = ["S0", "S1", "S2", "S3", "S4", "S5"]


def test_gpu_check_dry_run_runs_every_stage(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "gpu_check.py"), str(tmp_path), "--dry-run"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    lines = [line for line in result.stdout.splitlines() if line.startswith("[gpu_check] S")]
    assert [line.split()[1] for line in lines] == STAGES, result.stdout[-3000:]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    stages = report["stages"]
    assert report["dry_run"] is True and list(stages) == STAGES and all(stages[s]["pass"] is True for s in STAGES)
    assert stages["S0"]["auto_picks"]["bfloat16 d128"] == "cpu_fused"
    # S1: the reference kernel on every case (packed, one document, length-1 documents, a window, a ring step,
    # several passes) against fp64, within 2x / 3x of dense bf16 attention's error
    assert {r["case"] for r in stages["S1"]["rows"]} == {"packed-causal", "length-1-documents", "window",
                                                         "one-document", "ring-two-calls", "multi-pass"}
    assert max(stages["S2"]["errors"].values()) <= 1e-9 and set(stages["S2"]["upipe_over_unchunked"]) == {
        "attention_block", "layer_recompute"}
    rows = stages["S3"]["rows"]  # every configuration on every one of the 4 ranks, against fp64
    assert len(rows) == 7 * 4 and all(r["max_rel_err"] <= 1e-9 for r in rows)
    assert all(r["bytes_match_plan"] for r in rows)
    assert all(tuple(r["bytes"]) == tuple(r["predicted_bytes"]) for r in rows if "forwarding" not in r["config"])
    assert [r["cp"] for r in stages["S4"]["runs"]] == [1, 2]
    assert all(r["losses"][-1] < r["losses"][0] for r in stages["S4"]["runs"])
    assert stages["S5"]["ratios"] and all(r["stage_over_all_fwd_bwd"] > 0 for r in stages["S5"]["ratios"])
    for stage in STAGES:  # each stage's own file, written by its subprocess
        assert json.loads((tmp_path / f"{stage}.json").read_text())["pass"] is True


def _gpu_check_module():
    import importlib.util

    if "gpu_check" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(ROOT, "tools", "gpu_check.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules["gpu_check"] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules["gpu_check"]


def test_ranks_sharing_one_gpu_get_the_nccl_settings_of_their_release(monkeypatch):
    import torch

    gc = _gpu_check_module()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 30, 1))
    assert gc.nccl_env(3) == {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 27, 5))
    assert gc.nccl_env(3) == {"NCCL_SOCKET_IFNAME": "lo", "NCCL_HOSTID": "gpu-check-rank-3"}
    assert gc.nccl_env(0)["NCCL_HOSTID"] != gc.nccl_env(1)["NCCL_HOSTID"]
    assert gc.nccl_env(None) == {"NCCL_SOCKET_IFNAME": "lo"}  # torchrun's ranks set theirs (--with-rank-hostid)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gc.nccl_env(0) == {}


def test_peak_breakdown_replays_the_allocator_trace_to_its_peak():
    """tools/gpu_peak_breakdown.py: the live set at the trace's highest point, by allocating site; blocks
    freed before the peak and blocks allocated before the recording (freed inside it) are not counted."""
    from tools.gpu_peak_breakdown import live_at_peak

    def frames(line):
        return [{"filename": "/site/torch/x.py", "line": 1, "name": "op"},
                {"filename": "/repo/megatron_hsap/attention/upipe.py", "line": line, "name": "f"}]

    trace = [{"action": "alloc", "addr": 1, "size": 100, "frames": frames(10)},
             {"action": "alloc", "addr": 2, "size": 30, "frames": frames(20)},
             {"action": "free_completed", "addr": 99},  # allocated before the recording
             {"action": "free_completed", "addr": 1},
             {"action": "alloc", "addr": 3, "size": 60, "frames": []},
             {"action": "alloc", "addr": 4, "size": 50, "frames": frames(20)},
             {"action": "free_requested", "addr": 4},
             {"action": "free_completed", "addr": 4}]
    assert live_at_peak(trace) == (140, {"upipe.py:20:f": 80, "(no Python frame)": 60})


def test_a_configuration_over_its_cap_is_recorded_and_the_stage_returns(monkeypatch):
    """S3 on CPU with a per-configuration cap no configuration can meet: every rank's first configuration is
    stopped by its watchdog (a hung collective on a GPU), recorded, and the stage fails instead of hanging."""
    import torch

    gc = _gpu_check_module()
    monkeypatch.setattr(gc, "DRY_RUN_CAP_S", 0.01)
    result = gc.stage_s3(gc.CPU_SIZES, torch.device("cpu"), "")
    assert result["pass"] is False
    killed = [r for r in result["rows"] if "killed" in r]
    assert killed and all(r["config"] == gc.S3_CONFIGS[0][0] for r in killed)
    assert len(result["rows"]) < 4 * len(gc.S3_CONFIGS)
