#!/usr/bin/env python
"""Peak live memory of the ring-attention backward versus ring size, at fixed tokens per rank.

For each ring size R it starts R gloo ranks (pure ring, one causal document of R x t
tokens in the zigzag layout, so every rank exchanges with every other one), runs the
forward, then tracks the backward with the dispatcher-level tracker
(``instrumentation.memory``). The backward's own tensors are the fp32 dq/dk/dv
accumulators and the kernel's scratch, which do not depend on R; what does is how many
exchange buffers (re-sent K/V, returned dK/dV) are alive at once. Printed per R: peak
MiB of the backward on the busiest rank, and that peak divided by the bytes of one
rank's K/V (2 x t x h_kv x d x element size).

    python tools/bench_ring_memory.py                     # R = 2, 4, 6, 8; t = 1024, 8 heads x 64, bf16
    python tools/bench_ring_memory.py --sizes 2,4 --tokens-per-rank 512
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_hsap.training.quiet import quiet_rank  # noqa: E402

quiet_rank(0)  # before Megatron-Core is imported (also in each spawned rank): its TE/Apex notices, once

from megatron_hsap.attention import context_parallel_attention  # noqa: E402
from megatron_hsap.config import ContextParallelConfig  # noqa: E402
from megatron_hsap.instrumentation.memory import track_peak_memory  # noqa: E402
from megatron_hsap.parallel_state import initialize_model_parallel  # noqa: E402
from megatron_hsap.sequence.doc_lengths import cu_seqlens_from_lengths  # noqa: E402
from megatron_hsap.sequence.plan import plan_batch  # noqa: E402


def _rank(rank: int, ring: int, port: int, args: argparse.Namespace, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=ring)
    topo = initialize_model_parallel(context_parallel_size=ring, ranks_per_node=1,
                                     cp_config=ContextParallelConfig(mode="ring", kernel=args.kernel))
    plan = plan_batch(cu_seqlens_from_lengths([ring * args.tokens_per_rank]), topo, "zigzag")
    t = plan.tokens_per_rank
    q, k, v = (torch.randn(t, h, args.head_dim).to(torch.bfloat16).requires_grad_()
               for h in (args.heads, args.heads, args.heads))
    out = context_parallel_attention(q, k, v, plan)
    grad = torch.randn_like(out)
    with track_peak_memory() as mem:
        out.backward(grad)
    queue.put((rank, mem.peak_bytes))
    dist.barrier()
    dist.destroy_process_group()


def measure(ring: int, args: argparse.Namespace) -> int:
    """Largest backward peak over the ranks of one ring, in bytes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, ring, port, args, queue)) for r in range(ring)]
    for p in procs:
        p.start()
    peaks = [queue.get(timeout=600)[1] for _ in procs]
    for p in procs:
        p.join()
    return max(peaks)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="2,4,6,8")
    parser.add_argument("--tokens-per-rank", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--kernel", default="torch")
    args = parser.parse_args(argv)
    sizes: List[int] = [int(x) for x in args.sizes.split(",")]
    kv_bytes = 2 * args.tokens_per_rank * args.heads * args.head_dim * 2
    print(f"ring backward, {args.tokens_per_rank} tokens/rank, {args.heads} heads x {args.head_dim}, bf16, "
          f"kernel {args.kernel}; one rank's K/V = {kv_bytes / 2**20:.2f} MiB")
    print(f"{'ring size':>9} {'backward peak MiB':>18} {'peak / K/V bytes':>17}")
    for ring in sizes:
        peak = measure(ring, args)
        print(f"{ring:>9} {peak / 2**20:>18.2f} {peak / kv_bytes:>17.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
