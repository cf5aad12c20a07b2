"""Head counts that do not divide the Ulysses size, and KV-head counts that neither divide nor are multiples of it.

For (H, H_kv, P) in {(28,4,8), (40,8,8), (12,3,4), (20,5,4), (24,6,4), (12,2,3), (7,7,4), (9,3,2)}
(plus H < P: ranks without heads), through both entry points against the fp64 dense reference,
forward and backward: ``context_parallel_attention`` (out, dq, dk, dv) and the fused projection
path of ``head_chunked_attention`` (out, input, weight and bias gradients, tests/test_upipe.py's
reference), with ring sizes 1 and 2 (P = 8: ring 1 only, 16 processes being too many for CI) and
TP 1 and 2 where H_kv allows (TP is emulated: each TP rank's heads are a separate call).
Measured bytes must equal the predictions (``BatchPlan.stats``, ``predicted_stage_comm``), which
count exactly the KV heads each rank's query heads use, and padding slots must stay exactly 0.
One launch per world size covers several topologies; documents are tiny (about 6 tokens per rank).
"""

from __future__ import annotations

import itertools
from typing import Dict, List, Tuple

import pytest
import torch

from tests.cp_cases import local_attention_case, reference_errors, unshard_all
from tests.distributed import run_distributed

HEAD_DIM = 8
TOL = {torch.float64: 1e-10, torch.float32: 2e-5}


