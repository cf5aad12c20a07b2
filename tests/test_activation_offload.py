"""Layer checkpoints in host memory (``megatron_hsap.megatron.activation_offload``): what is copied, what is not,
and gradients equal to the run without offload. The training-script path (``--offload-checkpointed-activations``
with full recompute, CP 4 hsap) is compared with CP 1 in ``tests/test_training_pretrain.py``."""

from __future__ import annotations

import torch

from tests.distributed import run_distributed_fresh


def _checkpointed_layers_body():
    """Three Megatron-checkpointed "layers" (``tensor_parallel.checkpoint``, as --recompute-granularity full):
    under ``HostOffload`` each saves its input on the host; gradients equal those without offload."""
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_hsap.megatron.activation_offload import saved_activations_on_host
    from megatron_hsap.megatron.cpu_shim import apply_cpu_shim
    from megatron_hsap.parallel_state import initialize_model_parallel

    apply_cpu_shim()
    initialize_model_parallel(context_parallel_size=1)
    model_parallel_cuda_manual_seed(1)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(64, 64, generator=gen) / 8) for _ in range(3)]
    x0 = torch.randn(256, 1, 64, generator=gen)

    def run(offload: bool):
        x = x0.clone().requires_grad_()
        context = saved_activations_on_host(offload, x.device)
        with context:
            h = x
            for w in weights:
                h = tensor_parallel.checkpoint(lambda a, w=w: torch.tanh(a @ w), False, h)
        h.square().sum().backward()  # outside the context: the recompute keeps its activations on the device
        grads = [x.grad] + [w.grad.clone() for w in weights]
        for w in weights:
            w.grad = None
        return grads, context

    plain, _ = run(False)
    offloaded, context = run(True)
    layer_input_bytes = x0.numel() * x0.element_size()
    return {"offloaded_bytes": context.offloaded_bytes, "layer_input_bytes": layer_input_bytes,
            "equal": all(torch.equal(a, b) for a, b in zip(plain, offloaded))}


def test_checkpointed_layer_inputs_go_to_the_host_and_gradients_are_unchanged():
    got = run_distributed_fresh(_checkpointed_layers_body, 1, timeout=120)[0]
    assert got["offloaded_bytes"] == 3 * got["layer_input_bytes"], got  # one saved input per layer, nothing else
    assert got["equal"], got


def test_parameters_and_tensors_off_the_device_stay_where_they_are():
    from megatron_hsap.megatron.activation_offload import HostOffload, saved_activations_on_host

    x = torch.randn(32, 16, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(16, 8))
    with HostOffload(torch.device("cpu")) as offload:
        y = x @ weight  # saves x (an activation) and weight (a parameter)
    assert offload.offloaded_bytes == x.numel() * x.element_size()
    y.sum().backward()
    assert torch.equal(weight.grad, x.detach().t() @ torch.ones(32, 8))

    before = HostOffload.total_offloaded_bytes
    with HostOffload(torch.device("meta")) as elsewhere:  # the compute device is not where x lives: no copy
        (x * x).sum().backward()
    assert elsewhere.offloaded_bytes == 0 and HostOffload.total_offloaded_bytes == before
    with saved_activations_on_host(False, x.device):  # disabled: no hooks at all
        (x * x).sum().backward()
    assert HostOffload.total_offloaded_bytes == before
