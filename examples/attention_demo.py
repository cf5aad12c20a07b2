#!/usr/bin/env python
"""Distributed attention on 4 CPU ranks (2 emulated nodes x 2), checked against an fp64 reference.

Runs hybrid context parallelism (Ulysses inside a node, ring across) on a packed batch of
documents with the sequence-aware layout, forward and backward, and prints the error
of the output and the gradients against per-document SDPA in fp64, and the bytes moved.

    python examples/attention_demo.py
"""

import os
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_hsap.training.quiet import fallback_summary, quiet_rank  # noqa: E402

quiet_rank(0)  # before Megatron-Core is imported: its missing-package notices become one line below

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from megatron_hsap.attention import context_parallel_attention  # noqa: E402
from megatron_hsap.config import ContextParallelConfig  # noqa: E402
from megatron_hsap.instrumentation import count_comm  # noqa: E402
from megatron_hsap.parallel_state import initialize_model_parallel  # noqa: E402
from megatron_hsap.reference import sdpa_reference  # noqa: E402
from megatron_hsap.sequence.doc_lengths import cu_seqlens_from_lengths  # noqa: E402
from megatron_hsap.sequence.plan import plan_batch  # noqa: E402

LENGTHS = [300, 17, 1, 0, 190, 45, 3]


def run(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    topo = initialize_model_parallel(context_parallel_size=world, ranks_per_node=2,
                                     cp_config=ContextParallelConfig(mode="hybrid", kernel="torch"))
    plan = plan_batch(cu_seqlens_from_lengths(LENGTHS), topo, layout="sequence-aware")
    gen = torch.Generator().manual_seed(0)  # the same global batch on every rank
    total = sum(LENGTHS)
    q = torch.randn(total, 8, 64, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(total, 2, 64, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(total, 2, 64, generator=gen, dtype=torch.float64, requires_grad=True)
    local = [plan.shard(x.detach()).requires_grad_() for x in (q, k, v)]
    with count_comm() as comm:
        out = context_parallel_attention(*local, plan)
        out.sum().backward()
    reference = sdpa_reference(q, k, v, LENGTHS)
    reference.sum().backward()
    errors = [(plan.unshard(out) - reference).abs().max().item()]
    errors += [(plan.unshard(x.grad) - g.grad).abs().max().item() for x, g in zip(local, (q, k, v))]
    line = (f"rank {rank}: Ulysses {topo.ulysses_size} x ring {topo.ring_size}, {plan.tokens_per_rank} tokens; "
            f"max error out {errors[0]:.1e} dq {errors[1]:.1e} dk {errors[2]:.1e} dv {errors[3]:.1e}; "
            f"sent intra {comm.send_bytes_intra} B, inter {comm.send_bytes_inter} B")
    lines = [None] * world
    dist.all_gather_object(lines, line)  # rank 0 prints every rank's line: no interleaving
    if rank == 0:
        print("\n".join(lines), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    if fallback_summary():
        print(fallback_summary(), flush=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free_port = s.getsockname()[1]
    mp.spawn(run, args=(4, free_port), nprocs=4)
