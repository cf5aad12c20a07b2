#!/usr/bin/env python
"""Benchmark context-parallel attention modes on CPU ranks (gloo); prints figures, asserts nothing.

For each mode it reports per rank: forward+backward wall and process-CPU time (median of
--repeats; on a shared machine compare CPU times),
bytes sent intra-/inter-node in one forward+backward, peak tracked live memory,
and the max error against an independent fp64 reference (per-document SDPA) on a
small problem. With --compare-deepspeed, DeepSpeed-Ulysses over SDPA runs the same problem (a
block-diagonal causal mask for packed batches) and the time ratio is printed: DeepSpeed's own
``DistributedAttention`` where DeepSpeed is installed, else the same algorithm written here
(``_UlyssesAllToAll``: DeepSpeed's all-to-all, SDPA, the all-to-all back; labelled as such).
--window N runs every mode with a causal sliding window of N tokens, and the ring key/value bytes
of the plan (``BatchPlan.stats``) are printed with and without it. --kv-forwarding turns on node-level
K/V forwarding (compare the inter-node bytes with and without it).

    python tools/bench_attention.py --ranks 4 --ranks-per-node 2 --seq-len 4096 --docs buckets
"""

from __future__ import annotations

import argparse
import importlib
import os
import socket
import statistics
import sys
import time
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_hsap.training.quiet import quiet_rank  # noqa: E402

quiet_rank(0)  # before Megatron-Core is imported (also in each spawned rank): its TE/Apex notices, once

from megatron_hsap.attention import context_parallel_attention  # noqa: E402
from megatron_hsap.config import KERNELS, ContextParallelConfig  # noqa: E402
from megatron_hsap.instrumentation import count_comm  # noqa: E402
from megatron_hsap.kernels import get_kernel  # noqa: E402
from megatron_hsap.instrumentation.memory import track_peak_memory  # noqa: E402
from megatron_hsap.reference import sdpa_reference  # noqa: E402
from megatron_hsap.parallel_state import destroy_model_parallel, initialize_model_parallel  # noqa: E402
from megatron_hsap.sequence.doc_lengths import (cu_seqlens_from_lengths, pack_lengths,  # noqa: E402
                                                sample_doc_lengths, stdlib_doc_lengths)
