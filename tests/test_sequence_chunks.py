"""Sequence-chunked MLP and loss (megatron_hsap/megatron/sequence_chunks.py): loss and every gradient equal to
Megatron's unchunked path, in float64 (so any wrong tile or chunk shows as an O(1) error), and the peak
intermediate bytes follow the chunk size."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed_fresh

HIDDEN, HEADS, SEQ, VOCAB, LAYERS = 32, 4, 48, 96, 2


def _config():
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_hsap.megatron.cpu_shim import cpu_config_overrides

    return TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=2,
                             ffn_hidden_size=80, hidden_dropout=0.0, attention_dropout=0.0,
                             bias_dropout_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False,
                             gradient_accumulation_fusion=False, apply_rope_fusion=False,
                             params_dtype=torch.float64, **cpu_config_overrides())


def _losses_and_grads(mlp_chunks: int, loss_chunks: int, tokens: torch.Tensor, labels: torch.Tensor):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_hsap.megatron.sequence_chunks import HSAPGPTModel, TiledMLP
    from megatron_hsap.megatron.spec import _use_tiled_mlp

    model_parallel_cuda_manual_seed(1)
    spec = get_gpt_layer_local_spec()
    if mlp_chunks > 1:
        _use_tiled_mlp(spec, mlp_chunks)
    torch.manual_seed(5)
    model = HSAPGPTModel(config=_config(), transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                         position_embedding_type="rope", loss_sequence_chunks=loss_chunks).double()
    assert (type(model.decoder.layers[0].mlp) is TiledMLP) == (mlp_chunks > 1)
    loss = model(tokens, None, None, labels=labels)  # [1, SEQ] per-token losses (causal, one document)
    (loss * torch.linspace(0.5, 1.5, SEQ, dtype=loss.dtype)).sum().backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _exactness_body():
    from megatron_hsap.megatron.cpu_shim import apply_cpu_shim
    from megatron_hsap.parallel_state import initialize_model_parallel

    apply_cpu_shim()
    initialize_model_parallel(context_parallel_size=1)
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (1, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (1, SEQ), generator=gen)
    ref_loss, ref_grads = _losses_and_grads(1, 1, tokens, labels)
    errors = {}
    for mlp_chunks, loss_chunks in ((4, 1), (SEQ, 1), (1, 5), (7, 3), (SEQ, SEQ)):
        loss, grads = _losses_and_grads(mlp_chunks, loss_chunks, tokens, labels)
        errors[(mlp_chunks, loss_chunks)] = max(
            [(loss - ref_loss).abs().max().item()] + [(grads[n] - g).abs().max().item() for n, g in ref_grads.items()])
    return errors, len(ref_grads), ref_loss.abs().max().item()


def test_chunked_mlp_and_loss_match_megatron():
    """fp64 model. Tiled MLP alone: equal to Megatron's to 1e-12. With the chunked loss: Megatron's reference
    cross-entropy computes in fp32 whatever the input (``vocab_parallel_cross_entropy`` casts), the chunked one
    in fp64 for fp64 inputs, so they agree to fp32 rounding (its exactness in fp64 is checked below)."""
    errors, n_params, loss_scale = run_distributed_fresh(_exactness_body, 1, timeout=300)[0]
    assert n_params > 10 and loss_scale > 1.0
    for (mlp_chunks, loss_chunks), err in errors.items():
        assert err < (1e-12 if loss_chunks == 1 else 1e-5), errors


@pytest.mark.parametrize("chunks", [1, 3, 8, 40])
def test_chunked_loss_exact_in_fp64(chunks):
    """Loss, hidden gradient and weight gradient vs a dense fp64 cross-entropy over full logits."""
    from megatron_hsap.megatron.sequence_chunks import chunked_output_cross_entropy

    s, b, h, v = 40, 1, 12, 50
    gen = torch.Generator().manual_seed(chunks)
    hidden = torch.randn(s, b, h, generator=gen, dtype=torch.float64).requires_grad_()
    weight = torch.randn(v, h, generator=gen, dtype=torch.float64).requires_grad_()
    labels = torch.randint(0, v, (b, s), generator=gen)
    scale = torch.rand(b, s, generator=gen, dtype=torch.float64)
    loss = chunked_output_cross_entropy(hidden, weight, labels, chunks)
    (loss * scale).sum().backward()
    got = [loss.detach(), hidden.grad, weight.grad]
    hidden.grad = weight.grad = None
    logits = (hidden @ weight.t()).transpose(0, 1)  # [b, s, v]
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, v), labels.reshape(-1), reduction="none").view(b, s)
    (ref * scale).sum().backward()
    for a, r in zip(got, [ref.detach(), hidden.grad, weight.grad]):
        assert (a - r).abs().max().item() < 1e-12


def test_chunk_bounds_and_errors():
    from megatron_hsap.megatron.sequence_chunks import chunked_output_cross_entropy, sequence_chunk_bounds

    assert sequence_chunk_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert sequence_chunk_bounds(2, 4) == [(0, 1), (1, 2)]
    with pytest.raises(ValueError, match="chunks=0 must be a positive int"):
        sequence_chunk_bounds(5, 0)
    with pytest.raises(ValueError, match=r"hidden must be \[s, b, h\]"):
        chunked_output_cross_entropy(torch.zeros(4, 1, 8), torch.zeros(16, 8), torch.zeros(4, 1, dtype=torch.long), 2)


def test_chunked_loss_peak_follows_chunk():
    """The loss's peak live bytes (fwd + bwd) are one chunk's fp32 logits, not the whole sequence's."""
    from megatron_hsap.instrumentation.memory import track_peak_memory
    from megatron_hsap.megatron.sequence_chunks import chunked_output_cross_entropy

    s, h, v = 512, 16, 1000
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(s, 1, h, generator=gen).requires_grad_()
    weight = torch.randn(v, h, generator=gen).requires_grad_()
    labels = torch.randint(0, v, (1, s), generator=gen)
    peaks = {}
    for chunks in (1, 8):
        with track_peak_memory("cpu") as mem:
            chunked_output_cross_entropy(hidden, weight, labels, chunks).sum().backward()
        hidden.grad = weight.grad = None
        peaks[chunks] = mem.peak_bytes
    logits = s * v * 4
    assert peaks[1] >= logits
    assert peaks[8] < peaks[1] / 4, peaks


def test_flag_defaults():
    """hsap: MLP tiles of about `hidden` tokens and loss chunks of 2048 tokens per rank; other modes: unchunked."""
    from megatron_hsap.training.arguments import parse_args

    demo = parse_args(["--demo"], world_size=8)  # hsap, 1024 tokens on 8 CP ranks, hidden 64
    assert (demo.mlp_sequence_chunks, demo.loss_sequence_chunks) == (2, 1)
    long = parse_args(["--demo", "--seq-length", "65536"], world_size=8)
    assert (long.mlp_sequence_chunks, long.loss_sequence_chunks) == (128, 4)
    plain = parse_args(["--demo", "--context-parallel-mode", "ulysses"], world_size=8)
    assert (plain.mlp_sequence_chunks, plain.loss_sequence_chunks) == (1, 1)
    chosen = parse_args(["--demo", "--mlp-sequence-chunks", "3", "--loss-sequence-chunks", "5"], world_size=8)
    assert (chosen.mlp_sequence_chunks, chosen.loss_sequence_chunks) == (3, 5)
    with pytest.raises(SystemExit):
        parse_args(["--demo", "--mlp-sequence-chunks", "0"], world_size=8)
