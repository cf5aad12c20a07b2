"""Each exchange policy of the ring (``attention/ring_exchange.py``) alone, against the fp64 reference.

The ring core is called directly (ring mode, so a member buffer is one rank's tokens), forward and
backward, on gloo with tags forced to 0 (``tests/distributed.py``):
- ``AllHeads``: the plain core, nothing but KV(d) and dKV(d) slots posted;
- ``SharedHeads``: three calls share KV heads the way UPipe stages do; each KV head crosses the ring
  once per direction, so the calls together move exactly the bytes of one plain call over all heads;
- ``NodeForwarding`` around ``AllHeads`` and around ``SharedHeads``: relayed rows are attended, and
  fewer bytes cross the node boundary than without forwarding.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import pytest
import torch

from tests.distributed import run_distributed

LENGTHS = [61, 3, 0, 44, 20]
H_Q, H_KV, D = 4, 2, 8
#: Calls sharing KV heads like UPipe stages: (query heads, KV head of each k/v column, new, done).
#: Query head i uses KV head i // 2 (GQA); inside a call column c serves the call's query column c * G / H.
STAGES = (((0,), (0,), (0,), ()), ((1, 2), (0, 1), (1,), (0,)), ((3,), (1,), (), (1,)))


def _setup(world: int, ranks_per_node: int, kv_forwarding: bool):
    import torch.distributed as dist

    from megatron_hsap.config import ContextParallelConfig
    from megatron_hsap.kernels import get_kernel
    from megatron_hsap.parallel_state import initialize_model_parallel
    from megatron_hsap.sequence.doc_lengths import cu_seqlens_from_lengths
    from megatron_hsap.sequence.plan import plan_batch

    assert dist.get_world_size() == world
    topo = initialize_model_parallel(context_parallel_size=world, ranks_per_node=ranks_per_node,
                                     cp_config=ContextParallelConfig(mode="ring", kernel="cpu_fused",
                                                                     kv_forwarding=kv_forwarding))
    cu = cu_seqlens_from_lengths(LENGTHS)
    plan = plan_batch(cu, topo, "zigzag")
    gen = torch.Generator().manual_seed(11)
    total = sum(LENGTHS)
    q, k, v, dout = (torch.randn(total, h, D, generator=gen, dtype=torch.float64) for h in (H_Q, H_KV, H_KV, H_Q))
    return topo, plan, cu, (q, k, v, dout), get_kernel("cpu_fused")


def _errors(plan, cu, inputs, local_results) -> List[float]:
    """Max |error| of the unsharded (out, dq, dk, dv) against the dense fp64 reference."""
    from tests.reference import dense_attention

    got = [plan.unshard(x) for x in local_results]
    q, k, v, dout = (x.clone().requires_grad_() for x in inputs)
    ref = dense_attention(q, k, v, cu)
    ref.backward(dout.detach())
    return [(a - b).abs().max().item() for a, b in zip(got, (ref.detach(), q.grad, k.grad, v.grad))]


def _comm_totals(stats) -> Dict[str, int]:
    import torch.distributed as dist

    totals = torch.tensor([stats.recv_bytes("inter"), stats.recv_bytes("intra"),
                           stats.recv_bytes("inter", "ring_kv_relay") + stats.recv_bytes("intra", "ring_kv_relay")],
                          dtype=torch.int64)
    dist.all_reduce(totals)
    return dict(zip(("inter", "intra", "relay"), totals.tolist()))


def _plain(world: int, ranks_per_node: int, kv_forwarding: bool) -> Tuple[List[float], list, Dict[str, int]]:
    """One ring call over all heads; returns (errors, this rank's posted ops, CP-wide received bytes)."""
    from megatron_hsap.attention.ring import ring_attention_backward, ring_attention_forward
    from megatron_hsap.instrumentation import count_comm
    from megatron_hsap.instrumentation.trace import record_trace

    topo, plan, cu, inputs, kernel = _setup(world, ranks_per_node, kv_forwarding)
    q, k, v, dout = (plan.shard(x) for x in inputs)
    schedule = plan.member_schedule(True, kv_forwarding=kv_forwarding)
    scale = D ** -0.5
    with record_trace() as events, count_comm() as stats:
        out, lse = ring_attention_forward(q, k, v, schedule, topo, kernel, scale)
        grads = ring_attention_backward(dout, q, k, v, out, lse, schedule, topo, kernel, scale)
    posts = sorted({e[1] for e in events if e[0] == "post"})
    return _errors(plan, cu, inputs, [out, *grads]), posts, _comm_totals(stats)


def _shared(world: int, ranks_per_node: int, kv_forwarding: bool) -> Tuple[List[float], Dict[str, int]]:
    """The calls of ``STAGES`` sharing remote rows (one ``SharedRemoteKeyValues`` for the forwards, one for the
    backwards, as UPipe does); dk/dv of a KV head are summed over the calls' columns of that head."""
    from megatron_hsap.attention.ring import ring_attention_backward, ring_attention_forward
    from megatron_hsap.attention.shared_kv import SharedRemoteKeyValues
    from megatron_hsap.instrumentation import count_comm

    topo, plan, cu, inputs, kernel = _setup(world, ranks_per_node, kv_forwarding)
    q, k, v, dout = (plan.shard(x) for x in inputs)
    schedule = plan.member_schedule(True, kv_forwarding=kv_forwarding)
    scale = D ** -0.5
    out, lses = torch.zeros_like(q), []
    with count_comm() as stats:
        shared = SharedRemoteKeyValues()
        for heads, kv, new, done in STAGES:
            shared.begin_stage(kv, new, done)
            shared.select(0, len(kv))
            part, lse = ring_attention_forward(q[:, list(heads)], k[:, list(kv)], v[:, list(kv)], schedule, topo,
                                               kernel, scale, shared)
            out[:, list(heads)] = part
            lses.append(lse)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        shared = SharedRemoteKeyValues()
        for (heads, kv, new, done), lse in zip(STAGES, lses):
            shared.begin_stage(kv, new, done)
            shared.select(0, len(kv))
            g_q, g_k, g_v = ring_attention_backward(dout[:, list(heads)], q[:, list(heads)], k[:, list(kv)],
                                                    v[:, list(kv)], out[:, list(heads)], lse, schedule, topo,
                                                    kernel, scale, shared)
            dq[:, list(heads)] = g_q
            for c, j in enumerate(kv):
                dk[:, j] += g_k[:, c]
                dv[:, j] += g_v[:, c]
    return _errors(plan, cu, inputs, [out, dq, dk, dv]), _comm_totals(stats)


TOL = 1e-10


def test_all_heads_is_the_plain_core():
    results = run_distributed(_plain, 3, 3, 3, False, timeout=120)
    assert max(results[0][0]) < TOL, results[0][0]
    posts = set().union(*(p for _, p, _ in results))
    assert posts == {"ring_dkv", "ring_kv", "ring_kv_bwd"}, posts


@pytest.mark.parametrize("world,ranks_per_node,kv_forwarding", [(3, 3, False), (4, 2, True)],
                         ids=["shared", "shared-forwarded"])
def test_shared_heads_match_reference_and_move_each_head_once(world, ranks_per_node, kv_forwarding):
    errors, shared_bytes = run_distributed(_shared, world, world, ranks_per_node, kv_forwarding, timeout=120)[0]
    assert max(errors) < TOL, errors
    _, _, plain_bytes = run_distributed(_plain, world, world, ranks_per_node, kv_forwarding, timeout=120)[0]
    assert plain_bytes["inter"] + plain_bytes["intra"] > 0, "the case exchanges nothing: the test shape is wrong"
    assert shared_bytes == plain_bytes, (shared_bytes, plain_bytes)


def test_node_forwarding_matches_reference_and_crosses_nodes_less():
    results = run_distributed(_plain, 4, 4, 2, True, timeout=120)
    errors, _, forwarded = results[0]
    assert max(errors) < TOL, errors
    posts = set().union(*(p for _, p, _ in results))
    assert {"ring_kv_relay", "ring_kv_relay_bwd", "ring_dkv_relay"} <= posts, posts
    assert forwarded["relay"] > 0
    _, _, direct = run_distributed(_plain, 4, 4, 2, False, timeout=120)[0]
    assert forwarded["inter"] < direct["inter"], (forwarded, direct)
