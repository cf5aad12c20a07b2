"""Checkpoint save and resume times of ``pretrain_gpt_hsap.py`` with the plain and the distributed optimizer.

For each optimizer setting: one run trains ``--iters`` iterations and saves at the end, a second
resumes from it for one more iteration. The times are the ones the training log prints
("saved checkpoint ... in T s", "loaded checkpoint ... in T s": rank 0's wall time of the whole
collective save, manifest and tracker included, and of the whole load, file verification included).

    python tools/bench_checkpoint.py --nproc 4 -- --context-parallel-size 2 --hidden-size 256 --num-layers 4
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from typing import List, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "pretrain_gpt_hsap.py")
SETTINGS = {"plain optimizer": [],
            "dist-opt dp_reshardable": ["--use-distributed-optimizer"],
            "dist-opt fully_reshardable": ["--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable"]}


def _seconds(pattern: str, stdout: str) -> float:
    found = re.search(pattern + r".* in ([\d.]+) s", stdout)
    if found is None:
        raise RuntimeError(f"no line matching {pattern!r} in the training log:\n{stdout[-3000:]}")
    return float(found.group(1))


def _run(nproc: int, flags: List[str]) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    result = subprocess.run([sys.executable, SCRIPT, "--nproc", str(nproc), "--no-progress-bar"] + flags,
                            cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"run failed ({result.returncode}):\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
    return result.stdout


def measure(nproc: int, iters: int, extra: List[str], setting: List[str]) -> Tuple[float, float, int]:
    """(save seconds, load seconds, checkpoint bytes) of one optimizer setting."""
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "ckpt")
        common = extra + setting + ["--lr-warmup-iters", "1"]
        saved = _run(nproc, common + ["--train-iters", str(iters), "--save", ckpt])
        loaded = _run(nproc, common + ["--train-iters", str(iters + 1), "--load", ckpt])
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(ckpt) for f in files)
        return _seconds("saved checkpoint at iteration", saved), _seconds("loaded checkpoint from", loaded), size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--iters", type=int, default=2, help="iterations before the save")
    parser.add_argument("extra", nargs="*", help="flags for pretrain_gpt_hsap.py (after --)")
    args = parser.parse_args()
    print(f"{args.nproc} CPU ranks, flags: {' '.join(args.extra) or '(defaults)'}")
    print(f"{'optimizer':<28} {'save (s)':>9} {'load (s)':>9} {'size (MB)':>10}")
    for name, setting in SETTINGS.items():
        save_s, load_s, size = measure(args.nproc, args.iters, args.extra, setting)
        print(f"{name:<28} {save_s:>9.2f} {load_s:>9.2f} {size / 2**20:>10.1f}")


if __name__ == "__main__":
    main()
