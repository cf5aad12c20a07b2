"""Rank bodies for the Megatron-Bridge tests (module-level, so tests/distributed.py can send them to workers).

Importing this module applies ``apply_bridge_cpu_shim`` (and so imports Bridge): the forkserver preloads
it (conftest.py). The model and data are the example recipe's (examples/bridge_pretrain_hsap.py).
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
from typing import Any, List

from megatron_hsap.megatron.cpu_shim import apply_bridge_cpu_shim

apply_bridge_cpu_shim()

from megatron.bridge.training.callbacks import Callback  # noqa: E402
from megatron.bridge.training.initialize import destroy_global_state  # noqa: E402
from megatron.bridge.training.pretrain import pretrain  # noqa: E402

_EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                        "examples", "bridge_pretrain_hsap.py")


def _recipe_module() -> Any:
    spec = importlib.util.spec_from_file_location("bridge_pretrain_hsap", _EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _RecordLosses(Callback):
    """Bridge's reduced ``lm loss`` of every training iteration."""

    def __init__(self) -> None:
        self.losses: List[float] = []

    def on_train_step_end(self, context: Any) -> None:
        self.losses.append(float(context.loss_dict["lm loss"]))


def pretrain_losses(bridge_forward_step: bool = False, **recipe_kwargs: Any) -> List[float]:
    """Bridge ``pretrain()`` on the example recipe; the per-iteration losses this rank saw.

    bridge_forward_step: train with Bridge's own forward step and Megatron's local layer spec instead
    of HSAP's (the reference for CP=1 without document masking).
    The harness's workers are daemonic, which multiprocessing forbids to have children, but the
    torch_dist checkpoint writer starts a Manager and writer processes: when saving, this worker
    is marked non-daemonic (it exits normally, and multiprocessing then stops those children).
    """
    if recipe_kwargs.get("save"):
        multiprocessing.current_process()._config["daemon"] = False
    from megatron_hsap.training.bridge import forward_step

    cfg = _recipe_module().tiny_gpt_recipe(**recipe_kwargs)
    step = forward_step
    if bridge_forward_step:
        from megatron.bridge.training.gpt_step import forward_step as step
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        cfg.model.transformer_layer_spec = get_gpt_layer_local_spec(normalization=cfg.model.normalization)
    recorder = _RecordLosses()
    try:
        pretrain(cfg, forward_step_func=step, callbacks=[recorder])
    except SystemExit as stop:  # Bridge's exit_interval: sys.exit(0) after saving, without its usual teardown
        if stop.code not in (0, None):
            raise
        destroy_global_state()
    return recorder.losses


def attach_topology_over_other_groups() -> int:
    """Groups built without HSAP's hierarchical sizes (as a plain Megatron/Bridge setup would): the Ulysses and
    ring sub-groups are built on top; returns the resolved Ulysses size."""
    from megatron.core import parallel_state as mpu

    from megatron_hsap.config import ContextParallelConfig
    from megatron_hsap.parallel_state import attach_cp_topology

    mpu.initialize_model_parallel(context_parallel_size=2)
    topo = attach_cp_topology(ContextParallelConfig(mode="hsap"), ranks_per_node=1)
    assert topo.ring_size == 2 and topo.cp_size == 2
    return topo.ulysses_size