def _lengths(world: int) -> List[int]:
    """A long document crossing every shard, a length-1, a zero-length and two mid-sized documents."""
    return [5 * world // 2 + 1, 1, 0, 2 * world - 1, world + 3]


def _cpa_case(plan, seed: int, h: int, h_kv: int, dtype: torch.dtype) -> Dict[str, float]:
    """``context_parallel_attention`` fwd + bwd: error / TOL (rank 0), forward bytes vs ``plan.stats`` and padding."""
    from megatron_hsap.sequence.doc_lengths import cu_seqlens_from_lengths

    tensors, inputs, measured = local_attention_case(plan, h, h_kv, HEAD_DIM, dtype, True, seed)
    stats, c = plan.stats(h, h_kv, HEAD_DIM, dtype), plan.topology.cp_rank
    predicted = (stats.send_bytes_intra[c], stats.send_bytes_inter[c], stats.recv_bytes_intra[c],
                 stats.recv_bytes_inter[c])
    got_bytes = (measured.send_bytes_intra, measured.send_bytes_inter, measured.recv_bytes_intra,
                 measured.recv_bytes_inter)
    valid = plan.valid_mask
    result = {"bytes": 0.0 if predicted == got_bytes else 1e9,
              "padding": float(sum(t[~valid].abs().sum() for t in tensors))}
    got = [t.double() for t in unshard_all(plan, tensors)]
    if c == 0:
        cu = cu_seqlens_from_lengths(list(plan.doc_lengths))
        result["error"] = max(reference_errors(got, inputs, cu, causal=True)) / TOL[dtype]
    return result


def _run_launch(topologies: List[Tuple[str, int, int, List[Tuple[int, int, int]]]]) -> Dict[str, float]:
    """topologies: (mode, Ulysses size, ranks per node, [(H, H_kv, tp)]), run one after the other on this world.

    Each case runs through both entry points (per TP rank's head counts); UPipe alternates U = P (stages of
    P heads, the last smaller) with U = 2P (or all heads when 2P >= H / tp)."""
    import torch.distributed as dist

    from megatron_hsap.config import ContextParallelConfig
    from megatron_hsap.parallel_state import destroy_model_parallel, initialize_model_parallel
    from megatron_hsap.sequence.doc_lengths import cu_seqlens_from_lengths
    from megatron_hsap.sequence.plan import plan_batch
    from tests.test_upipe import upipe_case

    world = dist.get_world_size()
    results: Dict[str, float] = {}
    seeds = itertools.count()
    layouts = itertools.cycle(("zigzag", "sequence-aware", "contiguous"))
    for mode, ulysses, ranks_per_node, cases in topologies:
        topo = initialize_model_parallel(context_parallel_size=world, ranks_per_node=ranks_per_node,
                                         cp_config=ContextParallelConfig(mode=mode, ulysses_size=ulysses,
                                                                         kernel="cpu_fused"))
        assert topo.ulysses_size == ulysses
        for i, (h, h_kv, tp) in enumerate(cases):
            layout = next(layouts)
            plan = plan_batch(cu_seqlens_from_lengths(_lengths(world)), topo, layout)
            dtype = torch.float32 if i == 1 else torch.float64
            u = ulysses if i % 2 == 0 else (2 * ulysses if 2 * ulysses < h // tp else h // tp)
            key = f"H{h}/Hkv{h_kv}/P{ulysses}/ring{topo.ring_size}/tp{tp}/{layout}/{str(dtype)[6:]}"
            for entry, result in (("cpa", _cpa_case(plan, next(seeds), h // tp, h_kv // tp, dtype)),
                                  (f"upipe-U{u}", upipe_case(plan, next(seeds), h, h_kv, u, tp, dtype))):
                for name, value in result.items():
                    results[f"{key}/{entry}/{name}"] = value
        destroy_model_parallel()
    return results


P8 = [(28, 4, 1), (28, 4, 2), (40, 8, 1), (40, 8, 2)]
P4 = [(12, 3, 1), (20, 5, 1), (24, 6, 1), (24, 6, 2), (7, 7, 1), (3, 1, 1)]
P3 = [(12, 2, 1), (12, 2, 2)]
P2 = [(9, 3, 1)]
LAUNCHES = {  # world size -> topologies (mode, Ulysses size, ranks per node, cases)
    8: [("ulysses", 8, 8, P8), ("hybrid", 4, 4, P4)],
    4: [("ulysses", 4, 4, P4), ("hybrid", 2, 2, P2)],
    6: [("hybrid", 3, 3, P3)],
    3: [("ulysses", 3, 3, P3)],
    2: [("ulysses", 2, 2, P2)],
}


@pytest.mark.parametrize("world", sorted(LAUNCHES), ids=[f"cp{w}" for w in sorted(LAUNCHES)])
def test_uneven_heads_match_dense_reference(world):
    results = run_distributed(_run_launch, world, LAUNCHES[world], timeout=600)
    cases = sum(len(c) for *_, c in LAUNCHES[world])
    errors = {k: v for k, v in results[0].items() if k.endswith("/error")}
    assert len(errors) == 2 * cases
    bad = {k: v for k, v in errors.items() if not v <= 1.0}
    assert not bad, f"error over {TOL}, as multiples of the dtype's tolerance: {bad}"
    for rank, res in enumerate(results):
        broken = {k: v for k, v in res.items() if k.endswith(("/bytes", "/padding", "/ring")) and v != 0.0}
        assert not broken, (f"rank {rank}: measured bytes != prediction, nonzero padding, or head chunks moving more "
                            f"ring bytes than one stage of all heads: {broken}")


def test_kv_bytes_against_full_replication():
    """(28, 4, 8): each rank receives the one KV head its 3 or 4 query heads use (8 KV heads held in all), not
    every KV head (32) nor one KV copy per query head (28, what expanding GQA to MHA sends)."""
    from megatron_hsap.head_split import split_heads

    split = split_heads(28, 4, 8)
    assert split.query_counts == (4, 3, 4, 3, 4, 3, 4, 3) and split.kv_counts == (1,) * 8
    assert split.kv_heads_held == 8
    assert split_heads(12, 3, 4).kv_counts == (1, 2, 2, 1)  # 3 heads per rank, 4 per KV head: straddles


def _megatron_layer_body() -> Dict[str, float]:
    """A GPTModel with 6 query / 3 KV heads on 4 CP ranks (Ulysses 4: ranks attend 2, 2, 1, 1 heads) built from the
    HSAP spec vs Megatron's own local spec on one rank with the same weights, per mode: max |difference| of the
    logits and of every parameter gradient (summed over the CP ranks), relative to the reference's max."""
    import torch.distributed as dist
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_hsap.config import ContextParallelConfig
    from megatron_hsap.instrumentation import count_comm
    from megatron_hsap.megatron.attention import HSAPPackedSeqParams
    from megatron_hsap.megatron.cpu_shim import apply_cpu_shim, cpu_config_overrides
    from megatron_hsap.megatron.spec import get_gpt_layer_hsap_spec
    from megatron_hsap.parallel_state import destroy_model_parallel, initialize_model_parallel
    from megatron_hsap.sequence.plan import plan_batch

    apply_cpu_shim()
    seq, vocab = 32, 64
    config = TransformerConfig(num_layers=1, hidden_size=48, num_attention_heads=6, num_query_groups=3,
                               hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False,
                               bias_activation_fusion=False, masked_softmax_fusion=False,
                               gradient_accumulation_fusion=False, apply_rope_fusion=False, add_qkv_bias=True,
                               **cpu_config_overrides())

    def build(spec):
        torch.manual_seed(7)
        return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=vocab, max_sequence_length=seq,
                        position_embedding_type="rope")

    tokens = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(3))
    weights = torch.randn(1, seq, vocab, generator=torch.Generator().manual_seed(4))
    initialize_model_parallel(context_parallel_size=1, cp_config=ContextParallelConfig(mode="ring"))
    model_parallel_cuda_manual_seed(1)
    reference = build(get_gpt_layer_local_spec())
    expected = reference(tokens, None, None)
    (expected * weights).sum().backward()
    destroy_model_parallel()

    errors = {}
    cu = torch.tensor([0, seq], dtype=torch.int32)
    for mode in ("ulysses", "hsap"):
        cp_config = ContextParallelConfig(mode=mode, kernel="cpu_fused")
        topo = initialize_model_parallel(context_parallel_size=dist.get_world_size(), cp_config=cp_config)
        model_parallel_cuda_manual_seed(1)
        assert topo.ulysses_size == 4
        model = build(get_gpt_layer_hsap_spec(cp_config))
        model.load_state_dict(reference.state_dict(), strict=True)
        plan = plan_batch(cu, topo, "zigzag")
        params = HSAPPackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=seq,
                                     max_seqlen_kv=seq, plan=plan)
        with count_comm() as measured:
            local = model(plan.shard(tokens[0]).unsqueeze(0), plan.position_ids.unsqueeze(0), None,
                          packed_seq_params=params)
        used = {op for (op, _), sent in measured.sent.items() if sent}
        assert used == ({"upipe_qkv", "upipe_out"} if mode == "hsap" else {"ulysses_a2a"}), measured.sent
        (local[0] * plan.shard(weights[0])).sum().backward()
        errors[mode] = ((plan.unshard(local[0].detach()) - expected[0].detach()).abs().max()
                        / expected.abs().max()).item()
        for (name, p), (_, p_ref) in zip(model.named_parameters(), reference.named_parameters()):
            grad = p.grad.clone()
            dist.all_reduce(grad)
            errors[f"{mode}/{name}"] = ((grad - p_ref.grad).abs().max() / p_ref.grad.abs().max()).item()
        destroy_model_parallel()
    return errors


def test_megatron_layer_with_uneven_heads():
    """The Megatron layer needs no head-count change: ``ulysses`` runs ``context_parallel_attention``, ``hsap``
    the fused UPipe path (U = 4: a stage of 2, 2, 1, 1 heads, then one of 2, 2 heads); both match Megatron's
    own attention in fp32, logits and every parameter gradient."""
    from tests.distributed import run_distributed_fresh

    errors = run_distributed_fresh(_megatron_layer_body, 4, timeout=300)[0]
    assert len(errors) > 10 and any("linear_qkv.bias" in k for k in errors)
    bad = {k: v for k, v in errors.items() if not v < 1e-5}
    assert not bad, bad
