#!/usr/bin/env python
"""Training benchmark: every CP mode and layout on the same packed data, against CP 1.

Runs ``pretrain_gpt_hsap.py`` (forked CPU ranks, gloo, emulated nodes) once per configuration
and shape on the embedded stdlib corpus (many documents per micro-batch, see docs/training.md)
with ``--layout-independent-init``, so every run starts from the same weights and reads the
same samples (``--num-workers 0``: each rank reads and plans in a thread, no worker processes).
Per configuration it prints tokens/s, step time (median over the iterations after the first),
CP bytes sent per rank and iteration inter-/intra-node (the busiest rank, measured by the
collectives), peak memory (rank 0's peak RSS on CPU), the plan's
predicted inter-node bytes as a fraction of zigzag's on the same micro-batches (the run's
plan summary), and the largest relative loss difference from the CP 1 run, which must be
within fp32 round-off (``LOSS_RTOL``; the tool fails otherwise).

Times (tokens/s, step time, "x ring") are timings: compare them only within one run of this
tool, on an otherwise idle machine. Byte counts and losses are deterministic.

    python tools/bench_training.py --markdown docs/benchmarks.md --plot docs/bench_training.png

writes the table between the ``<!-- bench_training -->`` markers of the markdown file and a
picture of bytes and step time per configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "pretrain_gpt_hsap.py")
#: Largest relative loss difference from CP 1 accepted as fp32 round-off (partial attention outputs and
#: gradients are summed in another order; the same bound as tests/test_training_pretrain.py).
LOSS_RTOL = 1e-5
MARK_BEGIN, MARK_END = "<!-- bench_training:begin -->", "<!-- bench_training:end -->"

#: name -> CP flags (the CP size and node shape come from the shape; ``{heads}``: --num-attention-heads).
CONFIGS: Dict[str, List[str]] = {
    "ring (zigzag)": ["--context-parallel-mode", "ring"],
    "ulysses": ["--context-parallel-mode", "ulysses"],
    "hybrid (zigzag)": ["--context-parallel-mode", "hybrid", "--cp-layout", "zigzag"],
    # hsap's default head chunk is the Ulysses size; one chunk of all heads is plain Ulysses inside the node.
    "hsap (sequence-aware)": ["--context-parallel-mode", "hsap", "--head-chunk-size", "{heads}"],
    "hsap, head chunks of 4": ["--context-parallel-mode", "hsap", "--head-chunk-size", "4"],
    "hsap, ulysses 2": ["--context-parallel-mode", "hsap", "--ulysses-size", "2"],
    "hsap, ulysses 2, K/V forwarding": ["--context-parallel-mode", "hsap", "--ulysses-size", "2",
                                        "--cp-kv-forwarding"],
}


@dataclass(frozen=True)
class Shape:
    """CP ranks over ``nodes`` emulated nodes; each micro-batch packs ``micro_batch`` x ``seq_length`` tokens."""

    cp: int
    nodes: int
    seq_length: int
    micro_batch: int

    @property
    def label(self) -> str:
        return f"CP {self.cp} ({self.nodes} nodes x {self.cp // self.nodes}), {self.micro_batch} x {self.seq_length}"


SHAPES = [Shape(8, 2, 1024, 2), Shape(8, 2, 4096, 1)]


@dataclass
class Result:
    shape: Shape
    config: str
    tokens_per_s: float
    step_ms: float
    bytes_inter: float
    bytes_intra: float
    peak_mb: float
    plan_inter_vs_zigzag: Optional[float]
    loss_rel_diff: float
    losses: List[float]


def run_config(shape: Shape, flags: Sequence[str], iters: int, model: Sequence[str], cache: str, workdir: str,
               name: str) -> List[Dict]:
    """One training run; its per-iteration JSON records. Raises RuntimeError with the run's output on failure."""
    log = os.path.join(workdir, name.replace(" ", "_").replace("/", "") + ".jsonl")
    cp = 1 if not flags else shape.cp
    argv = [sys.executable, SCRIPT, "--nproc", str(cp), "--context-parallel-size", str(cp),
            "--ranks-per-node", str(max(1, cp // shape.nodes)), "--seq-length", str(shape.seq_length),
            "--micro-batch-size", str(shape.micro_batch), "--global-batch-size", str(shape.micro_batch),
            "--train-iters", str(iters), "--lr-warmup-iters", "1", "--eval-iters", "0", "--log-interval", "1",
            "--layout-independent-init", "--no-progress-bar", "--num-workers", "0", "--data-cache-path", cache,
            "--log-json", log,
            *model, *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed ({done.returncode}): {' '.join(argv)}\n{done.stdout[-2000:]}\n"
                           f"{done.stderr[-3000:]}")
    with open(log) as f:
        return [r for r in map(json.loads, f) if "iteration" in r and "evaluation" not in r]


def loss_rel_diff(losses: Sequence[float], reference: Sequence[float]) -> float:
    """Largest relative difference per iteration between two runs' losses (same number of iterations)."""
    if len(losses) != len(reference) or not losses:
        raise ValueError(f"runs logged {len(losses)} and {len(reference)} iterations; they must match and be > 0")
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference))


