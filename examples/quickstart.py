# Context-parallel attention over a packed batch, forward and backward, on 4 ranks emulating
# 2 nodes of 2 (Ulysses 2 inside a node x ring 2 across).
#     torchrun --nproc-per-node 4 examples/quickstart.py
import warnings

import torch
import torch.distributed as dist

from megatron_hsap.attention import context_parallel_attention
from megatron_hsap.config import ContextParallelConfig
from megatron_hsap.parallel_state import initialize_model_parallel
from megatron_hsap.sequence.doc_lengths import cu_seqlens_from_lengths
from megatron_hsap.sequence.plan import plan_batch

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")  # CPU: Megatron's notice
dist.init_process_group("gloo")  # on GPUs: "nccl", and the tensors below on torch.cuda.current_device()
topo = initialize_model_parallel(context_parallel_size=4, ranks_per_node=2,
                                 cp_config=ContextParallelConfig(mode="hsap"))
lengths = [300, 17, 1, 0, 190, 45, 3]  # documents packed into one global batch of 556 tokens
plan = plan_batch(cu_seqlens_from_lengths(lengths), topo, layout="sequence-aware")  # per batch, cached
torch.manual_seed(0)  # the same global tensors on every rank
q = torch.randn(sum(lengths), 8, 64)  # [T, h_q, d]
k = torch.randn(sum(lengths), 2, 64)  # [T, h_kv, d]
v = torch.randn(sum(lengths), 2, 64)
q_local, k_local, v_local = (plan.shard(x).requires_grad_() for x in (q, k, v))  # this rank's tokens
out = context_parallel_attention(q_local, k_local, v_local, plan)  # [t_local, 8, 64]
out.sum().backward()  # dq/dk/dv of this rank's tokens in q_local.grad, k_local.grad, v_local.grad
global_out = plan.unshard(out)  # [T, 8, 64] on every rank
if dist.get_rank() == 0:
    print(f"Ulysses {topo.ulysses_size} x ring {topo.ring_size}, {plan.tokens_per_rank} tokens per rank; "
          f"output {tuple(global_out.shape)}, dq {tuple(q_local.grad.shape)}")
dist.destroy_process_group()
