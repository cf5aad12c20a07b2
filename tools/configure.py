#!/usr/bin/env python
"""Rank the parallel configurations of a long-context training job before running it.

    .venv/bin/python tools/configure.py --model llama3-8b --nodes 4 --seq-length 1048576
    .venv/bin/python tools/configure.py --model path/to/config.json --nodes 1 --device-gib 141 --gpu h200
    .venv/bin/python tools/configure.py --model "--num-layers 32 --hidden-size 4096 --num-attention-heads 32 \\
        --num-query-groups 8 --ffn-hidden-size 14336 --swiglu" --nodes 16 --seq-length 4194304 --plot steps.png

Every valid configuration (TP, CP x DP, mode, Ulysses x ring, head-chunk size U, recompute or layer-checkpoint
offload, distributed optimizer) is predicted by ``megatron_hsap.configurator``: peak memory per GPU (the memory
model), bytes per layer inside and across nodes (real plans of the length mix), and a step time (FLOPs at a stated
efficiency, bytes over the link bandwidths, overlap as the code does it). Prints the best configurations, the
flags of the first for ``pretrain_gpt_hsap.py``, and the longest sequence each mode fits. docs/configure.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from typing import List, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_hsap.configurator import (  # noqa: E402
    HARDWARE,
    Hardware,
    Prediction,
    distinct,
    enumerate_candidates,
    longest_sequence,
    predict,
    rank_predictions,
    training_flags,
)
from megatron_hsap.instrumentation.memory_model import PRESETS, GiB, ModelShape  # noqa: E402
from megatron_hsap.sequence.doc_lengths import pack_lengths, sample_doc_lengths  # noqa: E402

MIB = float(1 << 20)


def model_shape(spec: str) -> ModelShape:
    """A preset name, a Hugging Face ``config.json``, or Megatron flags in one string."""
    if spec in PRESETS:
        return PRESETS[spec]
    if os.path.isfile(spec):
        with open(spec) as f:
            cfg = json.load(f)
        heads = cfg["num_attention_heads"]
        return ModelShape(os.path.basename(os.path.dirname(os.path.abspath(spec))) or "model",
                          cfg["num_hidden_layers"], cfg["hidden_size"], heads, cfg.get("num_key_value_heads", heads),
                          cfg.get("head_dim") or cfg["hidden_size"] // heads, cfg["intermediate_size"],
                          cfg["vocab_size"], swiglu=cfg.get("hidden_act", "silu") in ("silu", "swiglu"),
                          qkv_bias=bool(cfg.get("attention_bias", False)),
                          tied_embeddings=bool(cfg.get("tie_word_embeddings", False)))
    if spec.lstrip().startswith("--"):
        p = argparse.ArgumentParser(prog="--model flags", add_help=False)
        for flag in ("--num-layers", "--hidden-size", "--num-attention-heads"):
            p.add_argument(flag, type=int, required=True)
        for flag in ("--num-query-groups", "--ffn-hidden-size", "--kv-channels"):
            p.add_argument(flag, type=int, default=None)
        p.add_argument("--vocab-size", type=int, default=128256)
        p.add_argument("--swiglu", action="store_true")
        p.add_argument("--untie-embeddings-and-output-weights", action="store_true")
        a, _ = p.parse_known_args(shlex.split(spec))
        return ModelShape("model", a.num_layers, a.hidden_size, a.num_attention_heads,
                          a.num_query_groups or a.num_attention_heads,
                          a.kv_channels or a.hidden_size // a.num_attention_heads,
                          a.ffn_hidden_size or 4 * a.hidden_size, a.vocab_size, swiglu=a.swiglu,
                          tied_embeddings=not a.untie_embeddings_and_output_weights)
    raise ValueError(f"--model {spec!r}: not a preset ({', '.join(sorted(PRESETS))}), a config.json file, or a "
                     "string of Megatron flags starting with --")


def mix_batches(path: Optional[str], seq_length: int, batches: int) -> List[List[int]]:
    """Document lengths of ``batches`` packed samples of ``seq_length`` tokens: from ``path`` (one length per line,
    packed in order from a seeded offset), else the shipped bucket histogram of a real corpus."""
    if path is None:
        return [sample_doc_lengths(seq_length, seed=b) for b in range(batches)]
    with open(path) as f:
        lengths = [int(line.split(",")[0]) for line in f if line.strip() and line.split(",")[0].strip().isdigit()]
    if not lengths or any(n < 1 for n in lengths):
        raise ValueError(f"--length-mix {path!r}: needs one positive document length per line")
    return [pack_lengths(lengths, seq_length, offset=(b * 7919) % len(lengths)) for b in range(batches)]


def format_table(rows: Sequence[Prediction], device_gib: float) -> str:
    head = ("| # | TP | CP | DP | mode | Ulysses x ring | U | recompute | dist. opt. | peak GiB | fits "
            f"{device_gib:g} | intra MiB/layer | inter MiB/layer | compute s | exposed comm s | step s | tokens/s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for i, p in enumerate(rows, 1):
        c = p.candidate
        lines.append(f"| {i} | {c.tp} | {c.cp} | {c.dp} | {c.mode} | {c.ulysses} x {c.ring} | {c.head_chunk} | "
                     f"{c.recompute} | {'yes' if c.distributed_optimizer else 'no'} | {p.peak_bytes / GiB:.1f} | "
                     f"{'yes' if p.fits else 'NO'} | {p.bytes_intra / MIB:.0f} | {p.bytes_inter / MIB:.0f} | "
                     f"{p.compute_s:.2f} | {p.exposed_comm_s:.2f} | {p.step_s:.2f} | {p.tokens_per_s:,.0f} |")
    return "\n".join(lines)


def draw(path: str, rows: Sequence[Prediction], device_gib: float, caption: str) -> None:
    """Per configuration: the step time split into compute and exposed communication, and the peak memory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"#{i} {p.candidate.mode}\nTP{p.candidate.tp} CP{p.candidate.cp} DP{p.candidate.dp}\n"
              f"U{p.candidate.head_chunk} {p.candidate.recompute}" for i, p in enumerate(rows, 1)]
    x = range(len(rows))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(8, 1.3 * len(rows)), 8), sharex=True)
    # Per sample (step time / DP): configurations with other DP sizes train the same tokens in comparable time.
    compute = [p.compute_s / p.candidate.dp for p in rows]
    top.bar(x, compute, label="compute", color="tab:blue")
    top.bar(x, [p.exposed_comm_s / p.candidate.dp for p in rows], bottom=compute, label="exposed communication",
            color="tab:orange")
    top.set_ylabel("predicted time per sample (s)\n(step time / DP)")
    top.legend(loc="lower right", fontsize=9)
    bottom.bar(x, [p.peak_bytes / GiB for p in rows], color=["tab:green" if p.fits else "tab:red" for p in rows])
    bottom.axhline(device_gib, color="black", linestyle="--", linewidth=1, label=f"device {device_gib:g} GiB")
    bottom.set_ylabel("predicted peak memory per GPU (GiB)")
    bottom.legend(loc="upper left", fontsize=9)
    bottom.set_xticks(list(x))
    bottom.set_xticklabels(labels, fontsize=7)
    fig.suptitle(caption, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3-8b",
                   help=f"a preset ({', '.join(sorted(PRESETS))}), a Hugging Face config.json, or Megatron model "
                        "flags in one quoted string")
    p.add_argument("--nodes", type=int, default=1, help="nodes in the job")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node")
    p.add_argument("--device-gib", type=float, default=80.0, help="memory per GPU (GiB)")
    p.add_argument("--seq-length", type=int, default=1 << 20, help="tokens per packed sample")
    p.add_argument("--length-mix", default=None,
                   help="a file of document lengths (one per line; CSV: the first column) for the plans; default: "
                        "the shipped bucket histogram of a real pre-training corpus")
    p.add_argument("--batches", type=int, default=1, help="sample batches of the mix the bytes are averaged over")
    p.add_argument("--gpu", choices=sorted(HARDWARE), default="h100", help="public figures of this GPU and its links")
    p.add_argument("--tflops", type=float, default=None, help="bf16 dense peak per GPU (TFLOP/s)")
    p.add_argument("--intra-gbps", type=float, default=None, help="GB/s one GPU sends inside its node")
    p.add_argument("--inter-gbps", type=float, default=None, help="GB/s one GPU sends to another node")
    p.add_argument("--efficiency", type=float, default=None, help="fraction of the peak kernels reach")
    p.add_argument("--top", type=int, default=10, help="rows of the table")
    p.add_argument("--plot", default=None, help="write the step-time and memory picture of the top rows here")
    args = p.parse_args(argv)
    for name in ("nodes", "gpus_per_node", "seq_length", "batches", "top"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    try:
        model = model_shape(args.model)
        batches = mix_batches(args.length_mix, args.seq_length, args.batches)
    except (ValueError, KeyError, OSError) as err:
        p.error(str(err))
    base = HARDWARE[args.gpu]
    hw = Hardware(base.name, args.tflops or base.tflops, args.intra_gbps or base.intra_gbps,
                  args.inter_gbps or base.inter_gbps, args.efficiency or base.efficiency, base.host_gbps)
    candidates = enumerate_candidates(model, args.nodes, args.gpus_per_node)
    ranked = distinct(rank_predictions(predict(c, model, args.seq_length, batches, hw, args.device_gib,
                                               args.gpus_per_node) for c in candidates))
    print(f"# {model.name}: layers {model.layers}, hidden {model.hidden}, heads {model.heads} / KV {model.kv_heads}, "
          f"d {model.head_dim}, ffn {model.ffn}, vocab {model.vocab}; {args.nodes} node(s) x {args.gpus_per_node} "
          f"GPUs of {args.device_gib:g} GiB; {args.seq_length:,} tokens per sample "
          f"({'mix ' + args.length_mix if args.length_mix else 'bucket-histogram mix'}, {len(batches)} batch(es))")
    print(f"# hardware ({hw.name}): {hw.tflops:g} TFLOP/s bf16 dense peak at {hw.efficiency:.0%} efficiency, "
          f"{hw.intra_gbps:g} GB/s per GPU inside a node (NVLink), {hw.inter_gbps:g} GB/s across nodes "
          f"(InfiniBand), {hw.host_gbps:g} GB/s to host memory (offload); {len(candidates)} configurations; bytes per layer and GPU for one step (forward, "
          f"backward, recomputed forward); DP x one sample per step")
    print(format_table(ranked[:args.top], args.device_gib))
    best = ranked[0]
    if best.fits:
        print(f"recommended: {best.candidate.describe()}, recompute {best.candidate.recompute}")
        print("flags: " + " ".join(training_flags(best.candidate, args.gpus_per_node // best.candidate.tp, model,
                                                  args.seq_length) + ["--seq-length", str(args.seq_length)]))
    else:
        print(f"no configuration fits {args.device_gib:g} GiB at {args.seq_length:,} tokens; the least memory: "
              f"{best.candidate.describe()} at {best.peak_bytes / GiB:.1f} GiB")
    for mode in ("ring", "ulysses", "hybrid", "hsap"):
        own = [r for r in ranked if r.candidate.mode == mode]
        if own:
            deepest = max(own, key=lambda r: longest_sequence(r.candidate, model, args.device_gib))
            print(f"longest sequence, {mode}: {longest_sequence(deepest.candidate, model, args.device_gib):,} "
                  f"tokens ({deepest.candidate.describe()}, recompute {deepest.candidate.recompute})")
    if args.plot:
        draw(args.plot, ranked[:args.top], args.device_gib,
             f"{model.name} on {args.nodes} x {args.gpus_per_node} GPUs, samples of {args.seq_length:,} tokens:\n"
             f"predicted time per sample and peak memory per GPU of the {min(args.top, len(ranked))} best "
             f"configurations (ranked by tokens/s)")
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
