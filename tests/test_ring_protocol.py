"""The ring protocol under NCCL's rules, checked on gloo with tags forced to 0.

- The harness really matches point-to-point messages in posting order (tags ignored).
- A member with nothing to exchange in the first step neither hangs nor breaks the others.
- Overlap cannot silently regress: the order of posts, waits and kernel calls is asserted.
- Inputs that differ between CP ranks (or are bad on one rank only) raise the same
  ValueError on every rank, naming the rank and the field, before any attention collective.
- bf16 end to end (ring, hybrid, UPipe) against the fp64 reference at a bf16 tolerance that a
  wrong answer cannot meet.
"""

from __future__ import annotations

from typing import List

import pytest
import torch

from tests.cp_cases import attention_case, reference_errors
from tests.distributed import run_distributed


def _posting_order_matching() -> List[float]:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((2,), 1.0), 1, tag=1),
                                        dist.P2POp(dist.isend, torch.full((2,), 2.0), 1, tag=2)])
        for w in works:
            w.wait()
        return []
    first, second = torch.zeros(2), torch.zeros(2)
    works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, first, 0, tag=2),
                                    dist.P2POp(dist.irecv, second, 0, tag=1)])
    for w in works:
        w.wait()
    return [first[0].item(), second[0].item()]


def test_workers_match_p2p_messages_in_posting_order_like_nccl():
    # With tag matching the receive posted with tag 2 would get 2.0; NCCL (and the forced tag 0) give 1.0.
    assert run_distributed(_posting_order_matching, 2)[1] == [1.0, 2.0]


def _attend(lengths, mode, ulysses_size, ranks_per_node, layout, h_q, h_kv, d, dtype, trace=False,
            kv_forwarding=False):
    """Run one forward+backward; returns (rank-0 errors vs fp64 reference or None, this rank's trace)."""
    import torch.distributed as dist

    from megatron_hsap.config import ContextParallelConfig
    from megatron_hsap.instrumentation.trace import record_trace
    from megatron_hsap.parallel_state import initialize_model_parallel
    from megatron_hsap.sequence.doc_lengths import cu_seqlens_from_lengths
    from megatron_hsap.sequence.plan import plan_batch

    topo = initialize_model_parallel(context_parallel_size=dist.get_world_size(), ranks_per_node=ranks_per_node,
                                     cp_config=ContextParallelConfig(mode=mode, ulysses_size=ulysses_size,
                                                                     kernel="cpu_fused", kv_forwarding=kv_forwarding))
    cu = cu_seqlens_from_lengths(lengths)
    with record_trace() as events:
        got, inputs = attention_case(plan_batch(cu, topo, layout), h_q, h_kv, d, dtype, True, 7)
    errors = reference_errors(got, inputs, cu, True, relative=True) if topo.cp_rank == 0 else None
    return errors, events if trace else None


def test_member_with_nothing_to_exchange_in_the_first_step_does_not_hang():
    # Contiguous layout over 4 ring members: member 0 holds only its own short documents, while
    # the long document spans members 1..3, so member 0 posts nothing at all and members 1..3 do.
    lengths = [5, 7, 4] + [48]
    results = run_distributed(_attend, 4, lengths, "ring", None, 4, "contiguous", 4, 2, 8, torch.float64, True,
                              timeout=180)
    errors = results[0][0]
    assert max(errors) < 1e-10, errors
    posts = [[e for e in events if e[0] == "post" and e[1].startswith("ring")] for _, events in results]
    assert posts[0] == [], "member 0 needs nothing from anyone and must post nothing"
    assert all(posts[m] for m in (1, 2, 3)), "members 1..3 share a document and must exchange"


def _check_overlap_order(events) -> None:
    """The first exchange is posted before the local block; exchange d+1 before the kernel of distance d;
    gradients of distance d are returned after its kernel."""
    def index(kind, name, label):
        matches = [i for i, e in enumerate(events) if e == (kind, name, label)]
        return matches[0] if matches else None

    kernels = {(e[1], e[2]): i for i, e in enumerate(events) if e[0] == "kernel"}
    for direction, op in (("forward", "ring_kv"), ("backward", "ring_kv_bwd")):
        distances = sorted(d for (name, d) in kernels if name == direction and d > 0)
        assert distances, f"no ring step ran in the {direction} pass: the test shape is wrong"
        first_post = index("post", op, 1)
        assert first_post is not None and first_post < kernels[(direction, 0)], \
            f"{direction}: the first exchange must be posted before the local block: {events}"
        for d in distances:
            following = index("post", op, d + 1)
            if following is not None:
                assert following < kernels[(direction, d)], f"{direction}: exchange {d + 1} posted after kernel {d}"
            assert index("wait", op, d) < kernels[(direction, d)]
        for d in (d for (name, d) in kernels if name == "backward" and d > 0):
            assert kernels[("backward", d)] < index("post", "ring_dkv", d)


@pytest.mark.parametrize("world_size,mode,ulysses_size", [(2, "ring", None), (4, "ring", None), (4, "hybrid", 2)])
def test_exchanges_are_posted_ahead_of_the_kernels_they_overlap(world_size, mode, ulysses_size):
    results = run_distributed(_attend, world_size, [64 * world_size], mode, ulysses_size, world_size, "zigzag",
                              4, 2, 8, torch.float64, True, timeout=180)
    assert max(results[0][0]) < 1e-10
    for _, events in results:
        _check_overlap_order(events)