def check_losses(results: Sequence[Result], rtol: float = LOSS_RTOL) -> None:
    """AssertionError naming every configuration whose loss left CP 1's by more than ``rtol`` (relative)."""
    bad = [f"{r.shape.label} / {r.config}: {r.loss_rel_diff:.2e}" for r in results if not r.loss_rel_diff <= rtol]
    if bad:
        raise AssertionError(f"loss differs from CP 1 by more than fp32 round-off (rtol {rtol:g}): " + "; ".join(bad))


def summarise(shape: Shape, config: str, records: List[Dict], reference: List[float]) -> Result:
    timed = records[1:] or records  # the first iteration includes one-off set-up
    step_ms = statistics.median(r["elapsed_ms"] for r in timed)
    plan = records[-1].get("plan") or {}
    return Result(shape=shape, config=config, tokens_per_s=shape.micro_batch * shape.seq_length / step_ms * 1000,
                  step_ms=step_ms, bytes_inter=statistics.mean(r["cp_bytes_inter"] for r in records),
                  bytes_intra=statistics.mean(r["cp_bytes_intra"] for r in records),
                  peak_mb=max(r["peak_memory_bytes"] for r in records) / 2**20,
                  plan_inter_vs_zigzag=(plan.get("run") or {}).get("bytes_inter_vs_zigzag"),
                  loss_rel_diff=loss_rel_diff([r["loss"] for r in records], reference),
                  losses=[r["loss"] for r in records])


HEADER = ("| shape | configuration | tokens/s | step time (ms) | x ring | inter-node MB/iter | intra-node MB/iter | "
          "peak memory (MB) | plan inter-node x zigzag | loss rel. diff vs CP 1 |")


def table(results: Sequence[Result]) -> str:
    """Markdown table, one row per (shape, configuration); "x ring": step time over ring's in the same shape."""
    ring = {r.shape: r.step_ms for r in results if r.config == "ring (zigzag)"}
    lines = [HEADER, "|" + "---|" * (HEADER.count("|") - 1)]
    for r in results:
        rel = f"{r.step_ms / ring[r.shape]:.2f}" if r.shape in ring else "-"
        plan = "-" if r.plan_inter_vs_zigzag is None else f"{r.plan_inter_vs_zigzag:.2f}"
        lines.append(f"| {r.shape.label} | {r.config} | {r.tokens_per_s:.0f} | {r.step_ms:.0f} | {rel} | "
                     f"{r.bytes_inter / 1e6:.3f} | {r.bytes_intra / 1e6:.3f} | {r.peak_mb:.0f} | {plan} | "
                     f"{r.loss_rel_diff:.1e} |")
    return "\n".join(lines)


def write_markdown(path: str, text: str) -> None:
    """Replace what lies between the markers in ``path`` (appended with the markers when absent)."""
    with open(path) as f:
        doc = f.read()
    block = f"{MARK_BEGIN}\n{text}\n{MARK_END}"
    if MARK_BEGIN in doc and MARK_END in doc:
        head, rest = doc.split(MARK_BEGIN, 1)
        doc = head + block + rest.split(MARK_END, 1)[1]
    else:
        doc = doc.rstrip("\n") + "\n\n" + block + "\n"
    with open(path, "w") as f:
        f.write(doc)


