"""CP topology on top of Megatron-Core's groups: Ulysses/ring sub-groups, nodes, defaults, warnings."""

from __future__ import annotations

import warnings

import pytest

from megatron_hsap.config import ContextParallelConfig
from megatron_hsap.parallel_state import CPTopology
from tests.distributed import run_distributed


def _describe(tp: int, pp: int, cp: int, mode: str, ulysses_size, ranks_per_node: int) -> dict:
    import torch
    import torch.distributed as dist

    from megatron_hsap.parallel_state import get_cp_topology, initialize_model_parallel

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                  context_parallel_size=cp, ranks_per_node=ranks_per_node,
                                  cp_config=ContextParallelConfig(mode=mode, ulysses_size=ulysses_size))
    topo = get_cp_topology()

    def members(group) -> list:
        mine = torch.tensor([dist.get_rank()])
        out = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, mine, group=group)
        return [int(x) for x in out]

    return {"ulysses": topo.ulysses_size, "ring": topo.ring_size, "cp_rank": topo.cp_rank,
            "cp_members": members(topo.cp_group), "ulysses_members": members(topo.ulysses_group),
            "ring_members": members(topo.ring_group), "nodes": topo.node_of_cp_rank,
            "warned": any("span several nodes" in str(w.message) for w in caught)}


def test_hybrid_groups_with_tp_and_pp_around_cp():
    # 8 ranks: TP=2 innermost, CP=4 (members 2 apart), PP=1, DP=1; 4 ranks per node -> 2 CP ranks per node.
    results = run_distributed(_describe, 8, 2, 1, 4, "hybrid", None, 4, timeout=120)
    r0, r1 = results[0], results[1]
    assert r0["cp_members"] == [0, 2, 4, 6] and r1["cp_members"] == [1, 3, 5, 7]
    assert r0["ulysses"] == 2 and r0["ring"] == 2  # default: largest Ulysses group inside a node
    assert r0["ulysses_members"] == [0, 2] and results[4]["ulysses_members"] == [4, 6]
    assert r0["ring_members"] == [0, 4] and results[2]["ring_members"] == [2, 6]
    assert r0["nodes"] == (0, 0, 1, 1)
    assert not any(r["warned"] for r in results)


def test_ulysses_spanning_nodes_warns_once_on_rank_zero():
    results = run_distributed(_describe, 4, 1, 1, 4, "ulysses", None, 2, timeout=120)
    assert [r["warned"] for r in results] == [True, False, False, False]
    assert results[0]["ulysses_members"] == [0, 1, 2, 3] and results[0]["ring"] == 1


def test_ring_mode_and_pipeline():
    results = run_distributed(_describe, 4, 1, 2, 2, "ring", None, 4, timeout=120)
    assert results[0]["cp_members"] == [0, 1] and results[2]["cp_members"] == [2, 3]
    assert results[0]["ulysses"] == 1 and results[0]["ring_members"] == [0, 1]


def test_offline_topology():
    topo = CPTopology.offline(16, 8, 8)
    assert topo.ring_size == 2 and topo.num_nodes == 2 and topo.is_offline
    assert list(topo.ring_member_ranks(1)) == list(range(8, 16))
    assert not topo.ulysses_spans_nodes() and CPTopology.offline(16, 8, 4).ulysses_spans_nodes()
    with pytest.raises(ValueError, match="ranks_per_node=0 must be a positive int"):
        CPTopology.offline(8, 2, 0)


@pytest.mark.parametrize("mode,cp,per_node,expected", [("ring", 8, 4, 1), ("ulysses", 8, 4, 8), ("hybrid", 8, 4, 4),
                                                        ("hsap", 12, 8, 4), ("hybrid", 6, 4, 2)])
def test_default_ulysses_size(mode, cp, per_node, expected):
    assert ContextParallelConfig(mode=mode).resolve_ulysses_size(cp, per_node) == expected
