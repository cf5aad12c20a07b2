"""Predicted per-rank peak memory of long-context training and the longest context that fits.

    PYTHONPATH=. .venv/bin/python tools/memory_model.py --preset llama3-8b --cp 8 --device-gib 80
    PYTHONPATH=. .venv/bin/python tools/memory_model.py --preset llama3-8b --cp 8 --tokens 4000000 --method upipe
    PYTHONPATH=. .venv/bin/python tools/memory_model.py --preset llama3-8b --cp 8 --plot peak_vs_context.png

Model and assumptions: megatron_hsap/instrumentation/memory_model.py (validated against measured CPU peaks
by tests/test_memory_model.py); docs/upipe.md quotes the output.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_hsap.instrumentation.memory_model import (  # noqa: E402
    METHODS,
    PRESETS,
    GiB,
    Parallelism,
    Training,
    estimate,
    max_context,
)

ORDER = ("weights", "grads", "optimizer state", "saved activations", "attention block", "communication",
         "mlp transient", "loss transient")


def _row(method: str, est, budget: int) -> str:
    c = est.components
    cells = " | ".join(f"{c[k] / GiB:.2f}" for k in ORDER)
    fits = "yes" if est.peak <= budget else f"NO (+{(est.peak - budget) / GiB:.2f})"
    return (f"| {method} | {est.tokens / 1e6:.2f}M | {est.tokens_per_rank:,} | {cells} | {est.peak / GiB:.2f} "
            f"| {fits} | {est.limiting} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="llama3-8b")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--cp", type=int, default=8)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--ulysses", type=int, default=None, help="Ulysses size (default per method)")
    p.add_argument("--head-chunk", type=int, default=None, help="UPipe U (default: the Ulysses size)")
    p.add_argument("--dtype-bytes", type=int, default=2)
    p.add_argument("--grad-bytes", type=int, default=4, help="main_grad element size (4 = grad_reduce_in_fp32)")
    p.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    p.add_argument("--no-distributed-optimizer", action="store_true")
    p.add_argument("--recompute", choices=("full", "offload", "none"), default="full")
    p.add_argument("--mlp-chunks", type=int, default=None, help="default: ceil(tokens per rank / hidden)")
    p.add_argument("--loss-chunks", type=int, default=None, help="default: ceil(tokens per rank / 2048)")
    p.add_argument("--device-gib", type=float, default=80.0, help="device memory per rank (GiB)")
    p.add_argument("--reserve-gib", type=float, default=0.0, help="framework/allocator overhead to leave free")
    p.add_argument("--tokens", type=int, default=None, help="print the breakdown at this context instead")
    p.add_argument("--method", choices=METHODS, default=None, help="only this method")
    p.add_argument("--plot", default=None, help="write peak memory vs context per method to this PNG")
    args = p.parse_args()

    model = PRESETS[args.preset]
    par = Parallelism(tp=args.tp, pp=args.pp, cp=args.cp, dp=args.dp, ulysses=args.ulysses,
                      head_chunk=args.head_chunk)

    def training(tokens: int) -> Training:
        t = -(-tokens // args.cp)
        return Training(dtype_bytes=args.dtype_bytes, grad_bytes=args.grad_bytes, optimizer=args.optimizer,
                        distributed_optimizer=not args.no_distributed_optimizer, recompute=args.recompute,
                        mlp_chunks=args.mlp_chunks or max(1, -(-t // model.hidden)),
                        loss_chunks=args.loss_chunks or max(1, -(-t // 2048)))

    methods = [args.method] if args.method else list(METHODS)
    print(f"# {model.name}: layers {model.layers}, hidden {model.hidden}, H {model.heads}, H_kv {model.kv_heads}, "
          f"d {model.head_dim}, ffn {model.ffn}, vocab {model.vocab}; tp {args.tp} pp {args.pp} cp {args.cp} "
          f"dp {args.dp}; {args.dtype_bytes}-byte weights/activations, {args.grad_bytes}-byte grads, "
          f"{args.optimizer}{'' if args.no_distributed_optimizer else ' (distributed optimizer)'}, "
          f"recompute {args.recompute}; device {args.device_gib:g} GiB")
    budget = int(args.device_gib * GiB)
    reserve = int(args.reserve_gib * GiB)
    print("| method | context | tokens/rank | " + " | ".join(f"{k} GiB" for k in ORDER)
          + f" | peak GiB | fits {args.device_gib - args.reserve_gib:g} GiB | peak phase |")
    print("|---" * (len(ORDER) + 6) + "|")
    for method in methods:
        if args.tokens:
            est = estimate(model, args.tokens, par, training(args.tokens), method)
        else:
            guess = max_context(model, budget, par, training(1 << 20), method, reserve_bytes=reserve)
            est = max_context(model, budget, par, training(guess.tokens), method, reserve_bytes=reserve)
        print(_row(method, est, budget - reserve))
    print("context: " + ("as asked (--tokens)" if args.tokens else "the longest that fits (a multiple of 64Ki tokens)")
          + "; peak = weights + grads + optimizer state + saved activations + the largest transient; peak phase: "
          "the transient that sets it (attention block = attention buffers + communication; one layer's backward "
          "at a time)")

    if args.plot:
        _plot(args.plot, model, par, methods, training, budget, reserve, args)


def _plot(path, model, par, methods, training, budget: int, reserve: int, args) -> None:
    """Predicted peak against context per method, each method's longest context marked, zoomed on the range
    where the methods part ways."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot written", file=sys.stderr)
        return
    longest = {m: max_context(model, budget, par, training(max_context(model, budget, par, training(1 << 20), m,
                                                                       reserve_bytes=reserve).tokens),
                              m, reserve_bytes=reserve).tokens for m in methods}
    top = 1.4 * max(longest.values())
    contexts = [int(top * i / 80) for i in range(1, 81)]
    styles = {"ulysses": ("tab:blue", "-", 2.5), "hybrid": ("tab:orange", "--", 1.5), "ring": ("tab:green", "-", 2),
              "upipe": ("tab:red", "-", 2)}
    fig, ax = plt.subplots(figsize=(9, 5.5))
    peaks = {m: [estimate(model, n, par, training(n), m).peak / GiB for n in contexts] for m in methods}
    for m in methods:
        colour, line, width = styles[m]
        same = " (coincides with ulysses)" if m == "hybrid" and peaks.get("ulysses") == peaks[m] else ""
        ax.plot([n / 1e6 for n in contexts], peaks[m], color=colour, linestyle=line, linewidth=width,
                label=f"{m}: longest {longest[m] / 1e6:.2f}M tokens{same}")
        ax.axvline(longest[m] / 1e6, color=colour, linestyle=":", linewidth=1)
    ax.axhline((budget - reserve) / GiB, color="black", linestyle="--", linewidth=1,
               label=f"device budget {(budget - reserve) / GiB:g} GiB")
    ax.set_xlim(0, top / 1e6)
    ax.set_ylim(0, 1.5 * budget / GiB)
    ax.set_xlabel("context length (million tokens)")
    ax.set_ylabel("predicted peak memory per GPU (GiB)")
    ax.set_title(f"{model.name} on tp {args.tp} x cp {args.cp}: predicted peak per GPU by method\n"
                 f"recompute {args.recompute}, {args.grad_bytes}-byte grads, {args.optimizer}; dotted: the longest "
                 f"context that fits", fontsize=10)
    ax.legend(fontsize=9, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")

if __name__ == "__main__":
    main()
