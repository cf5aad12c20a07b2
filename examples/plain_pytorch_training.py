# A plain PyTorch training loop with context parallelism (no Megatron model, no Megatron training loop):
# a tiny causal LM over packed documents, its tokens spread over the CP ranks, attention through
# megatron_hsap.context_parallel_varlen_attention. On CPU, 2 processes, a few seconds:
#     torchrun --nproc-per-node 2 examples/plain_pytorch_training.py
# Every rank sees the same global batch (as the CP ranks of one data-parallel rank do) and computes the
# model on its own tokens; the parameters' gradients are summed over the CP group, so every rank takes
# the same step as one process holding the whole batch would (tests/test_plain_pytorch_example.py checks
# that against an fp64 dense-attention run on one process).
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_hsap import context_parallel_varlen_attention, plan_for
from megatron_hsap.parallel_state import get_cp_topology

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MAX_DOC = 64, 32, 4, 2, 8, 64
#: ``attention(q, k, v, cu_seqlens)``: q ``[t, HEADS, HEAD_DIM]``, k/v ``[t, KV_HEADS, HEAD_DIM]`` -> ``[t, HEADS, HEAD_DIM]``.
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class TinyLM(torch.nn.Module):
    """One pre-norm transformer layer (GQA attention + MLP) over token and in-document position embeddings."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.position = torch.nn.Embedding(MAX_DOC, HIDDEN)
        self.norm1, self.norm2 = torch.nn.LayerNorm(HIDDEN), torch.nn.LayerNorm(HIDDEN)
        self.qkv = torch.nn.Linear(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
        self.proj = torch.nn.Linear(HEADS * HEAD_DIM, HIDDEN)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(HIDDEN, 4 * HIDDEN), torch.nn.GELU(),
                                       torch.nn.Linear(4 * HIDDEN, HIDDEN))
        self.head = torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor,
                attention: Attention) -> torch.Tensor:
        """tokens/positions ``[t]`` (this rank's tokens, in-document positions) -> logits ``[t, VOCAB]``."""
        x = self.embed(tokens) + self.position(positions)
        q, k, v = self.qkv(self.norm1(x)).split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
        t = x.shape[0]
        context = attention(q.view(t, HEADS, HEAD_DIM), k.view(t, KV_HEADS, HEAD_DIM), v.view(t, KV_HEADS, HEAD_DIM),
                            cu_seqlens)
        x = x + self.proj(context.reshape(t, -1))
        return self.head(x + self.mlp(self.norm2(x)))


def batch(step: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The global packed batch of ``step`` (the same on every rank): tokens ``[T]``, labels ``[T]`` (the next token
    of the document, -100 at its last token) and ``cu_seqlens``. Each document counts up by its own stride."""
    gen = torch.Generator().manual_seed(step)
    lengths = torch.randint(1, 40, (6,), generator=gen).tolist()
    tokens, labels = [], []
    for length in lengths:
        start, stride = torch.randint(0, VOCAB, (2,), generator=gen).tolist()
        doc = (start + (stride % 7 + 1) * torch.arange(length + 1)) % VOCAB
        tokens.append(doc[:-1])
        labels.append(torch.cat([doc[1:-1], torch.tensor([-100])]))
    cu_seqlens = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    return torch.cat(tokens), torch.cat(labels), cu_seqlens


def train(steps: int = 20, dtype: torch.dtype = torch.float32, attention: Optional[Attention] = None,
          layout: Optional[str] = None) -> Tuple[List[float], torch.Tensor]:
    """``steps`` Adam steps on this rank's share of each batch; returns the global loss of every step and the
    final parameters (flattened, the same on every CP rank). attention: default ``context_parallel_varlen_attention``."""
    attention = attention or (lambda q, k, v, cu: context_parallel_varlen_attention(q, k, v, cu, layout=layout))
    topology = get_cp_topology()
    torch.manual_seed(0)  # the same initial model on every rank
    model = TinyLM().to(dtype)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        tokens, labels, cu_seqlens = batch(step)
        plan = plan_for(cu_seqlens, layout)  # where each token lives; cached per document lengths
        local_labels = plan.shard(labels).masked_fill(~plan.valid_mask, -100)  # padding slots carry no loss
        logits = model(plan.shard(tokens), plan.position_ids, cu_seqlens, attention)
        # this rank's share of the batch's mean loss: the sum over its tokens / every rank's token count
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # the loss in fp32 at least
        loss = F.cross_entropy(logits, local_labels, ignore_index=-100, reduction="sum")
        loss = loss / (labels != -100).sum()
        optimizer.zero_grad()
        loss.backward()
        reported = loss.detach().double()
        if topology.cp_size > 1:  # the batch's gradient and loss are the sums over the CP ranks' tokens
            for parameter in model.parameters():
                dist.all_reduce(parameter.grad, group=topology.cp_group)
            dist.all_reduce(reported, group=topology.cp_group)
        optimizer.step()
        losses.append(reported.item())
    return losses, torch.cat([p.detach().flatten() for p in model.parameters()])


if __name__ == "__main__":
    import warnings

    from megatron_hsap.config import ContextParallelConfig
    from megatron_hsap.parallel_state import initialize_model_parallel

    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")  # CPU: Megatron's
    dist.init_process_group("gloo")  # on GPUs: "nccl", and the model on torch.cuda.current_device()
    initialize_model_parallel(context_parallel_size=dist.get_world_size(), cp_config=ContextParallelConfig(mode="ring"))
    losses, _ = train()
    if dist.get_rank() == 0:
        print(f"CP {dist.get_world_size()}: loss {losses[0]:.3f} at step 1, {losses[-1]:.3f} at step {len(losses)}")
    dist.destroy_process_group()
