"""The megatron-core releases this package is tested with, and every behaviour keyed on the installed one.

Megatron-Core's internals drift between releases (layer-spec shapes, CUDA calls on the CPU path,
Megatron-LM's ``pretrain()`` signature). Everything in this package that depends on such an internal
asks this module, so supporting a new release means reading one file. The tested releases and the
stacks they run in are listed in docs/training.md ("Supported versions").

Importing the module checks the installed megatron-core against ``TESTED_RANGE`` once: outside it a
``UserWarning`` names the version and the range (the features below may then be wrong).
"""

from __future__ import annotations

import importlib.metadata
import logging
import warnings

from packaging.version import Version

__all__ = ["TESTED_RANGE", "MEGATRON_CORE_VERSION", "MLP_SPEC_IS_BUILDER", "GRAD_SYNC_USES_CUDA_STREAMS",
           "MEGATRON_TRAINING_IN_WHEEL", "PRETRAIN_TAKES_CONFIG_CONTAINER", "GPT_MODEL_LOGS_DEPRECATION",
           "NULL_TOKENIZER_LIBRARY", "NULL_TOKENIZER_VOCAB_INCLUDES_EOD",
           "check_megatron_core_version"]

#: Oldest and newest megatron-core releases tested (both ends inclusive); setup.cfg's requirement matches.
TESTED_RANGE = (Version("0.16.1"), Version("0.19.2"))


def _installed() -> Version:
    # megatron.core.__version__ may carry a local git suffix; the distribution's metadata does not
    return Version(importlib.metadata.version("megatron-core"))


#: The installed megatron-core release.
MEGATRON_CORE_VERSION = _installed()
_RELEASE = Version(MEGATRON_CORE_VERSION.base_version)

#: 0.18+: a layer spec's dense MLP is ``functools.partial(MLP.as_mlp_submodule, submodules=...)``, not
#: ``ModuleSpec(module=MLP, ...)`` (``spec._use_tiled_mlp`` rewrites whichever form this says).
MLP_SPEC_IS_BUILDER = _RELEASE >= Version("0.18")
#: 0.19+: every gradient sync calls ``torch.cuda.current_stream()`` (``param_and_grad_buffer``); the CPU shim
#: answers it with a stream that orders nothing.
GRAD_SYNC_USES_CUDA_STREAMS = _RELEASE >= Version("0.19")
#: 0.17+: the megatron-core wheel ships Megatron-LM's ``megatron.training``.
MEGATRON_TRAINING_IN_WHEEL = _RELEASE >= Version("0.17")
#: 0.18+: Megatron-LM's ``pretrain()`` takes a ``PretrainConfigContainer`` first and no longer accepts
#: ``args_defaults`` / ``extra_args_provider`` (``megatron_lm.main`` builds the container itself).
PRETRAIN_TAKES_CONFIG_CONTAINER = _RELEASE >= Version("0.18")
#: 0.19+: ``GPTModel.__init__`` logs "GPTModel IS DEPRECATED" (pointing at ``HybridModel``) on every build;
#: importing this module drops that line (``_not_gpt_model_deprecation``).
GPT_MODEL_LOGS_DEPRECATION = _RELEASE >= Version("0.19")

#: Megatron-Core's ``NullTokenizer``: library "null" in 0.16, whose ``vocab_size`` ids come with EOD as one more
#: id; "null-text" in 0.19, whose ``vocab_size`` includes EOD (= vocab_size - 1). 0.17/0.18 are not tested.
NULL_TOKENIZER_LIBRARY = "null-text" if _RELEASE >= Version("0.19") else "null"
NULL_TOKENIZER_VOCAB_INCLUDES_EOD = _RELEASE >= Version("0.19")


def check_megatron_core_version(version: Version = MEGATRON_CORE_VERSION) -> bool:
    """True inside ``TESTED_RANGE``; outside it warns (a ``UserWarning`` naming both) and returns False."""
    low, high = TESTED_RANGE
    if low <= Version(version.base_version) <= high:
        return True
    warnings.warn(f"megatron-core {version} is outside the range megatron-hsap is tested with ({low} to {high}); "
                  "its Megatron-Core integration (CPU shim, layer-spec rewrites, Megatron-LM entry point) may "
                  "fail or misbehave", UserWarning, stacklevel=2)
    return False


def _not_gpt_model_deprecation(record: logging.LogRecord) -> bool:
    """Drops Megatron-Core 0.19's "GPTModel IS DEPRECATED" line (logged for every model chunk of every run).

    The notice points at ``HybridModel``; this package builds ``GPTModel`` (and its subclass ``HSAPGPTModel``),
    which 0.19 keeps for bug fixes, and the HSAP layer specs are GPT layer specs, so the line would only repeat
    what docs/training.md ("Supported versions") says once: moving to ``HybridModel`` is future work."""
    return not str(record.msg).startswith("GPTModel IS DEPRECATED")


check_megatron_core_version()
if GPT_MODEL_LOGS_DEPRECATION:
    logging.getLogger("megatron.core.models.gpt.gpt_model").addFilter(_not_gpt_model_deprecation)