def _mismatch(case: str) -> str:
    import torch.distributed as dist

    from megatron_hsap.attention import context_parallel_attention
    from megatron_hsap.config import ContextParallelConfig
    from megatron_hsap.parallel_state import initialize_model_parallel
    from megatron_hsap.sequence.doc_lengths import cu_seqlens_from_lengths
    from megatron_hsap.sequence.plan import plan_batch

    topo = initialize_model_parallel(context_parallel_size=4, ranks_per_node=2,
                                     cp_config=ContextParallelConfig(mode="hybrid", ulysses_size=2, kernel="cpu_fused"))
    rank = topo.cp_rank
    lengths = [40, 24] if not (case == "cu_seqlens" and rank == 2) else [24, 40]
    plan = plan_batch(cu_seqlens_from_lengths(lengths), topo, "zigzag")
    t = plan.tokens_per_rank
    heads = 6 if case == "heads" and rank == 1 else 4
    rows = t + 1 if case == "local" and rank == 3 else t
    q, k, v = torch.randn(rows, heads, 8), torch.randn(rows, 2, 8), torch.randn(rows, 2, 8)
    with pytest.raises(ValueError) as info:
        context_parallel_attention(q, k, v, plan)
    dist.barrier()  # every rank got here: nobody is stuck in an attention collective
    return str(info.value)


@pytest.mark.parametrize("case,expected", [("cu_seqlens", "cu_seqlens (CP ranks [2] differ from CP rank 0)"),
                                           ("heads", "q_shape (CP ranks [1] differ from CP rank 0)"),
                                           ("local", "CP rank(s) [3] rejected their attention inputs")])
def test_inputs_that_differ_between_ranks_raise_on_every_rank(case, expected):
    messages = run_distributed(_mismatch, 4, case, timeout=120)
    if case == "local":
        assert "plan.tokens_per_rank" in messages[3] and "[3]" in messages[3]
        messages = messages[:3]
    assert all(m == messages[0] for m in messages), messages
    assert expected in messages[0], messages[0]


def _bf16_upipe() -> List[float]:
    import torch.distributed as dist

    from megatron_hsap.attention.upipe import head_chunked_attention
    from megatron_hsap.config import ContextParallelConfig
    from megatron_hsap.parallel_state import initialize_model_parallel
    from megatron_hsap.sequence.doc_lengths import cu_seqlens_from_lengths
    from megatron_hsap.sequence.plan import plan_batch
    from tests.reference import dense_attention as reference

    topo = initialize_model_parallel(context_parallel_size=4, ranks_per_node=2,
                                     cp_config=ContextParallelConfig(mode="hsap", ulysses_size=2, kernel="cpu_fused"))
    lengths = [70, 9, 1, 48]
    cu = cu_seqlens_from_lengths(lengths)
    plan = plan_batch(cu, topo)
    h, h_kv, d, hidden = 8, 2, 16, 32
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(sum(lengths), hidden, generator=gen, dtype=torch.float64)
    w = torch.randn((h + 2 * h_kv) * d, hidden, generator=gen, dtype=torch.float64) / hidden ** 0.5
    dout = torch.randn(sum(lengths), h * d, generator=gen, dtype=torch.float64)
    x_local = plan.shard(x).to(torch.bfloat16).unsqueeze(1).requires_grad_()
    w_local = w.to(torch.bfloat16).requires_grad_()
    out = head_chunked_attention(x_local, w_local, None, plan, num_heads_q=h, num_heads_kv=h_kv, head_dim=d,
                                 rope_base=None)
    out.backward(plan.shard(dout).to(torch.bfloat16).unsqueeze(1))
    dw = w_local.grad.double()
    dist.all_reduce(dw)  # every rank holds the gradient of its own tokens
    got = [plan.unshard(out[:, 0]).double(), plan.unshard(x_local.grad[:, 0]).double(), dw]
    if topo.cp_rank != 0:
        return []
    x_ref, w_ref = x.clone().requires_grad_(), w.clone().requires_grad_()
    qkv = (x_ref @ w_ref.t()).view(-1, h_kv, h // h_kv + 2, d)
    q = qkv[:, :, :-2].reshape(-1, h, d)
    ref = reference(q, qkv[:, :, -2], qkv[:, :, -1], cu).reshape(-1, h * d)
    ref.backward(dout)
    expected = [ref.detach(), x_ref.grad, w_ref.grad]
    return [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, expected)]


#: bf16 keeps 8 bits of mantissa (relative rounding 2^-8 = 0.4 %); attention over a few hundred keys with
#: fp32 accumulation stays within a few roundings. A missing or doubled block gives errors of order 1.
BF16_TOL = 0.03


@pytest.mark.parametrize("world_size,mode,ulysses_size,layout,kv_forwarding",
                         [(4, "ring", None, "sequence-aware", False), (4, "hybrid", 2, "zigzag", False),
                          (4, "ring", None, "zigzag", True)])  # 2 ranks per node: forwarding acts
def test_bf16_matches_fp64_reference(world_size, mode, ulysses_size, layout, kv_forwarding):
    lengths = [100, 1, 0, 37, 90]
    results = run_distributed(_attend, world_size, lengths, mode, ulysses_size, 2, layout, 8, 2, 16,
                              torch.bfloat16, False, kv_forwarding, timeout=180)
    errors = results[0][0]
    assert max(errors) < BF16_TOL, errors
    assert max(errors) > 1e-4, "bf16 rounding must be visible, else the run was not in bf16"


def test_bf16_head_chunked_attention_matches_fp64_reference():
    errors = run_distributed(_bf16_upipe, 4, timeout=180)[0]
    assert max(errors) < BF16_TOL, errors
    assert max(errors) > 1e-4, errors
