"""Run Megatron-Core (0.16.1 to 0.19.2) on CPU ranks (gloo): every CUDA-only spot, patched in one place.

Megatron-Core assumes a GPU in a handful of places that have nothing to do with
the model maths. ``apply_cpu_shim()`` patches exactly those, and only when this
process uses no CUDA device (``torch.cuda.is_available()`` is False); on a GPU it
does nothing, so GPU runs execute unmodified Megatron-Core. It is idempotent.
Each patch below names the CUDA-only call it replaces.

Patches (each the smallest change that made a CPU run work):

1. RNG tracker (``tensor_parallel.random``): ``CudaRNGStatesTracker.add/fork``
   and ``_get/_set_cuda_rng_state`` read and write the CUDA generator. They are
   redirected to the CPU generator, so ``model_parallel_cuda_manual_seed``,
   tensor-parallel initialisation and activation recomputation keep working
   with per-TP-rank seeds.
2. ``torch.cuda.current_device()`` (rotary embedding, GlobalMemoryBuffer, TP
   mappings and layers, p2p communication, grad buffers, checkpoint saver) is
   used as a ``device=`` argument: it returns ``"cpu"``.
3. ``torch.cuda.synchronize()`` (p2p communication, async checkpoint writer):
   a no-op, CPU ops are synchronous. From 0.19 (``versions.GRAD_SYNC_USES_CUDA_STREAMS``) every
   gradient sync also calls ``torch.cuda.current_stream()`` (``param_and_grad_buffer``): it returns
   a stream that orders nothing (``_CpuStream``).
4. Hard-coded ``device="cuda"`` / ``.cuda()`` (pipeline schedules, clip_grads,
   optimizer, grad scaler, distributed optimizer) and ``pin_memory=True`` (rotary
   CP slicing): a ``TorchFunctionMode`` maps such device arguments to CPU, drops
   the pinning and makes ``Tensor.cuda()`` a no-op.
5. Type checks ``param.type() == 'torch.cuda.FloatTensor'`` (clip_grads, the
   mixed-precision and distributed optimizers): the same mode reports CPU
   tensors' ``Tensor.type()`` under the CUDA name Megatron expects.
6. Model-config settings (``cpu_config_overrides()``, merged into the
   TransformerConfig by the trainer): ``batch_p2p_comm=False`` because gloo's
   ``batch_isend_irecv`` pairs messages by posting order, and with PP=2 the
   interleaved schedule sends to "next" and "prev" (the same peer) in one batch,
   which swapped activations (losses differed from PP=1); ``batch_p2p_sync=False``
   (no CUDA sync); ``use_cpu_initialization=True``.
7. Sequence parallelism with torch norms: Megatron's ``WrappedTorchNorm``
   refuses ``sequence_parallel``; ``SequenceParallelTorchNorm`` (used by the
   HSAP layer spec on CPU) is a plain torch LayerNorm/RMSNorm whose parameters
   carry ``sequence_parallel=True`` so their gradients are all-reduced over TP
   like Megatron's fused norms.
8. The TransformerEngine layer spec without TransformerEngine
   (``transformer_engine_spec_without_te()``, a context manager): Megatron's
   ``get_gpt_layer_with_transformer_engine_spec`` needs ``TESpecProvider``, whose
   module imports TE-only names (import-only placeholders here, removed right
   after the import) and probes the TE version for q/k norms (answered with
   ``TENorm``). The spec it returns names Megatron's TE placeholders, which cannot
   build a model (``HSAPSelfAttention`` refuses them); it exists so the spec's
   structure can be inspected and tested on CPU.

Megatron-Bridge's ``pretrain()`` needs a few more spots (B1-B5), applied by
``apply_bridge_cpu_shim()``, and Megatron-LM's own training loop (``megatron.training``) others
(L1-L6), applied by ``apply_megatron_lm_cpu_shim()``; both are listed in their sections at the
end of this module. What differs between megatron-core releases is keyed in ``versions.py``.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import importlib
import importlib.util
import types
from typing import Any, Dict, Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode

from megatron_hsap.megatron import versions

__all__ = ["apply_cpu_shim", "apply_bridge_cpu_shim", "apply_megatron_lm_cpu_shim", "cpu_config_overrides", "SequenceParallelTorchNorm",
           "transformer_engine_spec_without_te"]

_ACTIVE = False
_MODE: Optional[TorchFunctionMode] = None


def _to_cpu_device(device: Any) -> Any:
    """Map a CUDA device spec (``'cuda'``, ``'cuda:0'``, ``torch.device('cuda')``, an int) to ``'cpu'``."""
    if isinstance(device, int) and not isinstance(device, bool):
        return "cpu"
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return "cpu"
    return device


class _CudaToCpuMode(TorchFunctionMode):
    """Patches 4 and 5: CUDA device arguments become CPU; CPU tensors report CUDA type names."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0], _to_cpu_device(args[1])) + tuple(args[2:])
        return func(*args, **kwargs)


