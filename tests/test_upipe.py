"""UPipe (``head_chunked_attention``) against ordinary multi-head attention with the same weights, on gloo ranks.

The reference, written here independently of the package, projects the global packed
batch with the full fused QKV weight (Megatron's per-group [q..., k, v] row order),
applies rotate-half RoPE from in-document positions and runs dense document-causal
float64 attention (tests/reference.py). UPipe must give the same output, input
gradient, QKV weight gradient and bias gradient, with and without tensor parallelism
(emulated: each TP rank's weight shard is a separate call; outputs concatenate, input
gradients sum, weight gradients concatenate, as Megatron's ColumnParallelLinear does).
Each launch also checks every stage's measured bytes against ``predicted_stage_comm``.
"""

from __future__ import annotations

import itertools
from typing import Dict, List, Optional, Tuple

import pytest
import torch

from tests.distributed import run_distributed
from tests.reference import dense_attention, hard_cases

HIDDEN, HEAD_DIM = 24, 8
TOL = {torch.float64: 1e-10, torch.float32: 2e-5}  # any schedule or permutation bug is O(1)


def _rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotate-half RoPE on ``x [T, h, d]`` (Megatron's non-interleaved convention, fp32 angles)."""
    d = x.shape[-1]
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = positions.to(torch.float32)[:, None] * inv[None, :]
    ang = torch.cat((ang, ang), dim=-1)[:, None, :]
    half = d // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * ang.cos().to(x.dtype) + rotated * ang.sin().to(x.dtype)


def reference_attention_block(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, num_heads_q: int,
                              num_heads_kv: int, lengths: List[int]) -> torch.Tensor:
    """x ``[T, hidden]`` (global packed batch) -> core-attention output ``[T, H * d]`` (dense, float64)."""
    from megatron_hsap.sequence.doc_lengths import cu_seqlens_from_lengths

    total, g, d = x.shape[0], num_heads_q // num_heads_kv, HEAD_DIM
    mixed = (x @ weight.t() + bias).view(total, num_heads_kv, g + 2, d)
    q = mixed[:, :, :g].reshape(total, num_heads_q, d)
    k, v = mixed[:, :, g], mixed[:, :, g + 1]
    positions = torch.cat([torch.arange(n) for n in lengths]) if lengths else torch.zeros(0, dtype=torch.long)
    out = dense_attention(_rope(q, positions), _rope(k, positions), v, cu_seqlens_from_lengths(lengths), causal=True)
    return out.reshape(total, num_heads_q * d)


def _tp_rows(num_heads_q: int, num_heads_kv: int, tp: int, tp_rank: int) -> slice:
    """Megatron's ColumnParallelLinear shard of the fused QKV rows: whole KV groups, contiguous."""
    per_group = (num_heads_q // num_heads_kv + 2) * HEAD_DIM
    groups = num_heads_kv // tp
    return slice(tp_rank * groups * per_group, (tp_rank + 1) * groups * per_group)


def _measured_sent(stats) -> Dict[Tuple[str, str], int]:
    return {k: v for k, v in stats.sent.items() if v}


def _ring_bytes(stages) -> Dict[Tuple[str, str], int]:
    """Ring bytes ({(op, intra|inter): bytes}) of a layer, summed over stages, forward and backward."""
    total: Dict[Tuple[str, str], int] = {}
    for fwd, bwd in stages:
        for (op, where), n in (*fwd.items(), *bwd.items()):
            if op.startswith("ring"):
                total[(op, where)] = total.get((op, where), 0) + n
    return total


def upipe_case(plan, seed: int, h: int, h_kv: int, u: Optional[int], tp: int, dtype: torch.dtype
               ) -> Dict[str, float]:
    """One ``head_chunked_attention`` fwd + bwd (TP emulated by ``tp`` weight shards) on ``plan``'s batch against
    the dense reference. Returns {"error": error / TOL[dtype] (rank 0 only), "bytes": 0.0 when every stage's
    measured bytes equal ``predicted_stage_comm``, "padding": sum of |output| + |input grad| on padding slots;
    with a ring, "ring": 0.0 when the layer's ring bytes equal those of one stage of all heads (a KV head
    crosses the ring once per layer), "ring_bytes": those bytes}."""
    import torch.distributed as dist

    from megatron_hsap.attention.upipe import head_chunked_attention, predicted_stage_comm, resolve_head_schedule

    lengths = list(plan.doc_lengths)
    total, g = sum(lengths), h // h_kv
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(total, HIDDEN, generator=gen, dtype=torch.float64)
    weight = torch.randn((g + 2) * h_kv * HEAD_DIM, HIDDEN, generator=gen, dtype=torch.float64) * HIDDEN ** -0.5
    bias = torch.randn(weight.shape[0], generator=gen, dtype=torch.float64) * 0.1
    dout = torch.randn(total, h * HEAD_DIM, generator=gen, dtype=torch.float64)

    hidden = plan.shard(x).unsqueeze(1).to(dtype).requires_grad_()
    shards = [(weight[_tp_rows(h, h_kv, tp, r)].to(dtype).requires_grad_(),
               bias[_tp_rows(h, h_kv, tp, r)].to(dtype).requires_grad_()) for r in range(tp)]
    outs, logs = [], []
    for w_r, b_r in shards:
        logs.append([])
        outs.append(head_chunked_attention(hidden, w_r, b_r, plan, num_heads_q=h // tp, num_heads_kv=h_kv // tp,
                                           head_dim=HEAD_DIM, head_chunk_size=u, comm_log=logs[-1]))
    out = torch.cat(outs, dim=-1)
    out.backward(plan.shard(dout).unsqueeze(1).to(dtype))

    schedule = resolve_head_schedule(plan, h // tp, h_kv // tp, u)
    predicted = predicted_stage_comm(schedule, plan, HEAD_DIM, dtype)
    bytes_ok = all(len(log) == 2 * len(predicted) for log in logs)
    for log in logs:
        for direction, stage, stats in log:
            bytes_ok &= _measured_sent(stats) == predicted[stage][direction == "backward"]
    valid = plan.valid_mask
    result = {"bytes": 0.0 if bytes_ok else 1e9,
              "padding": float(out.detach()[~valid].abs().sum() + hidden.grad[~valid].abs().sum())}
    if plan.topology.ring_size > 1:  # head chunks move exactly the ring bytes of one stage of all heads
        one_stage = resolve_head_schedule(plan, h // tp, h_kv // tp, h // tp)
        ring = [_ring_bytes(predicted_stage_comm(sch, plan, HEAD_DIM, dtype)) for sch in (schedule, one_stage)]
        result["ring"] = 0.0 if ring[0] == ring[1] else 1e9
        result["ring_bytes"] = float(sum(ring[0].values()))
        result["relay_bytes"] = float(sum(n for (op, _), n in ring[0].items() if "relay" in op))
    d_weight = torch.cat([w.grad for w, _ in shards])
    d_bias = torch.cat([b.grad for _, b in shards])
    dist.all_reduce(d_weight)
    dist.all_reduce(d_bias)
    got = [plan.unshard(out[:, 0]), plan.unshard(hidden.grad[:, 0]), d_weight, d_bias]
    if plan.topology.cp_rank == 0:
        ref_in = [t.clone().requires_grad_() for t in (x, weight, bias)]
        ref = reference_attention_block(*ref_in, h, h_kv, lengths)
        ref.backward(dout)
        want = [ref.detach()] + [t.grad for t in ref_in]
        result["error"] = max((a.double() - b).abs().max().item() for a, b in zip(got, want)) / TOL[dtype]
    return result


def _run_cases(mode: str, ulysses_size: int, ranks_per_node: int, cases: List[Tuple],
               kv_forwarding: bool = False) -> Dict[str, float]:
    """cases: (H, H_kv, U or None for the config default, tp, hard case name[, dtype (default float64)]).

    Returns {case: error / TOL[dtype]} (rank 0) and per-rank bytes/padding flags (0.0 = fine)."""
    import torch.distributed as dist

    from megatron_hsap.attention.upipe import resolve_head_schedule
    from megatron_hsap.config import ContextParallelConfig
    from megatron_hsap.parallel_state import initialize_model_parallel
    from megatron_hsap.sequence.doc_lengths import cu_seqlens_from_lengths
    from megatron_hsap.sequence.plan import plan_batch

    cp = dist.get_world_size()
    topo = initialize_model_parallel(context_parallel_size=cp, ranks_per_node=ranks_per_node,
                                     cp_config=ContextParallelConfig(mode=mode, ulysses_size=ulysses_size,
                                                                     kernel="cpu_fused", kv_forwarding=kv_forwarding))
    assert topo.ulysses_size == ulysses_size
    assert topo.ring_members_share_nodes() or not kv_forwarding
    results: Dict[str, float] = {}
    layouts = itertools.cycle(("zigzag", "sequence-aware", "contiguous"))
    for i, (h, h_kv, u, tp, name, *rest) in enumerate(cases):
        dtype = rest[0] if rest else torch.float64
        layout = next(layouts)
        plan = plan_batch(cu_seqlens_from_lengths(hard_cases(cp)[name]), topo, layout)
        key = f"H{h}/Hkv{h_kv}/P{ulysses_size}/U{u}/tp{tp}/{name}/{layout}/{str(dtype)[6:]}"
        if u is None:
            assert mode == "hsap" and resolve_head_schedule(plan, h // tp, h_kv // tp, u).head_chunk_size == \
                ulysses_size
        result = upipe_case(plan, i, h, h_kv, u, tp, dtype)
        for name, value in result.items():
            results[key if name == "error" else f"{key}/{name}"] = value
    return results


# (H, H_kv, U, tp, hard case): MHA, GQA with H_kv > P, = P, < P (replicated), U = P and larger multiples.
CASES_P4 = [(16, 16, 4, 1, "one_long_many_short"), (16, 16, 8, 2, "crosses_all_boundaries"),
            (16, 4, 4, 1, "long_tail_sampled"), (16, 4, 8, 2, "length_one_and_zero"),
            (32, 8, 4, 1, "crosses_several_boundaries"), (32, 8, 8, 2, "single_document"),
            (32, 8, 16, 1, "not_divisible_by_2c"),
            (16, 2, 4, 1, "total_not_divisible_by_c"), (16, 2, 8, 2, "only_short"),
            (16, 1, 4, 1, "boundaries_on_shard_edges"), (16, 1, 16, 1, "one_long_many_short"),
            (32, 8, 4, 2, "long_tail_sampled", torch.float32)]
CASES_P2 = [(12, 4, 2, 1, "long_tail_sampled"), (12, 4, 4, 1, "crosses_all_boundaries"),
            (12, 4, 6, 2, "length_one_and_zero"), (12, 4, 2, 2, "one_long_many_short"),
            (12, 4, 12, 1, "not_divisible_by_2c"), (12, 4, 6, 1, "only_short", torch.float32)]
CASES_P8 = [(64, 16, 8, 1, "crosses_all_boundaries"), (64, 16, 16, 2, "long_tail_sampled")]
# U = None: the hsap config default, U = P.
CASES_P4_RING2 = [(16, 4, None, 1, "crosses_several_boundaries"), (32, 8, 8, 2, "long_tail_sampled"),
                  (16, 2, 4, 2, "one_long_many_short"), (16, 1, 8, 1, "crosses_all_boundaries")]

# Node-level K/V forwarding with head chunks: 2 nodes x 2 ring members (Ulysses pairs); relayed rows kept
# across stages like received ones (some stages bring no new KV head, some finish none).
CASES_P2_FORWARDING = [(12, 4, 2, 1, "long_tail_sampled"), (12, 4, 6, 1, "crosses_all_boundaries"),
                       (12, 4, 12, 1, "one_long_many_short"), (16, 2, 4, 2, "crosses_several_boundaries"),
                       (12, 4, 2, 1, "long_tail_sampled", torch.float32)]

LAUNCHES = [  # (world size, mode, Ulysses size, ranks per node, cases, node-level K/V forwarding)
    (4, "ulysses", 4, 4, CASES_P4, False),
    (4, "hybrid", 2, 2, CASES_P2, False),           # Ulysses 2 inside a node, ring 2 across
    (8, "ulysses", 8, 8, CASES_P8, False),
    (8, "hsap", 4, 4, CASES_P4_RING2, False),       # Ulysses 4 inside a node, ring 2 across
    (8, "hsap", 2, 4, CASES_P2_FORWARDING, True),   # Ulysses 2, ring of 4 over 2 nodes, forwarding
]


@pytest.mark.parametrize("world_size,mode,ulysses_size,ranks_per_node,cases,kv_forwarding", LAUNCHES,
                         ids=[f"cp{w}-{m}-u{u}" + ("-kv_forwarding" if f else "") for w, m, u, _, _, f in LAUNCHES])
def test_matches_dense_multi_head_attention(world_size, mode, ulysses_size, ranks_per_node, cases, kv_forwarding):
    results = run_distributed(_run_cases, world_size, mode, ulysses_size, ranks_per_node, cases, kv_forwarding,
                              timeout=600)
    checked = [k for k in results[0] if not k.endswith(("/bytes", "/padding", "/ring", "/ring_bytes", "/relay_bytes"))]
    assert len(checked) == len(cases)
    bad = {k: v for k, v in results[0].items() if k in checked and not v <= 1.0}
    assert not bad, f"output/input grad/weight grad/bias grad error over {TOL}, as multiples of the dtype's: {bad}"
    for rank, res in enumerate(results):
        broken = {k: v for k, v in res.items() if k.endswith(("/bytes", "/padding", "/ring")) and v != 0.0}
        assert not broken, (f"rank {rank}: measured bytes != predicted_stage_comm, nonzero padding, or head chunks "
                            f"move more ring bytes than one stage of all heads: {broken}")
    if mode in ("hybrid", "hsap"):  # the ring comparison ran and had bytes to compare
        assert sum(v for res in results for k, v in res.items() if k.endswith("/ring_bytes")) > 0
    if kv_forwarding:  # rows were relayed inside the nodes
        assert sum(v for res in results for k, v in res.items() if k.endswith("/relay_bytes")) > 0


def _layer_bytes_by_head_chunk(shapes: List[Tuple[int, int]], head_chunk_sizes: List[int]) -> Dict[str, int]:
    """Measured all-to-all bytes this rank sends in one layer's attention block, forward and backward, per
    (H, H_kv) shape and head chunk U; also the number of stages each ran."""
    import torch.distributed as dist

    from megatron_hsap.attention.upipe import head_chunked_attention
    from megatron_hsap.config import ContextParallelConfig
    from megatron_hsap.parallel_state import initialize_model_parallel
    from megatron_hsap.sequence.doc_lengths import cu_seqlens_from_lengths
    from megatron_hsap.sequence.plan import plan_batch

    topo = initialize_model_parallel(context_parallel_size=dist.get_world_size(), cp_config=ContextParallelConfig(
        mode="ulysses", kernel="cpu_fused"))
    plan = plan_batch(cu_seqlens_from_lengths(hard_cases(topo.cp_size)["long_tail_sampled"]), topo, "zigzag")
    measured: Dict[str, int] = {}
    for (h, h_kv), u in itertools.product(shapes, head_chunk_sizes):
        u = min(u, h)
        gen = torch.Generator().manual_seed(h + h_kv)
        hidden = torch.randn(plan.tokens_per_rank, 1, HIDDEN, generator=gen).requires_grad_()
        weight = torch.randn((h // h_kv + 2) * h_kv * HEAD_DIM, HIDDEN, generator=gen).requires_grad_()
        log: list = []
        out = head_chunked_attention(hidden, weight, None, plan, num_heads_q=h, num_heads_kv=h_kv,
                                     head_dim=HEAD_DIM, head_chunk_size=u, comm_log=log)
        out.sum().backward()
        for direction in ("forward", "backward"):
            sent = [stats for d, _, stats in log if d == direction]
            measured[f"H{h}/Hkv{h_kv}/U{u}/{direction}"] = sum(sum(s.sent.values()) for s in sent)
            measured[f"H{h}/Hkv{h_kv}/U{u}/stages"] = len(sent)
    return measured


def test_kv_sent_once_per_group():
    """Measured bytes: chunking the heads into stages (U = P) sends exactly the bytes of one stage of all heads
    (U = H), forward and backward, on every rank -- so a KV head shared by several stages crosses the all-to-all
    once, not once per stage. GQA with H_kv > P, = P, < P (replicated) and MQA."""
    shapes = [(32, 8), (16, 4), (16, 2), (16, 1)]
    for rank, measured in enumerate(run_distributed(_layer_bytes_by_head_chunk, 4, shapes, [4, 64])):
        for h, h_kv in shapes:
            chunked, whole = f"H{h}/Hkv{h_kv}/U4", f"H{h}/Hkv{h_kv}/U{h}"
            assert measured[f"{chunked}/stages"] == h // 4 and measured[f"{whole}/stages"] == 1
            for direction in ("forward", "backward"):
                assert measured[f"{chunked}/{direction}"] == measured[f"{whole}/{direction}"] > 0, \
                    (rank, h, h_kv, direction, measured)


def _memory_case(head_chunk_sizes: List[int]) -> Dict[str, int]:
    """Peak live bytes of one attention block's fwd + bwd per variant: the Megatron-style baseline
    (tools/bench_upipe.py's fused linear_qkv + Ulysses attention) and ``head_chunked_attention`` at each U;
    the weight gradient goes into a preallocated fp32 main_grad in every variant (as under Megatron's DDP)."""
    import torch.distributed as dist

    from megatron_hsap.attention.upipe import head_chunked_attention, rope_angles
    from megatron_hsap.config import ContextParallelConfig
    from megatron_hsap.instrumentation.memory import track_peak_memory
    from megatron_hsap.parallel_state import initialize_model_parallel
    from megatron_hsap.sequence.doc_lengths import cu_seqlens_from_lengths
    from megatron_hsap.sequence.plan import plan_batch
    from tools.bench_upipe import megatron_style_block

    cp = dist.get_world_size()
    topo = initialize_model_parallel(context_parallel_size=cp, cp_config=ContextParallelConfig(
        mode="ulysses", kernel="torch"))
    h, h_kv, d, total = MEMORY_SHAPE
    plan = plan_batch(cu_seqlens_from_lengths([total // 2, total // 4, total // 4]), topo, "zigzag")
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16
    hidden = torch.randn(plan.tokens_per_rank, 1, h * d, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn((h // h_kv + 2) * h_kv * d, h * d, generator=gen) * 0.05).to(dtype).requires_grad_()
    weight.main_grad = torch.zeros(weight.shape)
    dout = torch.randn(plan.tokens_per_rank, 1, h * d, generator=gen).to(dtype)
    angles = rope_angles(plan.position_ids, d)
    peaks = {}
    for u in ["baseline"] + head_chunk_sizes:
        weight.grad_added_to_main_grad = False
        with track_peak_memory("cpu") as tracker:
            if u == "baseline":
                out = megatron_style_block(hidden, weight, plan, h, h_kv, d, angles)
            else:
                out = head_chunked_attention(hidden, weight, None, plan, num_heads_q=h, num_heads_kv=h_kv,
                                             head_dim=d, rotary_freqs=angles, head_chunk_size=u)
            out.backward(dout)
            del out
            if u == "baseline":  # DDP's hook: into main_grad
                weight.main_grad += weight.grad
            weight.grad = None
        hidden.grad = None
        peaks[str(u)] = tracker.peak_bytes
    assert topo.ulysses_size == 4
    return peaks


# H, H_kv, d, total tokens; hidden = H * d, bf16 (the realistic shape: the input is as wide as the heads).
MEMORY_SHAPE = (32, 8, 16, 2048)


def test_peak_memory_follows_head_chunk():
    """Peak live bytes of one layer's attention block fwd+bwd in bf16 at hidden = H*d, 4 ranks: U = P = 4 vs
    U = H = 32 (plain Ulysses through the same op) and vs the Megatron-style baseline.

    The test prints the measured peaks; docs/upipe.md ("Memory") quotes tools/bench_upipe.py's figures.
    """
    peaks = run_distributed(_memory_case, 4, [4, 32], timeout=600)
    for rank, peak in enumerate(peaks):
        vs_full, vs_base = peak["4"] / peak["32"], peak["4"] / peak["baseline"]
        print(f"rank {rank}: {peak}, U=4 / U=H {vs_full:.3f}, U=4 / baseline {vs_base:.3f}")
        assert vs_full <= 0.30 and vs_base <= 0.35, (rank, peak)


def _error_paths() -> List[str]:
    import torch.distributed as dist

    from megatron_hsap.attention.upipe import head_chunked_attention
    from megatron_hsap.config import ContextParallelConfig
    from megatron_hsap.parallel_state import initialize_model_parallel
    from megatron_hsap.sequence.doc_lengths import cu_seqlens_from_lengths
    from megatron_hsap.sequence.plan import plan_batch

    topo = initialize_model_parallel(context_parallel_size=dist.get_world_size(),
                                     cp_config=ContextParallelConfig(mode="ulysses", kernel="cpu_fused"))
    plan = plan_batch(cu_seqlens_from_lengths([40, 24]), topo, "zigzag")
    t = plan.tokens_per_rank

    def call(h: int, h_kv: int, u: Optional[int], b: int = 1) -> None:
        weight = torch.zeros((h // max(h_kv, 1) + 2) * h_kv * HEAD_DIM, HIDDEN)
        head_chunked_attention(torch.zeros(t, b, HIDDEN), weight, None, plan, num_heads_q=h, num_heads_kv=h_kv,
                               head_dim=HEAD_DIM, head_chunk_size=u)

    messages = []
    for args, pattern in (((16, 4, 6), "multiple of ulysses_size=4"), ((16, 4, 20), "allowed values: [4, 8, 12, 16]"),
                          ((16, 3, 4), "num_heads_q=16 must be a multiple of num_heads_kv=3"),
                          ((16, 4, 4, 2), "batch size b=2")):
        try:
            call(*args)
        except ValueError as e:
            assert pattern in str(e), (args, str(e))
            messages.append(str(e))
        else:
            raise AssertionError(f"{args} did not raise")
    dist.barrier()  # every rank got here: no rank entered a collective the others skipped
    return messages


def test_error_paths_before_any_collective():
    messages = run_distributed(_error_paths, 4, timeout=120)
    assert len(messages[0]) == 4
    assert "allowed values: [4, 8, 12, 16]" in messages[0][0]


def test_default_rope_matches_megatron():
    """The op's default RoPE (angles from plan.position_ids) is Megatron's RotaryEmbedding + apply_rotary_pos_emb
    (non-interleaved), bit for bit, and the test reference above agrees; the backward uses its exact adjoint."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_hsap.attention.upipe import _Rope, rope_angles

    d, t, h = 16, 37, 3
    positions = torch.tensor([0, 5, 1, 36, 2, 0, 7] * 5 + [3, 4])
    table = RotaryEmbedding(kv_channels=d, rotary_percent=1.0, use_cpu_initialization=True)
    emb = table.get_freqs_non_repeated(64)
    emb = torch.cat((emb, emb), dim=-1)[positions]  # what get_emb builds, indexed by in-document positions
    assert torch.equal(rope_angles(positions, d), emb)
    x = torch.randn(t, 1, h, d, dtype=torch.float64)
    want = _apply_rotary_pos_emb_bshd(x, emb[:, None, None, :])
    got = x.clone()
    _Rope(rope_angles(positions, d), x.dtype).apply_(got)
    assert torch.equal(got, want)
    assert torch.equal(_rope(x[:, 0], positions), want[:, 0])
    g = torch.randn_like(x)
    adj = g.clone()
    _Rope(rope_angles(positions, d), x.dtype).transpose_(adj)
    assert abs((want * g).sum().item() - (x * adj).sum().item()) < 1e-10


def _bf16_main_grad_case(head_chunk_size: int) -> Dict[str, float]:
    """bf16 UPipe at hidden = H*d against the fp64 dense reference; the weight gradient goes into a preset fp32
    ``main_grad`` (Megatron's DDP contract). Returns errors relative to the reference's max magnitude."""
    import torch.distributed as dist

    from megatron_hsap.attention.upipe import head_chunked_attention
    from megatron_hsap.config import ContextParallelConfig
    from megatron_hsap.parallel_state import initialize_model_parallel
    from megatron_hsap.sequence.doc_lengths import cu_seqlens_from_lengths
    from megatron_hsap.sequence.plan import plan_batch

    h, h_kv, hidden_size = 16, 4, 16 * HEAD_DIM
    lengths = [200, 56]
    topo = initialize_model_parallel(context_parallel_size=dist.get_world_size(),
                                     cp_config=ContextParallelConfig(mode="ulysses", kernel="torch"))
    plan = plan_batch(cu_seqlens_from_lengths(lengths), topo, "zigzag")
    gen = torch.Generator().manual_seed(7)
    total = sum(lengths)
    x = torch.randn(total, hidden_size, generator=gen, dtype=torch.float64)
    weight = torch.randn((h // h_kv + 2) * h_kv * HEAD_DIM, hidden_size, generator=gen,
                         dtype=torch.float64) * hidden_size ** -0.5
    dout = torch.randn(total, h * HEAD_DIM, generator=gen, dtype=torch.float64)
    # What the bf16 run really sees: the inputs rounded to bf16 (the reference starts from the same values).
    x, weight, dout = (t.to(torch.bfloat16).double() for t in (x, weight, dout))
    earlier = torch.randn(weight.shape, generator=gen)  # main_grad from an earlier micro-batch

    results: Dict[str, float] = {}
    for ddp_flag in (True, False):
        hidden = plan.shard(x).unsqueeze(1).to(torch.bfloat16).requires_grad_()
        w = weight.to(torch.bfloat16).requires_grad_()
        w.main_grad = earlier.clone()
        if ddp_flag:
            w.grad_added_to_main_grad = False
        out = head_chunked_attention(hidden, w, None, plan, num_heads_q=h, num_heads_kv=h_kv, head_dim=HEAD_DIM,
                                     head_chunk_size=head_chunk_size)
        out.backward(plan.shard(dout).unsqueeze(1).to(torch.bfloat16))
        if ddp_flag:  # dummy gradient returned, flag set: DDP's hook must not add it again
            results["flag"] = float(w.grad_added_to_main_grad and w.grad is not None and w.grad.shape == w.shape)
        else:  # no DDP flag attribute: nothing returned
            results["no_flag_grad_is_none"] = float(w.grad is None)
        d_weight = w.main_grad - earlier
        dist.all_reduce(d_weight)
        got = [plan.unshard(out.detach()[:, 0]).double(), plan.unshard(hidden.grad[:, 0]).double(), d_weight.double()]
        if topo.cp_rank == 0:
            ref_in = [t.clone().requires_grad_() for t in (x, weight)]
            ref = reference_attention_block(ref_in[0], ref_in[1], torch.zeros(weight.shape[0], dtype=torch.float64),
                                            h, h_kv, lengths)
            ref.backward(dout)
            want = [ref.detach(), ref_in[0].grad, ref_in[1].grad]
            for name, a, b in zip(("out", "dx", "dweight"), got, want):
                key = f"{name}/{'ddp' if ddp_flag else 'plain'}"
                results[key] = ((a - b).abs().max() / b.abs().max()).item()
    return results


BF16_UNIT_ROUNDOFF = 2.0 ** -8


@pytest.mark.parametrize("head_chunk_size", [2, 16])
def test_bf16_main_grad_and_dx_precision(head_chunk_size):
    """Megatron's gradient-accumulation-fusion contract, and the bf16 error of dx / dW / output against fp64.

    dx is accumulated in bf16 over S = H/U stages (one GEMM per stage, fp32 inside the GEMM, one rounding of the
    running sum per stage), so its error bound grows with S: max|dx - dx_fp64| <= (S + 2) u max|dx_fp64| with
    u = 2^-8 (the S + 2 covers the attention's own bf16 roundings of dq/dk/dv and q/k/v). Measured errors are
    printed (docs/upipe.md quotes them); the weight gradient is rounded once per stage into fp32 main_grad.
    """
    results = run_distributed(_bf16_main_grad_case, 2, head_chunk_size, timeout=600)
    res = results[0]
    stages = 16 // head_chunk_size
    print(f"U={head_chunk_size} S={stages}: " + ", ".join(f"{k}={v:.2e}" for k, v in sorted(res.items())))
    assert res["flag"] == 1.0 and res["no_flag_grad_is_none"] == 1.0
    for kind in ("ddp", "plain"):
        assert res[f"out/{kind}"] <= 4 * BF16_UNIT_ROUNDOFF
        assert res[f"dweight/{kind}"] <= 4 * BF16_UNIT_ROUNDOFF
        assert res[f"dx/{kind}"] <= (stages + 2) * BF16_UNIT_ROUNDOFF
