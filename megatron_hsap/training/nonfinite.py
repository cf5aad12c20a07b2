"""``--check-for-nan-in-loss-and-grad``: find NaN/Inf in the loss, the gradients and attention outputs, per rank.

Megatron-LM checks the loss in the loss function and each gradient bucket before its
data-parallel all-reduce, and stops the job. Here every rank records, during the
forward-backward pass and without synchronising: whether its loss was non-finite,
whether its own gradients were before the data-parallel reduction mixes them
(``check_grads``, run first thing in ``finalize_model_grads``), and which attention
layer's output first was. ``raise_if_found`` then shares one ``[world, 3]`` tensor,
and if any rank found anything every rank raises the same error naming iteration,
ranks and layers, before the optimizer step, so the step is never applied.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

__all__ = ["NonFiniteCheck"]


def _not_finite(t: torch.Tensor) -> torch.Tensor:
    return ~torch.isfinite(t).all()


class NonFiniteCheck:
    """Per-iteration NaN/Inf bookkeeping for this rank's model chunks (DDP-wrapped GPTModels)."""

    def __init__(self, model: List[Any]) -> None:
        self.model = model
        self.device = next(p for chunk in model for p in chunk.parameters()).device
        self.bad_grads: Optional[str] = None
        self._reset()
        for chunk in model:
            for name, module in chunk.named_modules():
                if name.endswith("self_attention"):
                    module.register_forward_hook(self._attention_hook)

    def _reset(self) -> None:
        self.loss_bad = torch.zeros((), dtype=torch.bool, device=self.device)
        self.grad_bad = torch.zeros((), dtype=torch.bool, device=self.device)
        self.attention_bad: Dict[int, torch.Tensor] = {}  # global layer number -> output ever non-finite
        self.bad_grads = None

    def _attention_hook(self, module: Any, _inputs: Any, output: Any) -> None:
        out = output[0] if isinstance(output, tuple) else output
        layer = int(module.layer_number)
        bad = _not_finite(out.detach())
        self.attention_bad[layer] = self.attention_bad[layer] | bad if layer in self.attention_bad else bad

    def record_loss(self, local_loss_sum: torch.Tensor) -> None:
        """Note a micro-batch's (this rank's) loss sum."""
        self.loss_bad = self.loss_bad | _not_finite(local_loss_sum.detach())

    def check_grads(self) -> None:
        """Look at this rank's gradients before they are reduced over data-parallel ranks."""
        named = [(name, getattr(p, "main_grad", None) if getattr(p, "main_grad", None) is not None else p.grad)
                 for chunk in self.model for name, p in chunk.named_parameters()]
        named = [(name, g) for name, g in named if g is not None]
        if not named:
            return
        bad = torch.stack([_not_finite(g) for _, g in named])
        self.grad_bad = bad.any()
        if bool(self.grad_bad):
            count, first = int(bad.sum()), named[int(torch.nonzero(bad)[0])][0].removeprefix("module.")
            self.bad_grads = f"{count} of {len(named)} tensors, e.g. {first}"

    def raise_if_found(self, iteration: int) -> None:
        """Collective (all ranks): RuntimeError on every rank when any rank saw NaN/Inf in this iteration."""
        world, rank = dist.get_world_size(), dist.get_rank()
        table = torch.zeros(world, 3, dtype=torch.float64, device=self.device)
        table[rank, 0], table[rank, 1] = self.loss_bad.double(), self.grad_bad.double()
        if self.attention_bad:
            numbers = torch.tensor(sorted(self.attention_bad), dtype=torch.float64, device=self.device)
            bad = torch.stack([self.attention_bad[n] for n in sorted(self.attention_bad)])
            first = torch.where(bad, numbers, torch.full_like(numbers, float("inf"))).min()
            table[rank, 2] = torch.where(torch.isinf(first), torch.zeros_like(first), first)  # 0: none
        dist.all_reduce(table)
        bad_grads = self.bad_grads
        self._reset()
        found = []
        for r, (loss_bad, grad_bad, layer) in enumerate(table.tolist()):
            what = ([f"attention output of layer {int(layer)}"] if layer else []) + (["loss"] if loss_bad else [])
            if grad_bad:
                what.append("gradients" + (f" ({bad_grads})" if r == rank and bad_grads else ""))
            if what:
                found.append(f"rank {r}: {', '.join(what)}")
        if found:
            raise RuntimeError(f"NaN/Inf at iteration {iteration}, the optimizer step was not applied. "
                               f"{'; '.join(found)}. (--no-check-for-nan-in-loss-and-grad turns this check off)")
