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


def _row(method: str, est) -> str:
    c = est.components
    cells = " | ".join(f"{c[k] / GiB:.2f}" for k in ORDER)
    return (f"| {method} | {est.tokens / 1e6:.2f}M | {est.tokens_per_rank:,} | {cells} | {est.peak / GiB:.2f} "
            f"| {est.limiting} |")


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
    print("| method | context | tokens/rank | " + " | ".join(f"{k} GiB" for k in ORDER) + " | peak GiB | limited by |")
    print("|---" * (len(ORDER) + 5) + "|")
    budget = int(args.device_gib * GiB)
    reserve = int(args.reserve_gib * GiB)
    for method in methods:
        if args.tokens:
            est = estimate(model, args.tokens, par, training(args.tokens), method)
        else:
            guess = max_context(model, budget, par, training(1 << 20), method, reserve_bytes=reserve)
            est = max_context(model, budget, par, training(guess.tokens), method, reserve_bytes=reserve)
        print(_row(method, est))

    if args.plot:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib is not installed: no plot written", file=sys.stderr)
            return
        contexts = [n * 2 ** 18 for n in range(1, 41)]
        peaks = {m: [estimate(model, n, par, training(n), m).peak / GiB for n in contexts] for m in methods}
        for m, ys in peaks.items():
            plt.plot([n / 1e6 for n in contexts], ys, label=m)
        plt.axhline(args.device_gib, color="grey", linestyle="--", label=f"{args.device_gib:g} GiB")
        plt.xlabel("context length (M tokens)")
        plt.ylabel("predicted peak per rank (GiB)")
        plt.title(f"{model.name}, cp {args.cp}, recompute {args.recompute}")
        plt.legend()
        plt.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
