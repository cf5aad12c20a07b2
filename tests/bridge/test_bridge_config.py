"""``configure_hsap`` / ``attach_cp_topology``: what they set on a Bridge config, and every rejection (clear ValueError)."""

from __future__ import annotations

import pytest

from tests.bridge.bridge_cases import _recipe_module, attach_topology_over_other_groups
from tests.distributed import run_distributed

from megatron_hsap.training.bridge import HSAPLayerSpec, configure_hsap
from megatron_hsap.config import ContextParallelConfig


def test_configure_hsap_sets_spec_groups_and_hook():
    cfg = _recipe_module().tiny_gpt_recipe(context_parallel_size=4, mode="hsap", ranks_per_node=2)
    assert cfg.model.transformer_layer_spec == HSAPLayerSpec(ContextParallelConfig(mode="hsap"))
    assert cfg.model.hierarchical_context_parallel_sizes == [2, 2]  # Ulysses inside the 2-rank "node", ring across
    assert cfg.dist.distributed_backend == "gloo" and cfg.model.batch_p2p_comm is False
    assert len(cfg.model._pre_wrap_hooks) == 1


@pytest.mark.parametrize("change, message", [
    ({"pipeline_model_parallel_size": 2}, r"pipeline_model_parallel_size=2 .*allowed: 1"),
    ({"calculate_per_token_loss": True}, r"calculate_per_token_loss=True .*allowed: False"),
    ({"hierarchical_context_parallel_sizes": [2, 2]}, r"hierarchical_context_parallel_sizes .*leave it None"),
    ({"context_parallel_size": 4, "num_attention_heads": 6}, r"num_attention_heads \(6\) must be divisible"),
])
def test_configure_hsap_rejects(change, message):
    cfg = _recipe_module().tiny_gpt_recipe()  # CP = 1: nothing set that a second call would refuse
    for name, value in change.items():
        setattr(cfg.model, name, value)
    with pytest.raises(ValueError, match=message):
        configure_hsap(cfg, ContextParallelConfig(mode="ulysses"))


def test_configure_hsap_rejects_cp_config_type():
    with pytest.raises(ValueError, match="cp_config must be a ContextParallelConfig"):
        configure_hsap(_recipe_module().tiny_gpt_recipe(), "hsap")


def test_attach_topology_over_groups_without_hsap_sizes():
    assert run_distributed(attach_topology_over_other_groups, 2, timeout=300) == [1, 1]