class _CpuStream:
    """Patch 3 and B5: a stand-in for a ``torch.cuda.Stream`` on CPU, where work is ordered already."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _CpuRNGStatesTrackerMixin:
    """Patch 1: the tracker's named states are CPU generator states."""

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"cuda rng state {name} already exists")
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise Exception(f"cuda rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


def apply_cpu_shim() -> bool:
    """Apply the patches listed in the module docstring if this process has no CUDA device.

    Returns True when the shim is (now or already) active, False on a GPU machine,
    where nothing is patched.
    """
    global _ACTIVE, _MODE
    if _ACTIVE:
        return True
    if torch.cuda.is_available():
        return False
    from megatron.core.tensor_parallel import random as mrandom

    base = mrandom.CudaRNGStatesTracker
    mrandom.CudaRNGStatesTracker = type("CpuRNGStatesTracker", (_CpuRNGStatesTrackerMixin, base), {})
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, *args, **kwargs: torch.set_rng_state(new_state)
    mrandom.initialize_rng_tracker(force_reset=True)
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda device=None: None
    if versions.GRAD_SYNC_USES_CUDA_STREAMS:
        torch.cuda.current_stream = lambda device=None: _CpuStream()
    _MODE = _CudaToCpuMode()
    _MODE.__enter__()
    _ACTIVE = True
    return True


def cpu_config_overrides() -> Dict[str, Any]:
    """Patch 6: TransformerConfig fields a CPU/gloo run must set (empty on a GPU machine)."""
    if torch.cuda.is_available():
        return {}
    return {"batch_p2p_comm": False, "batch_p2p_sync": False, "use_cpu_initialization": True}


class SequenceParallelTorchNorm:
    """Patch 7: a torch LayerNorm/RMSNorm usable with ``sequence_parallel=True`` (CPU layer specs).

    Called like Megatron's norm builders: ``(config, hidden_size, eps)``; returns a plain
    torch module whose parameters are marked for Megatron's TP gradient all-reduce, created on the
    device and in the dtype Megatron's own layers use (``torch.cuda.current_device()`` unless
    ``use_cpu_initialization``; ``params_dtype``): fp32 norms in a bf16 model would break the bf16
    optimizer's checkpoint (its state no longer lines up with the parameters) and the fused norm kernels.
    """

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5) -> torch.nn.Module:
        # where Megatron's own layers put their parameters (its use_cpu_initialization rule)
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        if config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps, device=device, dtype=config.params_dtype)
        elif config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps, device=device, dtype=config.params_dtype)
        else:
            raise ValueError(f"normalization={config.normalization!r} is not supported; "
                             "allowed: 'LayerNorm', 'RMSNorm'")
        for param in norm.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)
        return norm


#: Names ``transformer_engine_spec_provider`` imports that Megatron defines only when TE is installed.
_TE_ONLY_NAMES = ("TEActivationOp", "TEColumnParallelGroupedLinear", "TERowParallelGroupedLinear")


