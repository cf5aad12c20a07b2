"""Megatron-Core integration: the CPU shim, the HSAP layer spec and convert_model_to_hsap.

Bodies run on fresh gloo workers (tests/distributed.py ``run_distributed_fresh``) so
the shim's process-wide patches never leak into other tests' processes.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed_fresh

HIDDEN, HEADS, SEQ, VOCAB = 64, 8, 64, 128


def _tiny_config(**extra):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_hsap.megatron.cpu_shim import cpu_config_overrides

    return TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=4,
                             hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False,
                             bias_activation_fusion=False, masked_softmax_fusion=False,
                             gradient_accumulation_fusion=False, apply_rope_fusion=False,
                             **cpu_config_overrides(), **extra)


def _gpt(spec, seed: int = 7, **config):
    from megatron.core.models.gpt import GPTModel

    torch.manual_seed(seed)
    return GPTModel(config=_tiny_config(**config), transformer_layer_spec=spec, vocab_size=VOCAB,
                    max_sequence_length=SEQ, position_embedding_type="rope")


def _shim_body():
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    from megatron_hsap.megatron.cpu_shim import apply_cpu_shim

    assert apply_cpu_shim() and apply_cpu_shim()  # idempotent
    assert torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.ones(1).cuda().device.type == "cpu"
    assert torch.ones(1).to("cuda:0").device.type == "cpu"
    assert torch.ones(1).type() == "torch.cuda.FloatTensor"
    assert torch.ones(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert torch.cuda.current_device() == "cpu"
    torch.cuda.synchronize()

    def draws():
        model_parallel_cuda_manual_seed(123, tp_rank=0, ep_rank=0, etp_rank=0, force_reset_rng=True)
        torch.manual_seed(5)
        with get_cuda_rng_tracker().fork():
            tracked = torch.randn(4)
        return tracked, torch.randn(4)

    tracked_a, default_a = draws()
    tracked_b, default_b = draws()
    assert torch.equal(tracked_a, tracked_b)  # the tracker's stream is reproducible ...
    torch.manual_seed(5)
    assert torch.equal(default_a, torch.randn(4))  # ... and forking it leaves the default stream untouched
    assert not torch.equal(tracked_a, default_a)


def test_cpu_shim():
    run_distributed_fresh(_shim_body, 1, timeout=120)


def _spec_and_convert_body():
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_hsap.config import ContextParallelConfig
    from megatron_hsap.megatron.attention import HSAPPackedSeqParams, HSAPSelfAttention
    from megatron_hsap.megatron.convert import convert_model_to_hsap
    from megatron_hsap.megatron.cpu_shim import apply_cpu_shim
    from megatron_hsap.megatron.spec import get_gpt_layer_hsap_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_hsap.parallel_state import destroy_model_parallel, get_cp_topology, initialize_model_parallel
    from megatron_hsap.sequence.plan import plan_batch

    apply_cpu_shim()
    cp_config = ContextParallelConfig(mode="ulysses")
    initialize_model_parallel(context_parallel_size=1, cp_config=cp_config)
    model_parallel_cuda_manual_seed(1)
    with pytest.raises(ValueError, match="cp_config must be a ContextParallelConfig"):
        get_gpt_layer_hsap_spec("ulysses")
    spec = get_gpt_layer_hsap_spec(cp_config)
    assert spec.submodules.self_attention.module is HSAPSelfAttention
    assert spec.submodules.self_attention.params["cp_config"] is cp_config

    # Megatron's own model (local spec), its state dict "saved before conversion".
    original = _gpt(get_gpt_layer_local_spec())
    saved = {k: v.clone() for k, v in original.state_dict().items() if isinstance(v, torch.Tensor)}
    tokens = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = original(tokens, None, None)  # one causal document, [1, SEQ, VOCAB]
    destroy_model_parallel()
    initialize_model_parallel(context_parallel_size=2, cp_config=cp_config)
    model_parallel_cuda_manual_seed(1)

    converted = _gpt(get_gpt_layer_local_spec(), seed=99)
    keys_before = list(converted.state_dict().keys())
    params_before = [id(p) for p in converted.parameters()]
    assert convert_model_to_hsap(converted, cp_config) == 2
    assert list(converted.state_dict().keys()) == keys_before
    assert [id(p) for p in converted.parameters()] == params_before
    converted.load_state_dict(saved, strict=True)

    built = _gpt(spec, seed=11)
    assert sorted(built.state_dict().keys()) == sorted(keys_before), set(built.state_dict()) ^ set(keys_before)
    built.load_state_dict(saved, strict=True)

    plan = plan_batch(torch.tensor([0, SEQ], dtype=torch.int32), get_cp_topology(), "zigzag")
    params = HSAPPackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, SEQ], dtype=torch.int32),
                                 cu_seqlens_kv=torch.tensor([0, SEQ], dtype=torch.int32), max_seqlen_q=SEQ,
                                 max_seqlen_kv=SEQ, plan=plan)
    local_tokens = plan.shard(tokens[0]).unsqueeze(0)
    for model in (converted, built):
        with torch.no_grad():
            local = model(local_tokens, plan.position_ids.unsqueeze(0), None, packed_seq_params=params)
        full = plan.unshard(local[0])
        torch.testing.assert_close(full, expected[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="needs packed_seq_params"):
        built(local_tokens, None, None)
    assert mpu.get_context_parallel_world_size() == 2


def test_spec_and_convert_match_megatron_attention_under_cp():
    run_distributed_fresh(_spec_and_convert_body, 2, timeout=240)


def test_convert_rejects_models_without_attention():
    from megatron_hsap.config import ContextParallelConfig
    from megatron_hsap.megatron.convert import convert_model_to_hsap

    with pytest.raises(ValueError, match="no megatron.core SelfAttention"):
        convert_model_to_hsap(torch.nn.Linear(2, 2), ContextParallelConfig())
    with pytest.raises(ValueError, match="cp_config must be a ContextParallelConfig"):
        convert_model_to_hsap(torch.nn.Linear(2, 2), "hsap")


def _core_attention_swap_point_body():
    """Megatron's SelfAttention.forward calls the spec's core_attention (a counting HSAPCoreAttention here), also
    through its selective recompute, which gives the same output and gradients."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_hsap.config import ContextParallelConfig
    from megatron_hsap.megatron.attention import HSAPCoreAttention, HSAPPackedSeqParams
    from megatron_hsap.megatron.cpu_shim import apply_cpu_shim
    from megatron_hsap.megatron.spec import get_gpt_layer_hsap_spec
    from megatron_hsap.parallel_state import get_cp_topology, initialize_model_parallel
    from megatron_hsap.sequence.plan import plan_batch

    calls = []

    class CountingCore(HSAPCoreAttention):
        def forward(self, *args, **kwargs):
            calls.append(self.layer_number)
            return super().forward(*args, **kwargs)

    apply_cpu_shim()
    cp_config = ContextParallelConfig(mode="ring")
    initialize_model_parallel(context_parallel_size=2, cp_config=cp_config)
    model_parallel_cuda_manual_seed(1)
    spec = get_gpt_layer_hsap_spec(cp_config)
    spec.submodules.self_attention.submodules.core_attention = CountingCore
    cu = torch.tensor([0, 40, SEQ], dtype=torch.int32)
    plan = plan_batch(cu, get_cp_topology(), "zigzag")
    params = HSAPPackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=40,
                                 max_seqlen_kv=40, plan=plan)
    tokens = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(3))
    results = []
    for config in ({}, {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}):
        model = _gpt(spec, seed=5, **config)
        calls.clear()
        out = model(plan.shard(tokens).unsqueeze(0), plan.position_ids.unsqueeze(0), None, packed_seq_params=params)
        out.float().square().sum().backward()
        results.append((plan.unshard(out[0].detach()), [p.grad.clone() for p in model.parameters()], sorted(calls)))
    (out, grads, plain_calls), (out_r, grads_r, recompute_calls) = results
    assert plain_calls == [1, 2] and recompute_calls == [1, 1, 2, 2], (plain_calls, recompute_calls)
    torch.testing.assert_close(out_r, out, rtol=0, atol=0)
    for a, b in zip(grads_r, grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_core_attention_is_megatrons_swap_point_also_under_selective_recompute():
    run_distributed_fresh(_core_attention_swap_point_body, 2, timeout=240)
