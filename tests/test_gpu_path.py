"""The GPU path checked on CPU, device-agnostically: where the model lives, which GPU a rank takes, what
per-plan tensors are copied to the device and how often, and that the hot path never waits for the device.

- Model placement: the ``meta`` device stands in for "the configured device" (``torch.cuda.current_device()``
  on a GPU), so a parameter or buffer left on the CPU shows, which the CPU shim's cuda->cpu mapping would hide.
- Device index: ``LOCAL_RANK % torch.cuda.device_count()``.
- Host synchronisation: a dispatch mode counts the operations that make the host wait for the device on
  CUDA (``.item()``, ``bool(tensor)``, ``nonzero``, ``.tolist()``, ``.cpu()``) during forward and backward.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from tests.distributed import run_distributed_fresh

VOCAB, SEQ = 128, 64
FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", str(SEQ),
         "--micro-batch-size", "1", "--vocab-size", str(VOCAB), "--tokenizer-type", "NullTokenizer",
         "--mock-data", "--train-iters", "20", "--lr", "1e-4", "--min-lr", "1e-5"]


def _args() -> argparse.Namespace:
    from megatron_hsap.training.arguments import parse_args

    return parse_args(FLAGS, world_size=1)


# ---------------------------------------------------------------- defect 5: the device index

def test_local_rank_maps_onto_the_visible_gpus():
    from megatron_hsap.training.loop import local_device_index

    assert [local_device_index(rank, 1) for rank in range(4)] == [0, 0, 0, 0]  # several ranks on one GPU
    assert [local_device_index(rank, 8) for rank in (0, 7, 8, 13)] == [0, 7, 0, 5]
    with pytest.raises(ValueError, match="device_count=0"):
        local_device_index(0, 0)


def test_init_distributed_sets_the_shared_device(monkeypatch):
    """Rank 3 of 4 on a machine with one GPU sets device 0 (set_device(3) would fail there)."""
    from megatron_hsap.training import loop

    chosen = []
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(loop.dist, "init_process_group", lambda **kwargs: None)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # gloo's thread setting: not this process's
    loop._init_distributed(argparse.Namespace(distributed_backend="gloo", distributed_timeout_minutes=1))
    assert chosen == [0]


# ---------------------------------------------------------------- defect 1: every parameter on the model's device

def _model_devices_body() -> list:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_hsap.megatron.cpu_shim import apply_cpu_shim
    from megatron_hsap.parallel_state import initialize_model_parallel
    from megatron_hsap.training import model as model_module
    from megatron_hsap.training.arguments import cp_config_from_args

    apply_cpu_shim()
    args = _args()
    initialize_model_parallel(context_parallel_size=1, cp_config=cp_config_from_args(args))
    model_parallel_cuda_manual_seed(args.seed)
    config = model_module.transformer_config(args)
    model_module.model_device = lambda: torch.device("meta")  # the configured device (a fresh process)
    chunks = model_module.build_model(args, config, cp_config_from_args(args), VOCAB)
    return sorted({f"{name}:{t.device}" for m in chunks for name, t in
                   list(m.module.named_parameters()) + list(m.module.named_buffers()) if t.device.type != "meta"})


def test_every_parameter_and_buffer_is_on_the_model_device_before_ddp():
    """Without TE the layer spec's norms are the CPU shim's torch norms: they must follow the model's device
    like every other parameter (Megatron's optimizer rejects CPU weights in a GPU run)."""
    (elsewhere,) = run_distributed_fresh(_model_devices_body, 1, timeout=180)
    assert elsewhere == []


def test_the_shim_norm_is_built_where_megatron_builds_its_layers(monkeypatch):
    """``use_cpu_initialization=False``: on ``torch.cuda.current_device()`` (here ``meta``), not on the CPU; in
    ``params_dtype`` like Megatron's own layers (fp32 norms in a bf16 model broke the bf16 optimizer's checkpoint)."""
    from megatron_hsap.megatron.cpu_shim import SequenceParallelTorchNorm

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "meta")
    for normalization in ("LayerNorm", "RMSNorm"):
        config = argparse.Namespace(normalization=normalization, sequence_parallel=False,
                                    use_cpu_initialization=False, params_dtype=torch.bfloat16)
        norm = SequenceParallelTorchNorm(config, 16)
        assert {(p.device.type, p.dtype) for p in norm.parameters()} == {("meta", torch.bfloat16)}, normalization
        config.use_cpu_initialization = True
        assert {p.device.type for p in SequenceParallelTorchNorm(config, 16).parameters()} == {"cpu"}


