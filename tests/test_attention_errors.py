"""Bad input to the attention core: a clear error on every rank, before any collective.

Each body catches the expected error on every rank and then runs a barrier: if one
rank had entered a collective before raising, the barrier would mismatch or hang
(and the harness would time out), so a passing test shows no collective started.
"""

from __future__ import annotations

from typing import List

import pytest
import torch

from megatron_hsap.config import ContextParallelConfig
from megatron_hsap.parallel_state import CPTopology
from megatron_hsap.sequence.doc_lengths import cu_seqlens_from_lengths
from megatron_hsap.sequence.plan import plan_batch
from tests.distributed import run_distributed


def _errors_on_every_rank(mode: str, ulysses_size, ranks_per_node: int) -> List[str]:
    import torch.distributed as dist

    from megatron_hsap.attention import context_parallel_attention
    from megatron_hsap.parallel_state import initialize_model_parallel

    cp = dist.get_world_size()
    topo = initialize_model_parallel(context_parallel_size=cp, ranks_per_node=ranks_per_node,
                                     cp_config=ContextParallelConfig(mode=mode, ulysses_size=ulysses_size,
                                                                     kernel="cpu_fused"))
    plan = plan_batch(cu_seqlens_from_lengths([40, 24]), topo, "zigzag")
    t = plan.tokens_per_rank
    good = torch.randn(t, 8, 16)
    cases = {
        "more kv heads than query heads": (torch.randn(t, 4, 16), good, good),
        "kv heads not dividing q heads": (good, torch.randn(t, 3, 16), torch.randn(t, 3, 16)),
        "wrong length": (torch.randn(t + 1, 8, 16), good, good),
        "wrong rank of tensor": (torch.randn(t, 128), good, good),
        "integer dtype": (good.long(), good.long(), good.long()),
        "mixed dtype": (good, good.double(), good.double()),
        "mixed device": (good, good.to("meta"), good.to("meta")),
        "k/v shape mismatch": (good, good, torch.randn(t, 8, 8)),
    }
    messages = []
    for name, (q, k, v) in cases.items():
        with pytest.raises(ValueError) as info:
            context_parallel_attention(q, k, v, plan)
        messages.append(f"{name}: {info.value}")
    dist.barrier()
    return messages


@pytest.mark.parametrize("mode,ulysses_size", [("ulysses", None), ("ring", None), ("hybrid", 2)])
def test_bad_attention_input_raises_on_every_rank(mode, ulysses_size):
    results = run_distributed(_errors_on_every_rank, 4, mode, ulysses_size, 4, timeout=180)
    assert all(r == results[0] for r in results), "every rank must raise the same error"
    text = "\n".join(results[0])
    assert len(results[0]) == 8
    for expected in ("num_heads_kv=8 must not exceed num_heads_q=4", "num_heads_q=8 must be a multiple of "
                     "num_heads_kv=3", "plan.tokens_per_rank", "[t_local, heads, head_dim]", "not supported; allowed",
                     "share one dtype", "one device", "same shape"):
        assert expected in text, f"missing error mentioning {expected!r} in:\n{text}"


def _bad_initialize(kwargs: dict) -> str:
    import torch.distributed as dist

    from megatron_hsap.parallel_state import initialize_model_parallel

    with pytest.raises(ValueError) as info:
        initialize_model_parallel(**kwargs)
    dist.barrier()
    return str(info.value)


@pytest.mark.parametrize("kwargs,expected", [
    (dict(context_parallel_size=4, cp_config=ContextParallelConfig(mode="hybrid", ulysses_size=3)),
     "not divisible by ulysses_size=3"),
    (dict(context_parallel_size=3), "world size 4 is not divisible"),
    (dict(context_parallel_size=4, cp_config=ContextParallelConfig(mode="ulysses", ulysses_size=2)),
     "needs ulysses_size == context_parallel_size"),
    (dict(context_parallel_size=0), "context_parallel_size=0 must be a positive int"),
    (dict(context_parallel_size=4, ranks_per_node=0), "ranks_per_node=0"),
])
def test_bad_parallel_sizes_raise_on_every_rank(kwargs, expected):
    results = run_distributed(_bad_initialize, 4, kwargs, timeout=120)
    for message in results:
        assert expected in message


@pytest.mark.parametrize("kwargs,expected", [
    (dict(mode="tree"), "mode='tree' is not supported; allowed values: 'ring', 'ulysses', 'hybrid', 'hsap'"),
    (dict(layout="striped"), "layout='striped' is not supported"),
    (dict(kernel="cudnn"), "kernel='cudnn' is not supported"),
    (dict(mode="ring", ulysses_size=2), "not allowed with mode='ring'"),
    (dict(mode="ring", head_chunk_size=4), "head_chunk_size is only used"),
    (dict(ulysses_size=0), "ulysses_size=0 must be a positive int"),
    (dict(kv_forwarding=1), "kv_forwarding=1 is not supported; allowed values: False, True"),
])
def test_bad_config_is_rejected(kwargs, expected):
    with pytest.raises(ValueError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        ContextParallelConfig(**kwargs)


@pytest.mark.parametrize("cu_seqlens,expected", [
    (torch.tensor([0, 5, 3, 9], dtype=torch.int32), "non-decreasing; cu_seqlens\\[2\\]=3 < cu_seqlens\\[1\\]=5"),
    (torch.tensor([1, 5, 9], dtype=torch.int32), "must start at 0"),
    (torch.tensor([0.0, 5.0]), "dtype int32 or int64"),
    (torch.tensor([[0, 5]], dtype=torch.int32), "must be 1-D"),
    ([0, 5, 9], "must be a torch.Tensor"),
])
def test_bad_cu_seqlens(cu_seqlens, expected):
    with pytest.raises(ValueError, match=expected):
        plan_batch(cu_seqlens, CPTopology.offline(4, 2, 4), "zigzag")


def test_bad_plan_arguments():
    topo = CPTopology.offline(4, 2, 4)
    cu = cu_seqlens_from_lengths([10, 6])
    with pytest.raises(ValueError, match="layout='ragged' is not supported; allowed values"):
        plan_batch(cu, topo, "ragged")
    with pytest.raises(ValueError, match="topology must be a CPTopology"):
        plan_batch(cu, "4x2", "zigzag")
    plan = plan_batch(cu, topo, "contiguous")
    with pytest.raises(ValueError, match="does not match the packed length 16"):
        plan.shard(torch.zeros(17, 3))
    with pytest.raises(ValueError, match="not divisible by ulysses_size=3"):
        CPTopology.offline(4, 3, 4)
