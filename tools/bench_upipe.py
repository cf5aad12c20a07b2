"""Peak memory of one attention block per rank: UPipe (head-chunked attention) vs a Megatron-style baseline.

CPU gloo ranks run one attention block (fused QKV projection + RoPE + distributed
attention, forward and backward) and report per rank the peak live bytes allocated inside
the block (``track_peak_memory``; the input, weights and the output gradient exist before):

- ``baseline``: Megatron-style, a fused ``linear_qkv`` (F.linear over all heads), split into
  q/k/v, RoPE, then ``context_parallel_attention`` (Ulysses all-to-all + ring), autograd backward;
- ``U = H``: ``head_chunked_attention`` with one stage (plain Ulysses through the same op);
- every smaller valid head chunk U (a multiple of the Ulysses size dividing H);
- ``--megatron-modules``: the same comparison through Megatron-Core's modules, what a Megatron user
  runs: Megatron-Core's own ``SelfAttention`` (ColumnParallelLinear ``linear_qkv``, this project's
  ``HSAPCoreAttention`` as its ``core_attention``, RowParallelLinear ``linear_proj``) against
  ``HSAPSelfAttention`` built from ``get_gpt_layer_hsap_spec`` with head chunks of U. These rows include
  ``linear_proj`` and the weights' bf16 ``.grad`` (Megatron's modules without DDP), so compare them with
  each other, not with the rows above.

The weight gradient is written into a preallocated fp32 ``main_grad`` (as under Megatron's DDP),
so none of the rows includes a weight-sized gradient tensor. For every variant it also prints the ring
bytes the rank sent in the layer (measured, forward + backward: K/V, K/V again, dK/dV) and, for every U,
per stage (``predicted_stage_comm``): with head chunks a KV head crosses the ring once per layer, so the
per-layer figure equals the baseline's. Defaults are the issue's setup: H=32, H_kv=8,
d=32, hidden = H*d, bf16, 4 ranks, 4096 tokens per rank. CPU times are indicative only.

    PYTHONPATH=. .venv/bin/python tools/bench_upipe.py
    PYTHONPATH=. .venv/bin/python tools/bench_upipe.py --cp 8 --mode hsap --ranks-per-node 4 --tokens-per-rank 1024
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
import time
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_hsap.training.quiet import quiet_rank  # noqa: E402

quiet_rank(0)  # before Megatron-Core is imported (also in each spawned rank): its TE/Apex notices, once

BASELINE = "baseline"
MEGATRON_MODULE = "megatron-core SelfAttention"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, args: argparse.Namespace, port: int, queue) -> None:
    quiet_rank(rank)  # warnings from rank 0 only
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.cp,
                            timeout=datetime.timedelta(seconds=1800))
    try:
        queue.put((rank, _measure(args)))
    finally:
        from megatron_hsap.parallel_state import destroy_model_parallel

        destroy_model_parallel()
        dist.destroy_process_group()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Megatron's non-interleaved RoPE (``_apply_rotary_pos_emb_bshd``) on ``[t, h, d]``, differentiable."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def megatron_style_block(hidden: torch.Tensor, weight: torch.Tensor, plan, h: int, h_kv: int, d: int,
                         angles: torch.Tensor) -> torch.Tensor:
    """hidden ``[t, 1, hidden]`` -> ``[t, 1, H*d]``: Megatron's fused linear_qkv, its q/k/v split
    (``get_query_key_value_tensors``), RoPE, ``context_parallel_attention``."""
    from megatron_hsap.attention import context_parallel_attention

    t, g = hidden.shape[0], h // h_kv
    mixed = torch.nn.functional.linear(hidden[:, 0], weight).view(t, h_kv, (g + 2) * d)
    q, k, v = torch.split(mixed, [g * d, d, d], dim=2)
    q = q.reshape(t, h, d)
    cos, sin = angles.cos().to(hidden.dtype)[:, None], angles.sin().to(hidden.dtype)[:, None]
    out = context_parallel_attention(_rotate(q, cos, sin), _rotate(k, cos, sin), v, plan, causal=True)
    return out.reshape(t, 1, h * d)


def _ring_bytes_sent_since(before) -> int:
    """Bytes this rank sent on the ring (K/V, dK/dV, relays) since the ``comm_stats()`` snapshot ``before``."""
    from megatron_hsap.instrumentation.comm import comm_stats

    return sum(v for (op, _where), v in comm_stats().minus(before).sent.items() if op.startswith("ring"))


def _measure(args: argparse.Namespace) -> Dict[str, Dict[str, float]]:
    from megatron_hsap.attention.upipe import head_chunked_attention, predicted_stage_comm, resolve_head_schedule
    from megatron_hsap.attention.upipe import rope_angles
    from megatron_hsap.config import ContextParallelConfig
    from megatron_hsap.instrumentation.comm import comm_stats
    from megatron_hsap.instrumentation.memory import track_peak_memory
    from megatron_hsap.parallel_state import initialize_model_parallel
    from megatron_hsap.sequence.doc_lengths import cu_seqlens_from_lengths
    from megatron_hsap.sequence.plan import plan_batch

    h, h_kv, d = args.heads, args.kv_heads, args.head_dim
    hidden_size = args.hidden or h * d
    dtype = getattr(torch, args.dtype)
    topo = initialize_model_parallel(context_parallel_size=args.cp, ranks_per_node=args.ranks_per_node,
                                     cp_config=ContextParallelConfig(mode=args.mode, ulysses_size=args.ulysses,
                                                                     kernel="torch"))
    plan = plan_batch(cu_seqlens_from_lengths([args.tokens_per_rank * args.cp]), topo, "zigzag")
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(plan.tokens_per_rank, 1, hidden_size, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn((h // h_kv + 2) * h_kv * d, hidden_size, generator=gen) * hidden_size ** -0.5
              ).to(dtype).requires_grad_()
    weight.main_grad = torch.zeros(weight.shape, dtype=torch.float32)
    weight.grad_added_to_main_grad = False
    dout = torch.randn(plan.tokens_per_rank, 1, h * d, generator=gen).to(dtype)
    angles = rope_angles(plan.position_ids, d)
    p = topo.ulysses_size
    chunks = [h] + [u for u in range(h - p, 0, -p) if h % u == 0 and (not args.head_chunks or u in args.head_chunks)]
    results: Dict[str, Dict[str, float]] = {}
    for u in [BASELINE] + chunks:
        dist.barrier()
        start = time.perf_counter()
        before = comm_stats()
        with track_peak_memory("cpu") as mem:
            if u == BASELINE:
                out = megatron_style_block(hidden, weight, plan, h, h_kv, d, angles)
            else:
                out = head_chunked_attention(hidden, weight, None, plan, num_heads_q=h, num_heads_kv=h_kv,
                                             head_dim=d, rotary_freqs=angles, head_chunk_size=u)
            out.backward(dout)
            del out
            if weight.grad is not None and u == BASELINE:  # DDP's hook: add into main_grad, drop .grad
                weight.main_grad += weight.grad
            weight.grad = None
        dist.barrier()
        seconds = time.perf_counter() - start
        hidden.grad = None
        weight.grad_added_to_main_grad = False
        ring_layer = _ring_bytes_sent_since(before)
        ring = 0
        if u != BASELINE:
            schedule = resolve_head_schedule(plan, h, h_kv, u)
            stages = predicted_stage_comm(schedule, plan, d, dtype)
            ring = sum(v for fwd, bwd in stages for (op, _where), v in (*fwd.items(), *bwd.items())
                       if op.startswith("ring")) / len(stages)
        results[str(u)] = {"seconds": seconds, "peak_bytes": mem.peak_bytes, "ring_bytes_per_stage": ring,
                           "ring_bytes_per_layer": ring_layer}
    if args.megatron_modules:
        results.update(_measure_megatron_modules(args, plan, hidden.detach(), dout, chunks))
    return results


def _megatron_attention(args: argparse.Namespace, head_chunk_size: Optional[int]) -> torch.nn.Module:
    """Megatron-Core's ``SelfAttention`` with HSAP's core attention (``head_chunk_size`` None), else
    ``HSAPSelfAttention`` from the HSAP layer spec with head chunks of ``head_chunk_size``."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_hsap.config import ContextParallelConfig
    from megatron_hsap.megatron import get_gpt_layer_hsap_spec
    from megatron_hsap.megatron.attention import HSAPCoreAttention
    from megatron_hsap.megatron.cpu_shim import cpu_config_overrides

    dtype = getattr(torch, args.dtype)
    config = TransformerConfig(
        num_layers=1, hidden_size=args.hidden or args.heads * args.head_dim, num_attention_heads=args.heads,
        num_query_groups=args.kv_heads, kv_channels=args.head_dim, add_bias_linear=False, attention_dropout=0.0,
        hidden_dropout=0.0, params_dtype=dtype, bf16=dtype == torch.bfloat16, gradient_accumulation_fusion=False,
        apply_rope_fusion=False, **cpu_config_overrides())
    torch.manual_seed(0)
    if head_chunk_size is None:
        submodules = SelfAttentionSubmodules(linear_qkv=ColumnParallelLinear, core_attention=HSAPCoreAttention,
                                             linear_proj=RowParallelLinear)
        return SelfAttention(config, submodules, layer_number=1, attn_mask_type=AttnMaskType.causal)
    cp_config = ContextParallelConfig(mode=args.mode, ulysses_size=args.ulysses, kernel="torch",
                                      head_chunk_size=head_chunk_size)
    spec = get_gpt_layer_hsap_spec(cp_config).submodules.self_attention
    return build_module(spec, config=config, layer_number=1)