# ---------------------------------------------------------------- defect 4: per-plan tensors and host syncs

class HostSyncCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the operations that make the host wait for the device when the tensors live on a GPU.

    Dispatched operations (``.item()``, ``bool(t)``, ``int(t)``: ``_local_scalar_dense``; ``nonzero``;
    ``torch.equal``) are seen by the mode; ``.tolist()``, ``.cpu()`` and ``.numpy()`` do not dispatch for CPU
    tensors, so they are wrapped while the counter is active.
    """

    SYNC_OPS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::equal", "aten::is_nonzero",
                "aten::masked_select", "aten::unique")
    WRAPPED = ("tolist", "cpu", "numpy")

    def __init__(self) -> None:
        super().__init__()
        self.seen: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in self.SYNC_OPS:
            self.seen.append(func._schema.name)
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self._saved = {name: getattr(torch.Tensor, name) for name in self.WRAPPED}
        for name, method in self._saved.items():
            def counted(tensor, *args, _name=name, _method=method, **kwargs):
                self.seen.append(f"Tensor.{_name}")
                return _method(tensor, *args, **kwargs)
            setattr(torch.Tensor, name, counted)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, method in self._saved.items():
            setattr(torch.Tensor, name, method)
        return super().__exit__(*exc)


def test_the_sync_counter_sees_each_kind_of_sync():
    x = torch.arange(4.0)
    with HostSyncCounter() as counter:
        x.sum().item(), bool(x.any()), x.nonzero(), x.tolist(), x.cpu()
    assert counter.seen == ["aten::_local_scalar_dense", "aten::_local_scalar_dense", "aten::nonzero",
                            "Tensor.tolist", "Tensor.cpu"]


SYNC_MODES = [  # (name, ContextParallelConfig kwargs, UPipe head chunk or None, window)
    ("ring", dict(mode="ring"), None, None),
    ("ulysses", dict(mode="ulysses"), None, None),
    ("hybrid", dict(mode="hsap", ulysses_size=2), None, None),
    ("hybrid-forwarding", dict(mode="hsap", ulysses_size=2, kv_forwarding=True), None, (5, 0)),
    ("upipe", dict(mode="ulysses"), 4, None),
]


def _host_syncs_body(kernel: str) -> dict:
    import torch.distributed as dist

    from megatron_hsap.attention import context_parallel_attention
    from megatron_hsap.attention.upipe import head_chunked_attention
    from megatron_hsap.config import ContextParallelConfig
    from megatron_hsap.parallel_state import destroy_model_parallel, initialize_model_parallel
    from megatron_hsap.sequence.doc_lengths import cu_seqlens_from_lengths
    from megatron_hsap.sequence.plan import plan_batch

    h, h_kv, d = 8, 4, 8
    found = {}
    for name, cp_kwargs, chunk, window in SYNC_MODES:
        hybrid = cp_kwargs["mode"] == "hsap"
        topo = initialize_model_parallel(context_parallel_size=dist.get_world_size(), ranks_per_node=2 if hybrid else 4,
                                         cp_config=ContextParallelConfig(kernel=kernel, **cp_kwargs))
        plan = plan_batch(cu_seqlens_from_lengths([23, 1, 40, 16]), topo, "zigzag")
        gen = torch.Generator().manual_seed(1)
        if chunk is None:
            inputs = [torch.randn(plan.tokens_per_rank, heads, d, generator=gen, requires_grad=True)
                      for heads in (h, h_kv, h_kv)]

            def step():
                out = context_parallel_attention(*inputs, plan, causal=True, window_size=window)
                out.backward(torch.ones_like(out))
        else:
            hidden = torch.randn(plan.tokens_per_rank, 1, h * d, generator=gen, requires_grad=True)
            weight = torch.randn((h + 2 * h_kv) * d, h * d, generator=gen, requires_grad=True)
            weight.main_grad = torch.zeros(weight.shape)

            def step():
                out = head_chunked_attention(hidden, weight, None, plan, num_heads_q=h, num_heads_kv=h_kv, head_dim=d,
                                             head_chunk_size=chunk, window_size=window)
                out.backward(torch.ones_like(out))
        step()  # the first call per plan may build and agree on schedules (host work, once per plan)
        with HostSyncCounter() as counter:
            step()
        found[name] = counter.seen
        destroy_model_parallel()
    return found


def test_no_host_sync_in_the_attention_hot_path():
    """Forward and backward of every mode, once the plan's schedules exist: nothing makes the host wait (on a GPU
    each such call stalls the stream's queue, per layer and micro-batch). The reference kernel: the GPU fallback."""
    for rank_found in run_distributed_fresh(_host_syncs_body, 4, "torch", timeout=240):
        assert rank_found == {name: [] for name, *_ in SYNC_MODES}


