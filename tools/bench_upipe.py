"""Benchmark UPipe (head-chunked attention) against plain Ulysses on CPU gloo ranks.

For a model preset at a reduced sequence length and a CP layout, each rank runs one
attention block (fused QKV projection + RoPE + distributed attention, forward and
backward) for U = H (plain Ulysses, one stage) and every smaller valid head chunk U,
and reports per rank: peak live attention-block bytes (also without the weight
gradient, which at short CPU sequence lengths dominates and does not depend on U; in
Megatron it lives in the preallocated grad buffer), bytes sent, and the fwd+bwd time
relative to Ulysses (U = H through the same operation). It then prints REFERENCE.md
1.1's analytical per-rank peak at the full sequence length the user asks for.
CPU times are wall-clock on shared cores: indicative of per-stage overheads only.

    .venv/bin/python tools/bench_upipe.py --preset llama3-8b --seq 2048 --cp 4 --full-seq 5000000 --full-cp 8
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
import time
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PRESETS = {  # H, H_kv, head_dim, hidden
    "llama3-8b": (32, 8, 128, 4096),
    "qwen3-32b": (64, 8, 128, 5120),
}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, args: argparse.Namespace, port: int, queue) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.cp,
                            timeout=datetime.timedelta(seconds=600))
    try:
        queue.put((rank, _measure(args)))
    finally:
        from megatron_hsap.parallel_state import destroy_model_parallel

        destroy_model_parallel()
        dist.destroy_process_group()


def _measure(args: argparse.Namespace) -> Dict[int, Dict[str, float]]:
    from megatron_hsap.attention.upipe import head_chunked_attention
    from megatron_hsap.config import ContextParallelConfig
    from megatron_hsap.instrumentation import count_comm
    from megatron_hsap.instrumentation.memory import track_peak_memory
    from megatron_hsap.parallel_state import initialize_model_parallel
    from megatron_hsap.sequence.doc_lengths import cu_seqlens_from_lengths
    from megatron_hsap.sequence.plan import plan_batch

    h, h_kv, d, hidden_size = PRESETS[args.preset]
    dtype = getattr(torch, args.dtype)
    topo = initialize_model_parallel(context_parallel_size=args.cp, ranks_per_node=args.ranks_per_node,
                                     cp_config=ContextParallelConfig(mode=args.mode, ulysses_size=args.ulysses,
                                                                     kernel="torch"))
    plan = plan_batch(cu_seqlens_from_lengths([args.seq]), topo, "zigzag")
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(plan.tokens_per_rank, 1, hidden_size, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn((h // h_kv + 2) * h_kv * d, hidden_size, generator=gen) * hidden_size ** -0.5
              ).to(dtype).requires_grad_()
    dout = torch.randn(plan.tokens_per_rank, 1, h * d, generator=gen).to(dtype)
    chunks = [h] + [u for u in range(h - topo.ulysses_size, 0, -topo.ulysses_size)
                    if u % topo.ulysses_size == 0 and h % u == 0]
    results: Dict[int, Dict[str, float]] = {}
    for u in chunks:
        seconds = []
        for _ in range(args.repeats):
            dist.barrier()
            start = time.perf_counter()
            with count_comm() as comm, track_peak_memory("cpu") as mem:
                out = head_chunked_attention(hidden, weight, None, plan, num_heads_q=h, num_heads_kv=h_kv,
                                             head_dim=d, head_chunk_size=u)
                out.backward(dout)
                del out
            dist.barrier()
            seconds.append(time.perf_counter() - start)
            hidden.grad = weight.grad = None
        results[u] = {"seconds": min(seconds), "peak_bytes": mem.peak_bytes,
                      "sent_bytes": comm.send_bytes_intra + comm.send_bytes_inter,
                      "weight_grad_bytes": weight.numel() * torch.empty((), dtype=_acc_dtype(dtype)).element_size()}
    return results


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the op accumulates the weight gradient in (float32 unless float64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def analytical_peak(tokens: int, cp: int, ulysses: int, h: int, h_kv: int, d: int, hidden_size: int, u: int,
                    element_size: int) -> Dict[str, int]:
    """Per-rank bytes at a full sequence length: REFERENCE.md 1.1's Q/K/V + all-to-all intermediates for U heads,
    and the U-independent part of the block (saved output, its gradient, the input gradient)."""
    from megatron_hsap.attention.head_schedule import attention_activation_bytes

    t = -(-tokens // cp)
    return {"intermediates": attention_activation_bytes(t, h, h_kv, d, ulysses, u, element_size),
            "fixed": t * (2 * h * d + hidden_size) * element_size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama3-8b")
    parser.add_argument("--seq", type=int, default=2048, help="global tokens of the measured batch (one document)")
    parser.add_argument("--cp", type=int, default=4, help="CP ranks to spawn")
    parser.add_argument("--mode", choices=("ulysses", "hybrid", "hsap"), default="ulysses")
    parser.add_argument("--ulysses", type=int, default=None, help="Ulysses size (default: the mode's)")
    parser.add_argument("--ranks-per-node", type=int, default=None, help="emulated node size (default: all)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float64"), default="float32")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--repeats", type=int, default=1, help="fwd+bwd runs per U; the fastest is reported")
    parser.add_argument("--full-seq", type=int, default=5_000_000, help="sequence length of the analytical figure")
    parser.add_argument("--full-cp", type=int, default=8, help="CP ranks (= Ulysses size) of the analytical figure")
    parser.add_argument("--full-dtype-bytes", type=int, default=2, help="element size of the analytical figure")
    args = parser.parse_args()
    if args.seq < args.cp:
        raise ValueError(f"--seq={args.seq} must be at least --cp={args.cp}")
    if args.repeats < 1:
        raise ValueError(f"--repeats={args.repeats} must be >= 1")

    port = _free_port()
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank_main, args=(args, port, queue), nprocs=args.cp, join=True)
    per_rank = dict(queue.get() for _ in range(args.cp))

    h, h_kv, d, hidden_size = PRESETS[args.preset]
    print(f"# {args.preset}: H={h} H_kv={h_kv} d={d} hidden={hidden_size}; seq {args.seq} on {args.cp} ranks "
          f"(mode {args.mode}), {args.dtype}, fwd+bwd of one attention block, {args.threads} thread(s) per rank")
    print("| rank | U | stages | peak attention-block bytes | vs Ulysses | peak minus weight grad | vs Ulysses "
          "| bytes sent | time s | time vs Ulysses |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for rank in sorted(per_rank):
        base = per_rank[rank][h]
        base_act = base["peak_bytes"] - base["weight_grad_bytes"]
        for u, r in per_rank[rank].items():
            label = f"{u} (Ulysses)" if u == h else str(u)
            act = r["peak_bytes"] - r["weight_grad_bytes"]
            print(f"| {rank} | {label} | {h // u} | {r['peak_bytes']:,} | {r['peak_bytes'] / base['peak_bytes']:.3f} "
                  f"| {act:,} | {act / base_act:.3f} | {r['sent_bytes']:,} | {r['seconds']:.2f} "
                  f"| {r['seconds'] / base['seconds']:.2f} |")
    print(f"\n# analytical per-rank bytes at {args.full_seq:,} tokens on {args.full_cp} ranks "
          f"(Ulysses size {args.full_cp}), {args.full_dtype_bytes}-byte elements")
    print("| U | Q/K/V + all-to-all intermediates (GiB) | + U-independent output/grads (GiB) | vs Ulysses |")
    print("|---|---|---|---|")
    chunks: List[int] = [u for u in range(h, 0, -args.full_cp) if h % u == 0 and u % args.full_cp == 0]
    base = analytical_peak(args.full_seq, args.full_cp, args.full_cp, h, h_kv, d, hidden_size, h, args.full_dtype_bytes)
    for u in chunks:
        a = analytical_peak(args.full_seq, args.full_cp, args.full_cp, h, h_kv, d, hidden_size, u,
                            args.full_dtype_bytes)
        print(f"| {u}{' (Ulysses)' if u == h else ''} | {a['intermediates'] / 2**30:.2f} | "
              f"{(a['intermediates'] + a['fixed']) / 2**30:.2f} | {a['intermediates'] / base['intermediates']:.3f} |")


if __name__ == "__main__":
    main()