class _NeedsTransformerEngine:
    """Import-only placeholder for a TE-only class name (patch 8); never built."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise ImportError("this module needs transformer_engine, which is not installed")


@contextlib.contextmanager
def transformer_engine_spec_without_te() -> Iterator[None]:
    """Patch 8: lets ``get_gpt_layer_with_transformer_engine_spec`` build its ModuleSpec tree without TE.

    Does nothing where TE is installed. Inside the context ``gpt_layer_specs.TESpecProvider``
    is Megatron's provider with ``layer_norm`` answering ``TENorm`` without the TE-version probe.
    """

    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.models.gpt import gpt_layer_specs

    if te_ext.HAVE_TE:
        yield
        return
    missing = [name for name in _TE_ONLY_NAMES if not hasattr(te_ext, name)]
    for name in missing:
        setattr(te_ext, name, _NeedsTransformerEngine)
    try:
        provider = importlib.import_module("megatron.core.extensions.transformer_engine_spec_provider")
    finally:
        for name in missing:
            delattr(te_ext, name)

    class SpecProviderWithoutTE(provider.TESpecProvider):
        def layer_norm(self, rms_norm: bool = False, for_qk: bool = False, **kwargs: Any) -> Any:
            # 0.19 adds has_residual (MoE layers); its residual-norm variant needs TE too, so either answer
            # serves a spec that is only inspected
            return te_ext.TENorm

    gpt_layer_specs.TESpecProvider = SpecProviderWithoutTE
    try:
        yield
    finally:
        del gpt_layer_specs.TESpecProvider


# --------------------------------------------------------------------------------------------------
# Megatron-Bridge 0.3.1 on CPU ranks (``apply_bridge_cpu_shim``; docs/bridge.md)
#
# Bridge's own ``pretrain()`` runs unmodified on CPU ranks once these spots are bridged (each found by
# running it on a machine without CUDA, TransformerEngine or triton):
#
# B1. Unconditional imports of names that are never called on the pretrain path:
#     ``megatron.bridge.peft.lora`` / ``lora_layers`` import ``transformer_engine.pytorch`` (LoRA
#     adapters subclass ``te.Linear``) and ``megatron.core.inference...triton.tensor_ops`` (reached
#     through Bridge's Mamba provider) decorates kernels with ``triton.jit``. While Bridge is imported,
#     exactly those modules get import-only placeholders; the hook is removed right after the import
#     and no placeholder enters ``sys.modules``, so every other ``import transformer_engine`` still
#     fails and Megatron-Core's "TE installed?" checks stay False.
# B2. ``setup()`` calls ``initialize_megatron`` without ``allow_no_cuda``: passed as True.
# B3. ``compile_helpers()`` runs ``make`` in megatron/core/datasets, but the wheel ships the compiled
#     ``helpers_cpp`` and no Makefile: skipped when ``helpers_cpp`` imports.
# B4. ``_set_random_seed`` seeds the model-parallel RNG tracker only when a GPU is counted; without it
#     the tracker has no states (forks and checkpoints fail): it is seeded as on a GPU (the tracker
#     itself is CPU-backed by patch 1).
# B5. ``torch.cuda.Stream``/``stream``/``current_stream`` around DDP wrapping (model_provider) and
#     ``torch.cuda.get_rng_state``/``set_rng_state`` in checkpointing: those two modules see a
#     ``torch`` whose ``cuda`` namespace has CPU stand-ins (a stream that orders nothing, an empty
#     CUDA RNG state); everything else is the real ``torch``.
# Configuration a CPU run must choose (not patched): ``cfg.dist.distributed_backend = "gloo"`` and
# the TransformerConfig fields of ``cpu_config_overrides()``.
# --------------------------------------------------------------------------------------------------

_BRIDGE_ACTIVE = False
#: Importing module -> top-level packages it imports unconditionally although nothing calls them (B1).
_IMPORT_ONLY_PLACEHOLDERS = {
    "megatron.bridge.peft.lora": ("transformer_engine",),
    "megatron.bridge.peft.lora_layers": ("transformer_engine",),
    "megatron.core.inference.contexts.attention_context.triton.tensor_ops": ("triton",),
}
#: The Bridge modules ``megatron_hsap.training.bridge`` and its tests use; importing them imports the rest.
_BRIDGE_MODULES = ("megatron.bridge.training.pretrain", "megatron.bridge.training.gpt_step",
                   "megatron.bridge.training.setup", "megatron.bridge.training.initialize",
                   "megatron.bridge.training.checkpointing", "megatron.bridge.models.model_provider")


class _PlaceholderType(type):
    """B1: any attribute is another placeholder and calling one gives a placeholder, so module-level
    code (``class X(te.Linear)``, ``@triton.jit``, ``tl.constexpr`` annotations) can execute."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _PlaceholderType(f"{cls.__name__}.{name}", (), {})

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        return _PlaceholderType(f"{cls.__name__}(...)", (), {})