def plot(results: Sequence[Result], path: str, caption: str) -> None:
    """Per shape: bytes per iteration (inter- and intra-node, bars) and step time (bars, second panel)."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(r.shape for r in results))
    width = max(7.0, 5.2 * len(shapes))
    fig, axes = plt.subplots(2, len(shapes), figsize=(width, 9.0), squeeze=False)
    for col, shape in enumerate(shapes):
        rows = [r for r in results if r.shape == shape and r.config != "CP 1"]
        names = [r.config for r in rows]
        x = list(range(len(rows)))
        ax = axes[0][col]
        ax.bar([i - 0.2 for i in x], [r.bytes_inter / 1e6 for r in rows], 0.4, label="inter-node", color="#c0392b")
        ax.bar([i + 0.2 for i in x], [r.bytes_intra / 1e6 for r in rows], 0.4, label="intra-node", color="#2980b9")
        ax.set_title(shape.label, fontsize=10)
        ax.set_ylabel("CP MB sent per iteration (busiest rank)")
        ax.set_xticks(x, [])
        ax.legend(fontsize=8)
        ax = axes[1][col]
        ax.bar(x, [r.step_ms for r in rows], 0.6, color="#7f8c8d")
        ax.set_ylabel("step time (ms, median; timing)")
        ax.set_xticks(x, names, rotation=40, ha="right", fontsize=8)
    fig.suptitle("\n".join(textwrap.wrap(caption, int(width * 13))), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=4, help="training iterations per run (default 4)")
    parser.add_argument("--shapes", nargs="+", default=None, metavar="CP:NODES:SEQ:MICRO",
                        help="e.g. 8:2:1024:2 (default: " + " ".join(f"{s.cp}:{s.nodes}:{s.seq_length}:"
                                                                      f"{s.micro_batch}" for s in SHAPES) + ")")
    parser.add_argument("--configs", nargs="+", default=None, choices=list(CONFIGS), metavar="NAME",
                        help="configurations to run (default all): " + ", ".join(map(repr, CONFIGS)))
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--data-cache-path", default=None, help="default: a temporary directory")
    parser.add_argument("--markdown", default=None, help="write the table into this file between the markers")
    parser.add_argument("--plot", default=None, help="write the picture (PNG) here")
    args = parser.parse_args(argv)
    if args.iters < 2:
        parser.error(f"--iters must be >= 2 (the first iteration is not timed), got {args.iters}")
    try:
        shapes = [Shape(*map(int, s.split(":"))) for s in args.shapes] if args.shapes else SHAPES
    except (TypeError, ValueError):
        parser.error(f"--shapes: each must be CP:NODES:SEQ:MICRO integers, got {args.shapes}")
    configs = args.configs or list(CONFIGS)
    model = ["--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
             "--num-attention-heads", str(args.num_attention_heads)]
    started = time.time()
    results: List[Result] = []
    with tempfile.TemporaryDirectory() as workdir:
        cache = args.data_cache_path or os.path.join(workdir, "cache")
        for shape in shapes:
            reference_records = run_config(shape, [], args.iters, model, cache, workdir, f"{shape.label} CP 1")
            reference = [r["loss"] for r in reference_records]
            results.append(summarise(shape, "CP 1", reference_records, reference))
            for name in configs:
                flags = [flag.format(heads=args.num_attention_heads) for flag in CONFIGS[name]]
                records = run_config(shape, flags, args.iters, model, cache, workdir, f"{shape.label} {name}")
                results.append(summarise(shape, name, records, reference))
                print(f"  {shape.label} | {name}: {results[-1].step_ms:.0f} ms/iteration", file=sys.stderr,
                      flush=True)
    text = table(results)
    print(text)
    print(f"({len(results)} runs, {args.iters} iterations each, {time.time() - started:.0f} s; times are timings)")
    check_losses(results)
    if args.markdown:
        write_markdown(args.markdown, text)
    if args.plot:
        plot(results, args.plot, f"pretrain_gpt_hsap.py, {args.num_layers} layers, hidden {args.hidden_size}, "
                                 f"{args.num_attention_heads} heads, stdlib corpus, {args.iters} iterations per run, "
                                 "CPU ranks (gloo); bytes: CP collectives, busiest rank")
    return 0


if __name__ == "__main__":
    sys.exit(main())
