"""Megatron-style distributed checkpoints: ``<dir>/iter_0000010/`` + ``latest_checkpointed_iteration.txt``.

Model and optimizer are saved as sharded state dicts, so a checkpoint reloads at
other TP/PP/DP/CP sizes (the distributed optimizer uses its fully-resharding
format). Loading validates the directory on every rank and agrees on the outcome
with one all-reduce before any collective read, so a bad checkpoint stops every
rank with the same message instead of hanging some of them.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

__all__ = ["save_checkpoint", "load_checkpoint", "latest_iteration"]

_TRACKER = "latest_checkpointed_iteration.txt"


def _iter_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _unwrap(chunk: Any) -> Any:
    """The GPTModel inside Megatron's DDP wrapper: checkpoint keys are the model's own (as Megatron-LM's)."""
    return getattr(chunk, "module", chunk)


def _state_dict(model: List[Any], optimizer: Any, scheduler: Any, iteration: int, is_loading: bool) -> Dict[str, Any]:
    state: Dict[str, Any] = {"iteration": iteration, "opt_param_scheduler": scheduler.state_dict()}
    if len(model) == 1:
        state["model"] = _unwrap(model[0]).sharded_state_dict()
    else:
        for i, chunk in enumerate(model):
            state[f"model{i}"] = _unwrap(chunk).sharded_state_dict()
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading)
    return state


def save_checkpoint(root: str, iteration: int, model: List[Any], optimizer: Any, scheduler: Any) -> str:
    """Write iteration ``iteration``'s checkpoint under ``root`` (collective); returns its directory."""
    from megatron.core import dist_checkpointing

    path = _iter_dir(root, iteration)
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(_state_dict(model, optimizer, scheduler, iteration, is_loading=False), path)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(root, _TRACKER), "w") as f:
            f.write(str(iteration))
    dist.barrier()
    return path


def latest_iteration(root: str) -> Optional[int]:
    """The iteration recorded in ``root``'s tracker file, None if there is none; ValueError if it is unreadable."""
    tracker = os.path.join(root, _TRACKER)
    if not os.path.exists(tracker):
        return None
    try:
        with open(tracker) as f:
            return int(f.read().strip())
    except (OSError, ValueError) as err:
        raise ValueError(f"--load {root!r}: cannot read {_TRACKER} ({err})") from err


def _check_loadable(root: str) -> Optional[int]:
    from megatron.core import dist_checkpointing

    iteration = latest_iteration(root)
    if iteration is None:
        return None
    path = _iter_dir(root, iteration)
    if not dist_checkpointing.check_is_distributed_checkpoint(path):
        raise ValueError(f"--load {root!r}: {path} is not a readable distributed checkpoint")
    return iteration


def load_checkpoint(root: str, model: List[Any], optimizer: Any, scheduler: Any, load_optimizer: bool = True) -> int:
    """Load the latest checkpoint under ``root`` into model/optimizer/scheduler; returns its iteration (0 if none).

    Raises RuntimeError on every rank (never a hang) when the checkpoint cannot be read.
    """
    from megatron.core import dist_checkpointing

    problem = ""
    try:
        iteration = _check_loadable(root)
    except ValueError as err:
        problem, iteration = str(err), None
    flag = torch.tensor([1.0 if problem else 0.0])
    dist.all_reduce(flag)
    if flag.item() > 0:
        raise RuntimeError(problem or f"--load {root!r}: another rank could not read the checkpoint")
    if iteration is None:
        return 0
    opt = optimizer if load_optimizer else None
    try:
        state = dist_checkpointing.load(_state_dict(model, opt, scheduler, iteration, is_loading=True),
                                        _iter_dir(root, iteration))
    except Exception as err:  # noqa: BLE001 - any read failure becomes one clear message
        raise RuntimeError(f"--load {root!r}: failed to read iteration {iteration}: "
                           f"{type(err).__name__}: {err}") from err
    if len(model) == 1:
        _unwrap(model[0]).load_state_dict(state["model"])
    else:
        for i, chunk in enumerate(model):
            _unwrap(chunk).load_state_dict(state[f"model{i}"])
    if opt is not None:
        opt.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["opt_param_scheduler"])
    return int(state["iteration"])
