"""Console output as Megatron-LM's ``pretrain_gpt.py`` keeps it: warnings from rank 0 only, Megatron-Core's
notices about missing optional packages (TransformerEngine, Apex: every CPU run) summarised in one line, and
PyTorch's deprecation notices for Megatron-Core's own calls dropped.

Kept free of heavy imports: ``quiet_rank`` must run before Megatron-Core is imported.
"""

from __future__ import annotations

import importlib.util
import logging
import warnings

__all__ = ["KNOWN_FALLBACK_WARNINGS", "KNOWN_MEGATRON_DEPRECATIONS", "quiet_rank", "fallback_summary"]

#: Megatron-Core's import-time notices about TransformerEngine/Apex being absent (regexes matched at the start
#: of the message); ``fallback_summary`` says the same once.
KNOWN_FALLBACK_WARNINGS = ("Transformer Engine and Apex are not installed", "Apex is not installed")
#: PyTorch's deprecation notices for calls Megatron-Core (0.16) makes inside its distributed optimizer and
#: dist_checkpointing: nothing a user of this script can change (matched at the start of the message).
KNOWN_MEGATRON_DEPRECATIONS = (r"`torch\.distributed\.reduce_scatter_tensor` is deprecated",
                               r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
                               r"`load_state_dict` is deprecated",
                               r"Please use DTensor instead and we are deprecating ShardedTensor")
#: What torch 2.14's distributed checkpoint says about Megatron-Core 0.19's calls (UserWarnings), as above.
KNOWN_MEGATRON_CHECKPOINT_NOTICES = (r"torch\.distributed is disabled, unavailable or uninitialized",
                                     r"The argument order of load has been changed")
#: Import-time notices of the current stack (megatron-core 0.19 with the registry's CUDA build of torch on a
#: machine without CUDA) that say nothing about the run: absl is optional, MiMo is never used, pynvml (which
#: nvidia-modelopt pulls into the Bridge environment) is torch's to replace, and torch's
#: C++-extension module finds no CUDA runtime (the run is on CPU by design).
_IMPORT_NOTICES = ("absl.logging is not installed", "MimoModelConfig is experimental",
                   "The pynvml package is deprecated")
_TORCH_EXTENSION_LOG = ("torch.utils.cpp_extension", "No CUDA runtime is found")
#: TransformerLayer logs this for every layer whose MLP is not a type it knows; the sequence-tiled MLP
#: (megatron/sequence_chunks.py) is an MLP subclass and takes the default TP group, which is the right one.
_EXPECTED_LAYER_LOG = "Unknown MLP type"


def _not_expected(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(_EXPECTED_LAYER_LOG)


def quiet_rank(rank: int) -> None:
    """Silence every warning on ranks other than 0 and the known fallback notices on all ranks.

    Call it first in a rank, before Megatron-Core is imported (its notices are import-time warnings).
    """
    if rank != 0:
        warnings.filterwarnings("ignore")
    for message in KNOWN_FALLBACK_WARNINGS + _IMPORT_NOTICES:
        warnings.filterwarnings("ignore", message=message)
    for message in KNOWN_MEGATRON_DEPRECATIONS:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning)
    for message in KNOWN_MEGATRON_CHECKPOINT_NOTICES:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
    logging.getLogger("megatron.core.transformer.transformer_layer").addFilter(_not_expected)
    logger, message = _TORCH_EXTENSION_LOG
    logging.getLogger(logger).addFilter(lambda record: not record.getMessage().startswith(message))


def fallback_summary() -> str:
    """One line naming the optional packages Megatron-Core falls back from here ('' when all are installed)."""
    missing = [name for name, module in (("TransformerEngine", "transformer_engine"), ("Apex", "apex"))
               if importlib.util.find_spec(module) is None]
    if not missing:
        return ""
    return (f"megatron-hsap: {' and '.join(missing)} not installed: Megatron-Core uses its PyTorch fallbacks "
            "(optimizers, norms, multi-tensor kernels)")