class _PlaceholderModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _PlaceholderType(f"{self.__name__}.{name}", (), {})


@contextlib.contextmanager
def _import_only_placeholders():
    """B1: while active, the listed importers get placeholders for their missing packages."""
    real_import = builtins.__import__

    def guarded_import(name, globals=None, locals=None, fromlist=(), level=0):
        try:
            return real_import(name, globals, locals, fromlist, level)
        except ImportError:
            importer = (globals or {}).get("__name__", "")
            if level != 0 or name.split(".")[0] not in _IMPORT_ONLY_PLACEHOLDERS.get(importer, ()):
                raise
            return _PlaceholderModule(name if fromlist else name.split(".")[0])

    builtins.__import__ = guarded_import
    try:
        yield
    finally:
        builtins.__import__ = real_import


class _NamespaceProxy(types.ModuleType):
    """A module that answers from ``overrides`` first, then from the wrapped module (B5)."""

    def __init__(self, target: types.ModuleType, overrides: Dict[str, Any]) -> None:
        super().__init__(target.__name__)
        self.__dict__.update(overrides)
        self._target = target

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)


def _cpu_torch() -> types.ModuleType:
    """B5: ``torch`` with CPU stand-ins for the stream and CUDA-RNG calls of Bridge's DDP wrapping and checkpoints."""
    cuda = _NamespaceProxy(torch.cuda, {
        "Stream": _CpuStream,
        "stream": lambda stream=None: contextlib.nullcontext(),
        "current_stream": lambda device=None: _CpuStream(),
        "get_rng_state": lambda device="cuda": torch.empty(0, dtype=torch.uint8),
        "set_rng_state": lambda new_state, device="cuda": None,
    })
    return _NamespaceProxy(torch, {"cuda": cuda})


def apply_bridge_cpu_shim() -> bool:
    """``apply_cpu_shim()`` plus the Megatron-Bridge spots B1-B5 above; imports Bridge.

    Returns True when active, False on a CUDA machine (Bridge is then imported unmodified).
    Idempotent. Raises ImportError when megatron-bridge is not installed (``make venv-bridge``).
    """
    global _BRIDGE_ACTIVE
    if _BRIDGE_ACTIVE:
        return True
    if not apply_cpu_shim():
        for name in _BRIDGE_MODULES:
            importlib.import_module(name)
        return False
    with _import_only_placeholders():
        modules = {name: importlib.import_module(name) for name in _BRIDGE_MODULES}
    setup, initialize = modules["megatron.bridge.training.setup"], modules["megatron.bridge.training.initialize"]
    setup.initialize_megatron = functools.partial(initialize.initialize_megatron, allow_no_cuda=True)
    initialize.compile_helpers = _compile_helpers_unless_shipped(initialize.compile_helpers)
    initialize._set_random_seed = _seed_rng_tracker_too(initialize._set_random_seed)
    cpu_torch = _cpu_torch()
    for name in ("megatron.bridge.models.model_provider", "megatron.bridge.training.checkpointing"):
        modules[name].torch = cpu_torch
    _BRIDGE_ACTIVE = True
    return True