from megatron_hsap.sequence.plan import plan_batch  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def doc_lengths_for(kind: str, total: int, seed: int) -> List[int]:
    if kind == "single":
        return [total]
    if kind == "buckets":
        return sample_doc_lengths(total, seed=seed, max_doc_len=max(1, total // 4))
    if kind == "stdlib":
        return pack_lengths(stdlib_doc_lengths(), total, offset=seed)
    raise ValueError(f"--docs={kind!r} is not supported; allowed values: 'single', 'buckets', 'stdlib'")


def _time_fwd_bwd(fn, repeats: int) -> Tuple[float, float]:
    """Median wall and process-CPU seconds of ``fn``. The CPU time is what to compare on a shared
    machine: a rank waiting for a core does not count, a rank computing (or copying) does."""
    times, cpu_times = [], []
    for _ in range(repeats + 1):  # the first run warms caches and plans
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
    return statistics.median(times[1:]), statistics.median(cpu_times[1:])


def _bench_mode(args, mode: str, lengths: List[int]) -> Dict[str, float]:
    world = dist.get_world_size()
    ulysses = args.ulysses_size if mode in ("hybrid", "hsap") else None
    topo = initialize_model_parallel(context_parallel_size=world, ranks_per_node=args.ranks_per_node,
                                     cp_config=ContextParallelConfig(mode=mode, ulysses_size=ulysses,
                                                                     kernel=args.kernel,
                                                                     kv_forwarding=args.kv_forwarding))
    dtype = DTYPES[args.dtype]
    try:
        plan = plan_batch(cu_seqlens_from_lengths(lengths), topo, args.layout)
        gen = torch.Generator().manual_seed(dist.get_rank())
        t = plan.tokens_per_rank
        q = torch.randn(t, args.heads, args.head_dim, generator=gen).to(dtype).requires_grad_()
        k = torch.randn(t, args.kv_heads, args.head_dim, generator=gen).to(dtype).requires_grad_()
        v = torch.randn(t, args.kv_heads, args.head_dim, generator=gen).to(dtype).requires_grad_()

        window = (args.window, 0) if args.window else None

        def step():
            context_parallel_attention(q, k, v, plan, window_size=window).float().pow(2).sum().backward()

        seconds, cpu_seconds = _time_fwd_bwd(step, args.repeats)
        with count_comm() as comm, track_peak_memory() as mem:
            step()
        error = _check_error(topo, args, mode)
        return {"time_s": seconds, "cpu_s": cpu_seconds, "send_intra_MB": comm.send_bytes_intra / 2**20,
                "send_inter_MB": comm.send_bytes_inter / 2**20, "peak_MB": mem.peak_bytes / 2**20,
                "max_err": error, "ulysses": topo.ulysses_size, "padding": plan.num_padding_tokens}
    finally:
        destroy_model_parallel()


def _check_error(topo, args, mode: str) -> float:
    """Max abs error on a small packed fp64 problem against ``sdpa_reference`` (same on every rank)."""
    lengths = [37, 1, 0, 90, 5, 123]
    plan = plan_batch(cu_seqlens_from_lengths(lengths), topo, args.layout)
    gen = torch.Generator().manual_seed(7)
    total = sum(lengths)
    heads = max(args.heads // args.kv_heads, 1) * topo.ulysses_size
    q = torch.randn(total, heads, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(total, topo.ulysses_size, 16, generator=gen, dtype=torch.float64)
    v = torch.randn(total, topo.ulysses_size, 16, generator=gen, dtype=torch.float64)
    out = plan.unshard(context_parallel_attention(plan.shard(q), plan.shard(k), plan.shard(v), plan))
    return (out - sdpa_reference(q, k, v, lengths)).abs().max().item()


class _UlyssesAllToAll(torch.autograd.Function):
    """DeepSpeed's ``_SeqAllToAll`` for one tensor ``[s, b, h, d]``: scatter heads, gather the sequence
    (``scatter_idx=2, gather_idx=0``), or back; its backward is the inverse all-to-all."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, to_heads: bool) -> torch.Tensor:
        ctx.to_heads = to_heads
        return _seq_all_to_all(x, to_heads)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _seq_all_to_all(grad.contiguous(), not ctx.to_heads), None


def _seq_all_to_all(x: torch.Tensor, to_heads: bool) -> torch.Tensor:
    """``[s, b, h, d]`` -> ``[s * P, b, h / P, d]`` (to_heads) or the inverse, with one all_to_all_single."""
    world = dist.get_world_size()
    s, b, h, d = x.shape
    if to_heads:
        send = x.reshape(s, b, world, h // world, d).permute(2, 0, 1, 3, 4).contiguous()
        out = torch.empty_like(send)
        dist.all_to_all_single(out, send)
        return out.reshape(world * s, b, h // world, d)
    send = x.reshape(world, s // world, b, h, d).contiguous()
    out = torch.empty_like(send)
    dist.all_to_all_single(out, send)
    return out.permute(1, 2, 0, 3, 4).reshape(s // world, b, world * h, d)


def _bench_deepspeed(args, lengths: List[int]) -> Optional[Tuple[float, float, str]]:
    """DeepSpeed-Ulysses over SDPA on the same problem (contiguous split, block-diagonal causal mask):
    (wall s, cpu s, label); None where the problem does not fit it (MHA, divisible sizes, no window)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    total = sum(lengths)
    if total % world or args.heads % world or args.kv_heads != args.heads or args.window:
        return None
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    mask = (doc[:, None] == doc[None, :]).tril() if len(lengths) > 1 else None

    def local_attention(q, k, v, *unused_args, **unused_kwargs):  # [s, b, h, d] -> [s, b, h, d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return out.permute(2, 0, 1, 3)

    try:
        import deepspeed
        from deepspeed.sequence.layer import DistributedAttention
    except Exception:  # not installed, or fails to import here: the same algorithm, written above
        label = "DeepSpeed-Ulysses algorithm (built-in: all-to-all, SDPA, all-to-all)"

        def attention(q, k, v, batch_dim):
            heads = [_UlyssesAllToAll.apply(x, True) for x in (q, k, v)]
            return _UlyssesAllToAll.apply(local_attention(*heads), False)
    else:
        label = "DeepSpeed Ulysses DistributedAttention"
        # DeepSpeed's optional shared-memory all-reduce is compiled on first use (minutes of C++); its
        # Ulysses layer only uses all-to-all, so skip the build. (``deepspeed.comm.torch`` as an attribute
        # is the torch package itself, hence sys.modules.)
        importlib.import_module("deepspeed.comm.torch")
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
        deepspeed.init_distributed(dist_backend="gloo")  # reuses the existing process group
        attention = DistributedAttention(local_attention, dist.group.WORLD, scatter_idx=2, gather_idx=0)
    dtype = DTYPES[args.dtype]
    gen = torch.Generator().manual_seed(rank)
    s = total // world
    q, k, v = (torch.randn(s, 1, args.heads, args.head_dim, generator=gen).to(dtype).requires_grad_()
               for _ in range(3))
    wall, cpu = _time_fwd_bwd(lambda: attention(q, k, v, 1).float().pow(2).sum().backward(), args.repeats)
    return wall, cpu, label


def _ring_bytes(args, lengths: List[int]) -> None:
    """Print the ring's key/value bytes of one forward (``PlanStats.ring_send_bytes``, all ranks) without and
    with a causal window (--window, default 1/8 of the sequence), per mode."""
    from megatron_hsap.parallel_state import CPTopology

    window = args.window or args.seq_len // 8
    dtype = DTYPES[args.dtype]
    print(f"ring K/V bytes of one forward, all ranks (BatchPlan.stats, layout {args.layout}):")
    for mode in args.modes:
        ulysses = {"ring": 1, "ulysses": args.ranks}.get(mode, args.ulysses_size or args.ranks_per_node)
        plan = plan_batch(cu_seqlens_from_lengths(lengths), CPTopology.offline(args.ranks, ulysses, args.ranks_per_node),
                          args.layout)
        full, windowed = (sum(plan.stats(args.heads, args.kv_heads, args.head_dim, dtype, window_size=w).ring_send_bytes)
                          / 2**20 for w in (None, (window, 0)))
        print(f"  {mode:8} no window {full:9.2f} MB   window {window:>6}: {windowed:9.2f} MB")


def _worker(rank: int, args, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    lengths = doc_lengths_for(args.docs, args.seq_len, args.seed)
    results = {mode: _bench_mode(args, mode, lengths) for mode in args.modes}
    ds = _bench_deepspeed(args, lengths) if args.compare_deepspeed else None
    queue.put((rank, results, ds))
    dist.barrier()
    dist.destroy_process_group()


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--ranks-per-node", type=int, default=2, help="emulated node size (CPU ranks)")
    parser.add_argument("--modes", default="ring,ulysses,hybrid", help="comma-separated subset of ring,ulysses,hybrid")
    parser.add_argument("--ulysses-size", type=int, default=None, help="Ulysses degree for hybrid (default: node)")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--docs", default="single", choices=["single", "buckets", "stdlib"])
    parser.add_argument("--layout", default="zigzag", choices=["zigzag", "contiguous", "sequence-aware"])
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--kernel", default="auto", choices=KERNELS,
                        help="local attention kernel ('auto': cpu_fused on a machine without CUDA; 'torch': reference)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compare-deepspeed", action="store_true",
                        help="also time DeepSpeed-Ulysses wrapping SDPA (DeepSpeed's own where installed)")
    parser.add_argument("--window", type=int, default=0,
                        help="causal sliding window of this many tokens (0: none); ring bytes are printed either way")
    parser.add_argument("--kv-forwarding", action="store_true",
                        help="node-level K/V forwarding (ContextParallelConfig.kv_forwarding): acts where a node holds "
                             "several ring members (ring mode, or --ulysses-size below --ranks-per-node)")
    args = parser.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for mode in args.modes:
        if mode not in ("ring", "ulysses", "hybrid"):
            parser.error(f"--modes: {mode!r} is not one of ring, ulysses, hybrid")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, args, port, queue)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    rows = []
    while len(rows) < len(procs):
        try:
            rows.append(queue.get(timeout=5))
        except Exception:  # queue.Empty: check that no rank died
            failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if failed:
                for p in procs:
                    p.kill()
                raise SystemExit(f"bench_attention: rank(s) {failed} failed; see the traceback above")
    rows.sort(key=lambda row: row[0])
    for p in procs:
        p.join()
    lengths = doc_lengths_for(args.docs, args.seq_len, args.seed)
    print(f"# {args.ranks} ranks ({args.ranks_per_node} per node), seq {args.seq_len} ({len(lengths)} docs, "
          f"{args.docs}), heads {args.heads}/{args.kv_heads} x {args.head_dim}, {args.dtype}, layout {args.layout}, "
          f"{args.threads} thread(s)/rank, kernel {get_kernel(args.kernel).name}, median of {args.repeats}"
          + (f", causal window {args.window}" if args.window else "")
          + (", node-level K/V forwarding" if args.kv_forwarding else ""))
    print(f"{'mode':8} {'rank':>4} {'U':>2} {'fwd+bwd s':>10} {'cpu s':>7} {'intra MB':>9} {'inter MB':>9} "
          f"{'peak MB':>8} {'pad':>5} {'max err':>9}")
    for mode in args.modes:
        for rank, results, _ in rows:
            r = results[mode]
            print(f"{mode:8} {rank:>4} {r['ulysses']:>2} {r['time_s']:>10.3f} {r['cpu_s']:>7.3f} "
                  f"{r['send_intra_MB']:>9.2f} {r['send_inter_MB']:>9.2f} {r['peak_MB']:>8.1f} {r['padding']:>5} "
                  f"{r['max_err']:>9.1e}")
        intra, inter = (sum(results[mode][key] for _, results, _ in rows) for key in ("send_intra_MB", "send_inter_MB"))
        print(f"{mode:8} all ranks: intra {intra:.2f} MB, inter {inter:.2f} MB")
    ds_times = [ds for _, _, ds in rows]
    if all(t is not None for t in ds_times):
        ds_wall, ds_cpu = (max(t[i] for t in ds_times) for i in (0, 1))
        print(f"{ds_times[0][2]} (SDPA{', block-diagonal mask' if len(lengths) > 1 else ''}): "
              f"{ds_wall:.3f} s, cpu {ds_cpu:.3f} s (slowest rank)")
        for mode in args.modes:
            wall, cpu = (max(results[mode][key] for _, results, _ in rows) for key in ("time_s", "cpu_s"))
            print(f"time ratio {mode} / DeepSpeed-Ulysses: {wall / ds_wall:.2f} (cpu time {cpu / ds_cpu:.2f})")
    else:
        print("DeepSpeed-Ulysses comparison not run (needs --compare-deepspeed, MHA, heads/tokens divisible by the "
              "ranks, no --window)")
    _ring_bytes(args, lengths)


if __name__ == "__main__":
    main()
