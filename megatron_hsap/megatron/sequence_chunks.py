"""Sequence-chunked work outside attention: the MLP in sequence tiles with recompute, and the output layer +
cross-entropy in sequence chunks, so neither ``[t, ffn]`` intermediates nor ``[t, vocab]`` logits ever exist
for the whole sequence (at millions of tokens per rank they dominate the activation memory).

Both are exact: every token's result is computed by the same operations as in the unchunked path; only the
weight gradients are summed chunk by chunk (in the GEMM's accumulation, then into the gradient).

- ``TiledMLP``: Megatron's ``MLP`` (same parameters and state-dict keys) whose training forward runs
  ``chunks`` sequence tiles without keeping their graphs; the backward recomputes one tile at a time and
  backpropagates it (as DeepSpeed ALST's tiled MLP). Live intermediates: one tile's.
- ``chunked_output_cross_entropy``: logits and the vocab-parallel cross-entropy of ``chunks`` sequence
  chunks; the forward keeps only each token's log-sum-exp, the backward recomputes one chunk's logits.
- ``HSAPGPTModel``: Megatron's ``GPTModel`` using it for the training loss (``loss_sequence_chunks > 1``).
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch
from megatron.core.models.gpt import GPTModel
from torch.distributed import ProcessGroup, ReduceOp
from megatron.core.transformer.mlp import MLP

__all__ = ["TiledMLP", "HSAPGPTModel", "chunked_output_cross_entropy", "sequence_chunk_bounds"]


def sequence_chunk_bounds(length: int, chunks: int) -> List[Tuple[int, int]]:
    """``chunks`` contiguous ranges covering ``[0, length)``, sizes differing by at most one (empty ones dropped)."""
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks={chunks!r} must be a positive int")
    base, extra = divmod(length, chunks)
    bounds, start = [], 0
    for i in range(chunks):
        end = start + base + (1 if i < extra else 0)
        if end > start:
            bounds.append((start, end))
        start = end
    return bounds


class _TiledMLPFunction(torch.autograd.Function):
    """``hidden [s, b, h]`` -> MLP output ``[s, b, h]`` tile by tile; parameters get their gradients from the
    per-tile recompute in the backward (AccumulateGrad, so Megatron's DDP hooks see every tile)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, mlp: "TiledMLP", chunks: int, kwargs: dict) -> torch.Tensor:
        ctx.mlp, ctx.chunks, ctx.kwargs = mlp, chunks, kwargs
        ctx.save_for_backward(hidden)
        output = None
        for start, end in sequence_chunk_bounds(hidden.shape[0], chunks):
            out, _ = MLP.forward(mlp, hidden[start:end], **kwargs)
            if output is None:
                output = out.new_empty((hidden.shape[0],) + tuple(out.shape[1:]))
            output[start:end] = out
            del out  # one tile's intermediates live at a time
        return output

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (hidden,) = ctx.saved_tensors
        dhidden = torch.empty_like(hidden)
        for start, end in sequence_chunk_bounds(hidden.shape[0], ctx.chunks):
            tile = hidden[start:end].detach().requires_grad_()
            with torch.enable_grad():
                out, _ = MLP.forward(ctx.mlp, tile, **ctx.kwargs)
            torch.autograd.backward(out, grad[start:end])
            dhidden[start:end] = tile.grad
            del out, tile  # before the next tile's recompute
        return dhidden, None, None, None


class TiledMLP(MLP):
    """Megatron's MLP computed in ``sequence_chunks`` sequence tiles with recompute while training.

    Build through a layer spec (``get_gpt_layer_hsap_spec(..., mlp_sequence_chunks=N)``). Inference, no-grad
    forwards and ``sequence_chunks == 1`` run Megatron's MLP unchanged.
    """

    def __init__(self, *args: Any, sequence_chunks: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        sequence_chunk_bounds(1, sequence_chunks)  # validates
        self.sequence_chunks = sequence_chunks

    @classmethod
    def as_mlp_submodule(cls, *args: Any, sequence_chunks: int = 1, **kwargs: Any) -> "TiledMLP":
        """The layer-spec builder of megatron-core 0.18+ (``functools.partial(TiledMLP.as_mlp_submodule,
        submodules=..., sequence_chunks=N)``): Megatron's ``MLP.as_mlp_submodule``, then tiled."""
        sequence_chunk_bounds(1, sequence_chunks)  # validates before building
        mlp = super().as_mlp_submodule(*args, **kwargs)
        mlp.sequence_chunks = sequence_chunks
        return mlp

    def forward(self, hidden_states: torch.Tensor, per_token_scale: Optional[torch.Tensor] = None, **kwargs: Any):
        """hidden_states ``[s, b, h]`` -> (output ``[s, b, h]``, output bias or None), as Megatron's MLP."""
        if self.sequence_chunks == 1 or not torch.is_grad_enabled() or per_token_scale is not None:
            return super().forward(hidden_states, per_token_scale=per_token_scale, **kwargs)
        bias = self.linear_fc2.bias if self.linear_fc2.skip_bias_add else None
        return _TiledMLPFunction.apply(hidden_states, self, self.sequence_chunks, kwargs), bias


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Per-token loss ``[b, s]`` of logits = hidden @ weight^T over this TP rank's vocab shard, in chunks."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunks: int,
                tp_group: Optional[ProcessGroup]) -> torch.Tensor:
        s, b, _ = hidden.shape
        vocab_start = _tp_rank(tp_group) * weight.shape[0]
        acc = _acc_dtype(hidden.dtype)
        loss = torch.empty(s, b, dtype=acc, device=hidden.device)
        lse = torch.empty(s, b, dtype=acc, device=hidden.device)
        for start, end in sequence_chunk_bounds(s, chunks):
            logits = torch.matmul(hidden[start:end], weight.t()).to(acc)  # [c, b, V/tp]
            top = logits.amax(dim=-1)
            _all_reduce(top, tp_group, torch.distributed.ReduceOp.MAX)
            sum_exp = (logits - top.unsqueeze(-1)).exp_().sum(dim=-1)
            _all_reduce(sum_exp, tp_group)
            target = _target_logits(logits, labels[:, start:end].t(), vocab_start)
            _all_reduce(target, tp_group)
            lse[start:end] = top + sum_exp.log()
            loss[start:end] = lse[start:end] - target
            del logits, sum_exp, target  # one chunk's logits live at a time
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.chunks, ctx.vocab_start = chunks, vocab_start
        return loss.t().contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        hidden, weight, labels, lse = ctx.saved_tensors
        grad = grad.t()  # [s, b]
        dhidden = torch.empty_like(hidden)
        dweight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        for start, end in sequence_chunk_bounds(hidden.shape[0], ctx.chunks):
            h = hidden[start:end]
            logits = torch.matmul(h, weight.t()).to(lse.dtype)
            probs = logits.sub_(lse[start:end].unsqueeze(-1)).exp_()  # softmax over the full vocab
            local = labels[:, start:end].t() - ctx.vocab_start
            inside = (local >= 0) & (local < weight.shape[0])
            rows = probs.view(-1, probs.shape[-1])
            hit = inside.reshape(-1).nonzero().squeeze(-1)
            rows[hit, local.reshape(-1)[hit]] -= 1.0
            dlogits = probs.mul_(grad[start:end].unsqueeze(-1)).to(hidden.dtype)
            dhidden[start:end] = torch.matmul(dlogits, weight)
            if dweight is not None:
                dweight.addmm_(dlogits.reshape(-1, dlogits.shape[-1]).t(), h.reshape(-1, h.shape[-1]))
            del logits, probs, rows, dlogits  # before the next chunk's logits
        return dhidden, dweight, None, None, None


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax arithmetic in fp32 (as Megatron's cross-entropy), fp64 for fp64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _tp_rank(group: Optional[ProcessGroup]) -> int:
    return 0 if group is None else torch.distributed.get_rank(group)


def _all_reduce(t: torch.Tensor, group: Optional[ProcessGroup], op: Optional[ReduceOp] = None) -> None:
    if group is not None and torch.distributed.get_world_size(group) > 1:
        torch.distributed.all_reduce(t, op=op or torch.distributed.ReduceOp.SUM, group=group)


def _target_logits(logits: torch.Tensor, labels: torch.Tensor, vocab_start: int) -> torch.Tensor:
    """logits ``[c, b, V/tp]`` at labels ``[c, b]`` where they fall into this shard, else 0."""
    local = labels - vocab_start
    inside = (local >= 0) & (local < logits.shape[-1])
    picked = logits.gather(-1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    return picked.masked_fill_(~inside, 0.0)


def chunked_output_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunks: int,
                                 tp_group: Optional[ProcessGroup] = None) -> torch.Tensor:
    """Per-token cross-entropy ``[b, s]`` (fp32; fp64 for fp64 inputs) of ``hidden [s, b, h]``
    (all this rank's tokens, after any sequence-parallel gather) through the vocab-parallel output weight
    ``[V/tp, h]`` with ``labels [b, s]``, ``chunks`` sequence chunks at a time: Megatron's ``output_layer``
    + ``vocab_parallel_cross_entropy`` without the ``[s, b, V/tp]`` logits.
    ``tp_group``: the tensor-parallel group (None = no TP)."""
    if hidden.dim() != 3 or labels.shape != (hidden.shape[1], hidden.shape[0]):
        raise ValueError(f"hidden must be [s, b, h] and labels [b, s]; got {tuple(hidden.shape)} and "
                         f"{tuple(labels.shape)}")
    sequence_chunk_bounds(1, chunks)
    return _ChunkedCrossEntropy.apply(hidden, weight, labels, chunks, tp_group)


class HSAPGPTModel(GPTModel):
    """Megatron's GPTModel whose training loss runs ``chunked_output_cross_entropy`` (``loss_sequence_chunks``
    > 1); logits requests (no labels), multi-token prediction and inference use Megatron's path."""

    def __init__(self, *args: Any, loss_sequence_chunks: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        sequence_chunk_bounds(1, loss_sequence_chunks)
        self.loss_sequence_chunks = loss_sequence_chunks

    def _postprocess(self, hidden_states, input_ids, position_ids, labels, *args: Any, **kwargs: Any):
        if (labels is None or self.loss_sequence_chunks == 1 or kwargs.get("mtp_in_postprocess")
                or kwargs.get("inference_context") is not None):
            return super()._postprocess(hidden_states, input_ids, position_ids, labels, *args, **kwargs)
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            gather_from_sequence_parallel_region,
        )

        layer = self.output_layer
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights \
            else layer.weight
        tp_group = self.pg_collection.tp
        if layer.sequence_parallel and tp_group.size() > 1:
            hidden = gather_from_sequence_parallel_region(hidden_states, group=tp_group)
        elif tp_group.size() > 1:
            hidden = copy_to_tensor_model_parallel_region(hidden_states, group=tp_group)
        else:
            hidden = hidden_states
        return chunked_output_cross_entropy(hidden, weight, labels, self.loss_sequence_chunks,
                                            tp_group if tp_group.size() > 1 else None)