def _measure_megatron_modules(args: argparse.Namespace, plan, hidden: torch.Tensor, dout: torch.Tensor,
                              chunks: List[int]) -> Dict[str, Dict[str, float]]:
    """Peak bytes and ring bytes of one fwd+bwd of each Megatron-Core module variant (see the module docstring).

    hidden ``[t_local, 1, hidden]``, dout ``[t_local, 1, H*d]``: this rank's tokens in plan order.
    """
    from megatron_hsap.instrumentation.comm import comm_stats
    from megatron_hsap.instrumentation.memory import track_peak_memory
    from megatron_hsap.megatron.attention import HSAPPackedSeqParams

    from megatron_hsap.attention.upipe import rope_angles

    positions = plan.position_ids.long()
    table = rope_angles(torch.arange(int(positions.max()) + 1), args.head_dim)[:, None, None, :]  # GPTModel's
    packed = HSAPPackedSeqParams(plan=plan, qkv_format="sbhd")
    results: Dict[str, Dict[str, float]] = {}
    for u in [None] + chunks:
        module = _megatron_attention(args, u)
        # Megatron's SelfAttention applies the table row by row; HSAPSelfAttention gathers it at the positions
        rotary = table[positions] if u is None else table
        x = hidden.clone().requires_grad_()
        dist.barrier()
        start = time.perf_counter()
        before = comm_stats()
        with track_peak_memory("cpu") as mem:
            out, _ = module(x, None, rotary_pos_emb=rotary, packed_seq_params=packed)
            out.backward(dout[:, :, :out.shape[-1]])  # linear_proj's output: [t_local, 1, hidden]
            del out
        dist.barrier()
        ring_layer = _ring_bytes_sent_since(before)
        key = MEGATRON_MODULE if u is None else f"{MEGATRON_MODULE} U={u}"
        results[key] = {"seconds": time.perf_counter() - start, "peak_bytes": mem.peak_bytes,
                        "ring_bytes_per_stage": 0, "ring_bytes_per_layer": ring_layer}
        del module, x
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=32, help="H: query heads")
    parser.add_argument("--kv-heads", type=int, default=8, help="H_kv: KV heads")
    parser.add_argument("--head-dim", type=int, default=32, help="d")
    parser.add_argument("--hidden", type=int, default=None, help="hidden size (default H*d)")
    parser.add_argument("--tokens-per-rank", type=int, default=4096, help="t_local (one document of cp*t_local)")
    parser.add_argument("--cp", type=int, default=4, help="CP ranks to spawn")
    parser.add_argument("--mode", choices=("ulysses", "hybrid", "hsap"), default="ulysses")
    parser.add_argument("--ulysses", type=int, default=None, help="Ulysses size (default: the mode's)")
    parser.add_argument("--ranks-per-node", type=int, default=None, help="emulated node size (default: all)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32", "float64"), default="bfloat16")
    parser.add_argument("--head-chunks", type=int, nargs="*", default=None,
                        help="the U < H to measure (default: every valid one)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--megatron-modules", action="store_true",
                        help="also measure Megatron-Core's SelfAttention (HSAP core attention) against "
                             "HSAPSelfAttention with head chunks (rows include linear_proj)")
    args = parser.parse_args()
    for name in ("heads", "kv_heads", "head_dim", "tokens_per_rank", "cp", "threads"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")

    port = _free_port()
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank_main, args=(args, port, queue), nprocs=args.cp, join=True)
    per_rank: Dict[int, Dict[str, Dict[str, float]]] = dict(queue.get() for _ in range(args.cp))

    h = args.heads
    print(f"# H={h} H_kv={args.kv_heads} d={args.head_dim} hidden={args.hidden or h * args.head_dim} {args.dtype}; "
          f"{args.tokens_per_rank} tokens per rank on {args.cp} ranks (mode {args.mode}); fwd+bwd of one attention "
          f"block; weight gradient into a preallocated fp32 main_grad"
          + ("; Megatron-Core module rows: linear_proj and the weights' bf16 .grad included" if args.megatron_modules
             else ""))
    print("| rank | variant | stages | peak bytes | MiB | vs baseline | vs U=H | ring bytes sent per layer "
          "| per stage (predicted) | time s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows: List[Tuple[int, str]] = [(r, k) for r in sorted(per_rank) for k in per_rank[r]]
    for rank, key in rows:
        res = per_rank[rank][key]
        if key.startswith(MEGATRON_MODULE):  # compared with Megatron-Core's own SelfAttention (module rows)
            base, full = per_rank[rank][MEGATRON_MODULE]["peak_bytes"], None
            label = "Megatron-Core SelfAttention" if key == MEGATRON_MODULE else f"HSAPSelfAttention {key.split()[-1]}"
            stages = "-" if key == MEGATRON_MODULE else str(h // int(key.split("=")[-1]))
        else:
            base, full = per_rank[rank][BASELINE]["peak_bytes"], per_rank[rank][str(h)]["peak_bytes"]
            label = "Megatron-style baseline" if key == BASELINE else f"U={key}"
            stages = "-" if key == BASELINE else str(h // int(key))
        ring = "-" if key == BASELINE or full is None else f"{res['ring_bytes_per_stage']:,.0f}"
        vs_full = "-" if full is None else f"{res['peak_bytes'] / full:.3f}"
        print(f"| {rank} | {label} | {stages} | {res['peak_bytes']:,} | {res['peak_bytes'] / 2**20:.1f} "
              f"| {res['peak_bytes'] / base:.3f} | {vs_full} | {res['ring_bytes_per_layer']:,.0f} "
              f"| {ring} | {res['seconds']:.1f} |")


if __name__ == "__main__":
    main()