def _compile_helpers_unless_shipped(compile_helpers: Any) -> Any:
    """B3."""

    def maybe_compile() -> None:
        if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is None:
            compile_helpers()

    return maybe_compile


def _seed_rng_tracker_too(set_random_seed: Any) -> Any:
    """B4 (and L3): run the seeding as if one GPU were counted, so it also seeds the (CPU) RNG tracker."""

    def seed(*args: Any, **kwargs: Any) -> Any:
        device_count = torch.cuda.device_count
        torch.cuda.device_count = lambda: 1
        try:
            return set_random_seed(*args, **kwargs)
        finally:
            torch.cuda.device_count = device_count

    return seed


# --------------------------------------------------------------------------------------------------
# Megatron-LM's own training loop (``megatron.training``) on CPU ranks (``apply_megatron_lm_cpu_shim``;
# docs/training.md, "Megatron-LM entry point"): ``megatron_hsap.training.megatron_lm.main`` runs its unmodified
# ``pretrain()`` once these spots are bridged (found by running it on a machine without CUDA/TE/apex):
#
# L1. ``pretrain()`` calls ``initialize_megatron`` without ``allow_no_cuda``: passed as True.
# L2. ``_compile_dependencies`` runs ``compile_helpers()`` (``make`` in megatron/core/datasets), but the
#     wheel ships the compiled ``helpers_cpp`` and no Makefile: skipped when ``helpers_cpp`` imports (B3).
# L3. ``_initialize_distributed`` builds the model-parallel groups, and ``_set_random_seed`` seeds the
#     RNG tracker, only when ``torch.cuda.device_count() > 0``: the process group is created with gloo
#     (from torchrun's environment) first, then both run as if one GPU were counted.
# L4. ``torch.cuda.Stream``/``stream``/``current_stream`` around DDP wrapping in ``training.get_model``:
#     that module sees the CPU stand-ins of B5.
# L5. ``validate_args`` asks ``get_device_arch_version()`` (a CUDA query) with TP or CP > 1, to require
#     ``CUDA_DEVICE_MAX_CONNECTIONS=1`` before Blackwell: answered 10, as no CUDA stream exists to limit.
# L6. Megatron-Core's rerun state machine (which Megatron-LM's ``train_step`` drives) saves and restores
#     ``torch.cuda.get_rng_state()``: that module sees the CPU stand-ins of B5.
# --------------------------------------------------------------------------------------------------

_MEGATRON_LM_ACTIVE = False


def apply_megatron_lm_cpu_shim() -> bool:
    """``apply_cpu_shim()`` plus Megatron-LM's training-module spots L1-L6 above; imports ``megatron.training``.

    Returns True when active, False on a CUDA machine (nothing patched). Idempotent.
    """
    global _MEGATRON_LM_ACTIVE
    if _MEGATRON_LM_ACTIVE:
        return True
    if not apply_cpu_shim():
        return False
    from megatron.core import rerun_state_machine
    from megatron.core.datasets import utils as dataset_utils
    from megatron.training import arguments, initialize, training

    training.initialize_megatron = functools.partial(initialize.initialize_megatron, allow_no_cuda=True)
    dataset_utils.compile_helpers = _compile_helpers_unless_shipped(dataset_utils.compile_helpers)
    initialize._initialize_distributed = _seed_rng_tracker_too(_gloo_first(initialize._initialize_distributed))
    initialize._set_random_seed = _seed_rng_tracker_too(initialize._set_random_seed)
    training.torch = rerun_state_machine.torch = _cpu_torch()
    arguments.get_device_arch_version = lambda: 10
    _MEGATRON_LM_ACTIVE = True
    return True


def _gloo_first(initialize_distributed: Any) -> Any:
    """L3: the default process group is gloo's (torchrun's env://) before Megatron-LM's initialisation runs."""

    def initialize(*args: Any, **kwargs: Any) -> Any:
        if not torch.distributed.is_initialized():
            torch.distributed.init_process_group("gloo")
        return initialize_distributed(*args, **kwargs)

    return initialize