def _position_copies_body(head_chunk_size: int) -> list:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_hsap.megatron.cpu_shim import apply_cpu_shim
    from megatron_hsap.parallel_state import initialize_model_parallel
    from megatron_hsap.training.arguments import cp_config_from_args
    from megatron_hsap.training.model import build_gpt_chunk, transformer_config
    from megatron_hsap.training.packing import pack_micro_batch

    apply_cpu_shim()
    args = _args()
    args.head_chunk_size = head_chunk_size
    cp_config = cp_config_from_args(args)
    topology = initialize_model_parallel(context_parallel_size=1, cp_config=cp_config)
    model_parallel_cuda_manual_seed(args.seed)
    model = build_gpt_chunk(args, transformer_config(args), cp_config, VOCAB, True, True, None)
    assert args.num_layers == 2 and args.position_embedding_type == "rope"
    tokens = torch.randint(1, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(0))
    tokens[0, 20] = 0  # two documents
    batch = {"tokens": tokens, "labels": tokens.roll(-1, dims=1), "loss_mask": torch.ones(1, SEQ),
             "position_ids": torch.arange(SEQ).unsqueeze(0)}
    copies = []
    for _ in range(2):  # two micro-batches of one plan
        packed = pack_micro_batch(batch, 0, True, topology, cp_config.resolved_layout)
        host_positions = packed.packed_seq_params.plan.position_ids

        class CountCopies(torch.overrides.TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if func in (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.copy_) and \
                        any(a is host_positions for a in args):
                    copies.append(func.__name__)
                return func(*args, **(kwargs or {}))

        with CountCopies():
            mb = packed.to(torch.device("cpu"))
            model(mb.tokens, mb.position_ids, None, labels=mb.labels, packed_seq_params=mb.packed_seq_params)
    return copies


@pytest.mark.parametrize("head_chunk_size", [1, 4], ids=["upipe", "all-heads"])
def test_plan_positions_are_copied_once_per_micro_batch_not_per_layer(head_chunk_size):
    """The plan's RoPE positions go to the device with the micro-batch (once per device, the plan's device
    cache); the attention layers reuse that copy (the layer loop used to copy them in every layer)."""
    (copies,) = run_distributed_fresh(_position_copies_body, 1, head_chunk_size, timeout=180)
    assert copies == ["to", "to"]  # one per micro-batch, however many layers
