"""Sliding-window attention (``window_size``) on gloo ranks against the dense fp64 reference.

Per CP layout (ring of 4, Ulysses 4, hybrid 2 x 2) one launch runs windows smaller than a shard,
about a shard, larger than every document, and a two-sided window without causality, over one
document and over packed documents whose windows end at document boundaries, in the zigzag and
sequence-aware layouts, forward and backward. The measured ring bytes must equal ``plan.stats``
for the window. The hybrid launch also runs ``head_chunked_attention`` with a window. Bad window
values must raise the same ValueError on every rank before any collective. In the Megatron layer,
per-layer windows (``window_size`` + ``window_attn_skip_freq``) must match Megatron's own model.
"""

from __future__ import annotations

import itertools
from typing import Dict, List, Optional

import pytest
import torch

from tests.distributed import run_distributed
from tests.reference import dense_attention

SHARD = 48  # tokens per rank in the cases below (4 ranks)
DOCS = {"one_document": [4 * SHARD], "packed": [SHARD // 4, 2 * SHARD + 5, 3, SHARD - 8, SHARD - 4]}
# (window_size, causal): smaller than a shard, about one, larger than every document, two-sided full.
WINDOWS = [((5, 0), True), ((SHARD + 3, -1), True), ((500, 0), True), ((7, 11), False)]
TOL = {torch.float64: 1e-10, torch.float32: 2e-5}


def _windowed_cases(mode: str, ulysses_size: Optional[int], kv_forwarding: bool = False) -> Dict[str, float]:
    import torch.distributed as dist

    from megatron_hsap.attention import context_parallel_attention
    from megatron_hsap.config import ContextParallelConfig
    from megatron_hsap.instrumentation import count_comm
    from megatron_hsap.parallel_state import initialize_model_parallel
    from megatron_hsap.sequence.doc_lengths import cu_seqlens_from_lengths
    from megatron_hsap.sequence.plan import plan_batch
    from tests.cp_cases import bytes_match_plan, reference_errors, unshard_all

    topo = initialize_model_parallel(context_parallel_size=dist.get_world_size(), ranks_per_node=2,
                                     cp_config=ContextParallelConfig(mode=mode, ulysses_size=ulysses_size,
                                                                     kernel="cpu_fused", kv_forwarding=kv_forwarding))
    results: Dict[str, float] = {}
    dtypes = itertools.cycle((torch.float64, torch.float64, torch.float32))
    cases = itertools.product(DOCS.items(), ("zigzag", "sequence-aware"), WINDOWS)
    for seed, ((name, lengths), layout, (window, causal)) in enumerate(cases):
        dtype = next(dtypes)
        cu = cu_seqlens_from_lengths(lengths)
        plan = plan_batch(cu, topo, layout)
        gen = torch.Generator().manual_seed(seed)  # same inputs on every rank
        q, k, v = (torch.randn(sum(lengths), h, 16, generator=gen, dtype=torch.float64) for h in (8, 4, 4))
        dout = torch.randn(sum(lengths), 8, 16, generator=gen, dtype=torch.float64)
        local = [plan.shard(x).to(dtype).requires_grad_() for x in (q, k, v)]
        with count_comm() as measured:
            out = context_parallel_attention(*local, plan, causal=causal, window_size=window)
        out.backward(plan.shard(dout).to(dtype))
        got = [t.double() for t in unshard_all(plan, [out, local[0].grad, local[1].grad, local[2].grad])]
        key = f"{name}/{layout}/{window}/{'causal' if causal else 'full'}/{str(dtype)[6:]}"
        if seed % dist.get_world_size() == topo.cp_rank:  # every rank holds the same gathered result: one checks
            results[key] = max(reference_errors(got, [q, k, v, dout], cu, causal, window_size=window)) / TOL[dtype]
        stats = plan.stats(8, 4, 16, dtype, causal=causal, window_size=window)
        results[key + "/bytes"] = float(not bytes_match_plan(stats, measured, topo, kv_forwarding))
    if mode == "hybrid":
        results.update(_head_chunked_case(topo))
    return results


def _head_chunked_case(topo) -> Dict[str, float]:
    """``head_chunked_attention`` with a window (two stages, no rotary) against projection + dense reference."""
    from megatron_hsap.attention.upipe import head_chunked_attention
    from megatron_hsap.sequence.doc_lengths import cu_seqlens_from_lengths
    from megatron_hsap.sequence.plan import plan_batch

    h, h_kv, d, hidden_size, lengths, window = 8, 2, 8, 24, DOCS["packed"], (20, 0)
    cu = cu_seqlens_from_lengths(lengths)
    plan = plan_batch(cu, topo, "zigzag")
    gen = torch.Generator().manual_seed(11)
    total, g = sum(lengths), h // h_kv
    x = torch.randn(total, hidden_size, generator=gen, dtype=torch.float64)
    weight = torch.randn((g + 2) * h_kv * d, hidden_size, generator=gen, dtype=torch.float64) / hidden_size ** 0.5
    dout = torch.randn(total, h * d, generator=gen, dtype=torch.float64)
    x_local, w = plan.shard(x).unsqueeze(1).requires_grad_(), weight.clone().requires_grad_()
    out = head_chunked_attention(x_local, w, None, plan, num_heads_q=h, num_heads_kv=h_kv, head_dim=d,
                                 rope_base=None, head_chunk_size=4, window_size=window)
    out.backward(plan.shard(dout).unsqueeze(1))
    got = [plan.unshard(out[:, 0].detach()), plan.unshard(x_local.grad[:, 0])]
    x_ref, w_ref = x.clone().requires_grad_(), weight.clone().requires_grad_()
    mixed = (x_ref @ w_ref.t()).view(total, h_kv, g + 2, d)
    ref = dense_attention(mixed[:, :, :g].reshape(total, h, d), mixed[:, :, g], mixed[:, :, g + 1], cu,
                          window_size=window).reshape(total, h * d)
    ref.backward(dout)
    errors = [(a - b).abs().max().item() for a, b in zip(got, [ref.detach(), x_ref.grad])]
    return {"head_chunked/out_and_dx": max(errors) / TOL[torch.float64]}


# (mode, Ulysses size, node-level K/V forwarding); 2 ranks per node: the ring of 4 has 2 members per node.
CONFIGS = [("ring", None, False), ("ulysses", None, False), ("hybrid", 2, False), ("ring", None, True)]


@pytest.mark.parametrize("mode,ulysses_size,kv_forwarding", CONFIGS,
                         ids=[m + ("-kv_forwarding" if f else "") for m, _, f in CONFIGS])
def test_windowed_attention_matches_dense_reference(mode, ulysses_size, kv_forwarding):
    results = run_distributed(_windowed_cases, 4, mode, ulysses_size, kv_forwarding, timeout=300)
    checked = {k for rank_results in results for k in rank_results if not k.endswith("/bytes")}
    assert len(checked) == len(DOCS) * 2 * len(WINDOWS) + (mode == "hybrid")
    for rank, rank_results in enumerate(results):
        bad = {k: v for k, v in rank_results.items() if (v > 1.0 if k in checked else v != 0.0)}
        assert not bad, f"rank {rank}: error / tolerance above 1, or ring bytes != plan.stats: {bad}"


def _bad_windows() -> List[str]:
    import torch.distributed as dist

    from megatron_hsap.attention import context_parallel_attention
    from megatron_hsap.attention.upipe import head_chunked_attention
    from megatron_hsap.config import ContextParallelConfig
    from megatron_hsap.parallel_state import initialize_model_parallel
    from megatron_hsap.sequence.doc_lengths import cu_seqlens_from_lengths
    from megatron_hsap.sequence.plan import plan_batch

    topo = initialize_model_parallel(context_parallel_size=dist.get_world_size(),
                                     cp_config=ContextParallelConfig(mode="hybrid", ulysses_size=2, kernel="cpu_fused"))
    plan = plan_batch(cu_seqlens_from_lengths([40, 24]), topo, "zigzag")
    t = plan.tokens_per_rank
    q, kv = torch.zeros(t, 4, 8), torch.zeros(t, 2, 8)
    messages = []
    # a bad window on every rank, or on rank 1 alone (its peers learn it in the agreement), and a valid
    # window that differs on rank 1: every rank raises before any collective
    for window, causal, bad_ranks in (((4, 2), True, [0, 1, 2, 3]), ((-3, 0), True, [0, 1, 2, 3]),
                                      ((2.0, 0), False, [1]), ((8, 0), True, [1])):
        mine = window if topo.cp_rank in bad_ranks else (4, 0)
        expected = "window_size" if topo.cp_rank in bad_ranks or window == (8, 0) else r"CP rank\(s\) \[1\] rejected"
        with pytest.raises(ValueError, match=expected) as err:
            context_parallel_attention(q, kv, kv, plan, causal=causal, window_size=mine)
        messages.append(str(err.value))
    with pytest.raises(ValueError, match=r"window_size=\(1, 2\) has right=2 with causal=True; allowed values"):
        head_chunked_attention(torch.zeros(t, 1, 16), torch.zeros(8 * 8, 16), None, plan, num_heads_q=4,
                               num_heads_kv=2, head_dim=8, window_size=(1, 2))
    dist.barrier()  # every rank got here: none entered a collective the others skipped
    return messages


def test_bad_window_raises_on_every_rank_before_any_collective():
    messages = run_distributed(_bad_windows, 4, timeout=120)
    for rank_messages in messages:
        assert "allowed values" in rank_messages[0] and "causal=True" in rank_messages[0]
        assert "window_size (CP ranks [1] differ from CP rank 0)" in rank_messages[3]


def test_megatron_layer_windows_follow_window_attn_skip_freq():
    """Per-layer windows as Megatron configures them: ``window_size`` on the layers its
    ``is_layer_window_attention`` selects; a window a causal layer cannot have fails at build time."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_hsap.megatron.attention import layer_window_size

    def config(**kwargs) -> TransformerConfig:
        return TransformerConfig(num_layers=4, hidden_size=16, num_attention_heads=4, **kwargs)

    every_second_full = config(window_size=(64, 0), window_attn_skip_freq=2)
    assert [layer_window_size(every_second_full, n) for n in (1, 2, 3, 4)] == [(64, 0), None, (64, 0), None]
    pattern = config(window_size=(8, -1), window_attn_skip_freq=[0, 1, 1, 0])
    assert [layer_window_size(pattern, n) for n in (1, 2, 3, 4)] == [None, (8, 0), (8, 0), None]
    assert layer_window_size(config(), 1) is None and layer_window_size(config(window_size=(-1, -1)), 1) is None
    with pytest.raises(ValueError, match=r"window_size=\(4, 4\) has right=4 with causal=True"):
        layer_window_size(config(window_size=(4, 4)), 1)


def _megatron_windowed_model_body() -> None:
    """Megatron's own GPT (local spec: its unfused softmax applies the sliding-window mask) against the
    HSAP spec on 2 CP ranks, with a window on layer 1 and full attention on layer 2 (window_attn_skip_freq=2)."""
    import dataclasses

    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_hsap.config import ContextParallelConfig
    from megatron_hsap.megatron.attention import HSAPPackedSeqParams
    from megatron_hsap.megatron.cpu_shim import apply_cpu_shim
    from megatron_hsap.megatron.spec import get_gpt_layer_hsap_spec
    from megatron_hsap.parallel_state import destroy_model_parallel, get_cp_topology, initialize_model_parallel
    from megatron_hsap.sequence.plan import plan_batch
    from tests.test_megatron_integration import SEQ, VOCAB, _tiny_config

    apply_cpu_shim()
    config = dataclasses.replace(_tiny_config(), window_size=(9, 0), window_attn_skip_freq=2)

    def gpt(spec) -> GPTModel:
        torch.manual_seed(7)
        return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                        position_embedding_type="rope")

    cp_config = ContextParallelConfig(mode="hybrid", ulysses_size=1, kernel="cpu_fused")
    initialize_model_parallel(context_parallel_size=1, cp_config=cp_config)
    model_parallel_cuda_manual_seed(1)
    tokens = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = gpt(get_gpt_layer_local_spec())(tokens, None, None)  # one document, [1, SEQ, VOCAB]
    destroy_model_parallel()
    initialize_model_parallel(context_parallel_size=2, cp_config=cp_config)
    model_parallel_cuda_manual_seed(1)
    model = gpt(get_gpt_layer_hsap_spec(cp_config))
    assert [layer.self_attention.hsap_window_size for layer in model.decoder.layers] == [(9, 0), None]
    plan = plan_batch(torch.tensor([0, SEQ], dtype=torch.int32), get_cp_topology(), "zigzag")
    cu = torch.tensor([0, SEQ], dtype=torch.int32)
    params = HSAPPackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=SEQ,
                                 max_seqlen_kv=SEQ, plan=plan)
    with torch.no_grad():
        local = model(plan.shard(tokens[0]).unsqueeze(0), plan.position_ids.unsqueeze(0), None,
                      packed_seq_params=params)
    torch.testing.assert_close(plan.unshard(local[0]), expected[0], rtol=1e-5, atol=1e-5)


def test_megatron_model_with_per_layer_windows_matches_megatron():
    from tests.distributed import run_distributed_fresh

    run_distributed_fresh(_megatron_windowed_model_body, 2, timeout=180)
