"""Megatron-Bridge ``pretrain()`` with HSAP's layer spec, topology transform and forward step, on CPU ranks.

Equivalence: Bridge's reduced ``lm loss`` per iteration with HSAP context parallelism (CP = 2 and 4,
hsap mode, the 4-rank case as 2 emulated nodes so Ulysses and ring are both used; and CP = 2 x DP = 2)
equals the same model and data at CP = 1; at CP = 1, HSAP's forward step equals Bridge's own forward step with
Megatron's local layer spec (so the HSAP path is Megatron's model). Checkpoints: Bridge's torch_dist
save at iteration 2 and a resumed run reproduce the uninterrupted run's losses.
"""

from __future__ import annotations

import pytest

from tests.bridge.bridge_cases import pretrain_losses
from tests.distributed import run_distributed

ITERS = 4
TIMEOUT = 600


@pytest.fixture(scope="module")
def cp1_losses():
    """Reference: the same recipe on one rank (CP = 1), packed documents."""
    return run_distributed(pretrain_losses, 1, train_iters=ITERS, timeout=TIMEOUT)[0]


@pytest.mark.parametrize("world, ranks_per_node, hierarchy", [(2, 1, "ring 2"), (4, 2, "Ulysses 2 x ring 2")])
def test_bridge_cp_losses_match_cp1(cp1_losses, world, ranks_per_node, hierarchy):
    per_rank = run_distributed(pretrain_losses, world, context_parallel_size=world, mode="hsap",
                               ranks_per_node=ranks_per_node, train_iters=ITERS, timeout=TIMEOUT)
    assert len(cp1_losses) == ITERS and len(set(cp1_losses)) == ITERS  # training moves the loss
    for rank, losses in enumerate(per_rank):
        assert losses == pytest.approx(cp1_losses, rel=2e-5, abs=0), f"CP={world} ({hierarchy}), rank {rank}"


def test_bridge_cp2_dp2_losses_match_cp1_dp2():
    """4 ranks = CP 2 x DP 2: gradients averaged over DP x CP and the loss reduced over both, against CP = 1 x DP 2."""
    reference = run_distributed(pretrain_losses, 2, train_iters=ITERS, global_batch_size=4, timeout=TIMEOUT)
    per_rank = run_distributed(pretrain_losses, 4, context_parallel_size=2, ranks_per_node=1, train_iters=ITERS,
                               global_batch_size=4, timeout=TIMEOUT)
    assert reference[0] == reference[1] and len(set(reference[0])) == ITERS
    for rank, losses in enumerate(per_rank):
        assert losses == pytest.approx(reference[0], rel=2e-5, abs=0), f"rank {rank}"


def test_bridge_hsap_cp1_matches_bridge_forward_step():
    """Without document masking, HSAP's spec + forward step train exactly like Bridge's own on Megatron's spec."""
    hsap = run_distributed(pretrain_losses, 1, train_iters=ITERS, documents=False, timeout=TIMEOUT)[0]
    own = run_distributed(pretrain_losses, 1, bridge_forward_step=True, train_iters=ITERS, documents=False,
                          timeout=TIMEOUT)[0]
    assert hsap == pytest.approx(own, rel=2e-5, abs=0)


def test_bridge_checkpoint_save_resume(tmp_path, cp1_losses):
    """CP = 2: a run stopped and saved at iteration 2 (Bridge torch_dist), resumed by a new run up to iteration 4."""
    ckpt = str(tmp_path / "ckpt")
    first = run_distributed(pretrain_losses, 2, context_parallel_size=2, ranks_per_node=1, train_iters=ITERS,
                            exit_interval=2, save=ckpt, save_interval=100, timeout=TIMEOUT)
    resumed = run_distributed(pretrain_losses, 2, context_parallel_size=2, ranks_per_node=1, train_iters=ITERS,
                              load=ckpt, save=ckpt, save_interval=100, timeout=TIMEOUT)
    for rank in range(2):
        assert len(first[rank]) == 2 and len(resumed[rank]) == ITERS - 2
        assert first[rank] + resumed[rank] == pytest.approx(cp1_losses, rel=2e-5, abs=0)
