"""HSAP context parallelism inside Megatron-LM's own ``pretrain()``.

    torchrun --nproc-per-node 8 -m megatron_hsap.training.megatron_lm \
        <Megatron-LM's pretrain_gpt.py flags> --context-parallel-size 8 --context-parallel-mode hsap

runs Megatron-LM's ``megatron.training.pretrain`` with this module's providers and forward step, in the
calling form of the installed release (docs/training.md, "Megatron-LM entry point"): megatron-core 0.18+
ships ``megatron.training`` in its wheel and takes a config container; with 0.16 put Megatron-LM's source
(tag ``core_v0.16.1``) on PYTHONPATH. Without CUDA it runs on gloo ranks through
``cpu_shim.apply_megatron_lm_cpu_shim``. The pieces, usable one by one from your own script:

- ``add_hsap_args(parser)``: the HSAP flags (``--context-parallel-mode``, ``--ulysses-size``,
  ``--head-chunk-size``, ``--cp-layout``, ``--attention-kernel``, ``--ranks-per-node``,
  ``--mlp-sequence-chunks``, ``--loss-sequence-chunks``), none of which Megatron-LM defines;
  the definitions are this package's own (``training.arguments``), copied onto the parser.
- ``model_provider``: a GPTModel with the HSAP layer spec; resolves the defaults Megatron-LM's flags leave
  (``_resolve_hsap_defaults``) and attaches the HSAP topology (Ulysses and ring sub-groups) to the groups
  Megatron-LM initialised.
- ``train_valid_test_datasets_provider``: Megatron-Core GPT datasets built on every rank, since every
  pipeline stage needs the micro-batch's plan (Megatron-LM's own provider builds them only on the first
  and last stage and slices sequences per CP rank, which a packed plan does itself).
- ``get_batch`` / ``forward_step``: the unsliced packed micro-batch -> plan (from its document
  boundaries) -> this CP rank's tokens, on the model's device; the loss as Megatron-LM's ``(sum, count)``.

Only ``main()`` needs Megatron-LM (``megatron.training``); everything else runs on Megatron-Core alone.
"""

from __future__ import annotations

import argparse
import dataclasses
from functools import partial
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from megatron_hsap.training.arguments import build_parser, cp_config_from_args, resolve_sequence_chunks
from megatron_hsap.training.loop import forward_packed
from megatron_hsap.training.packing import PackedMicroBatch, pack_micro_batch

__all__ = ["HSAP_FLAGS", "ARGS_DEFAULTS", "add_hsap_args", "model_provider", "train_valid_test_datasets_provider", "get_batch",
           "forward_step", "main"]

#: Flags ``add_hsap_args`` adds (Megatron-LM has none of them; its ``--context-parallel-size`` sets the CP size).
HSAP_FLAGS = ("--context-parallel-mode", "--ulysses-size", "--head-chunk-size", "--cp-layout", "--attention-kernel",
              "--ranks-per-node", "--mlp-sequence-chunks", "--loss-sequence-chunks",
              "--offload-checkpointed-activations", "--cp-kv-forwarding")


def add_hsap_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM ``extra_args_provider``: add the HSAP flags (same names, defaults and checks as
    ``pretrain_gpt_hsap.py``'s) in their own group; returns ``parser``."""
    ours = {opt: action for action in build_parser()._actions for opt in action.option_strings}
    group = parser.add_argument_group("HSAP context parallelism (megatron-hsap)")
    for flag in HSAP_FLAGS:
        action = ours[flag]
        if isinstance(action, argparse._StoreTrueAction):
            group.add_argument(flag, dest=action.dest, action="store_true", help=action.help)
        else:
            group.add_argument(flag, dest=action.dest, type=action.type, choices=action.choices,
                               default=action.default, help=action.help)
    return parser


def _megatron_lm_args() -> argparse.Namespace:
    from megatron.training import get_args

    return get_args()


def _check_args(args: argparse.Namespace) -> None:
    """Settings of Megatron-LM this path does not implement (ValueError naming the flag, before any collective)."""
    if args.calculate_per_token_loss:
        raise ValueError("--calculate-per-token-loss is not supported with HSAP: the loss is the micro-batch mean "
                         "over the whole (unsliced) packed micro-batch, summed across CP ranks")


def _resolve_hsap_defaults(args: argparse.Namespace) -> None:
    """The defaults ``add_hsap_args`` leaves open, as ``pretrain_gpt_hsap.py`` resolves them: ``--context-parallel-
    mode hsap``, ``--attention-kernel auto``; Megatron-LM's default ``--transformer-impl transformer_engine`` becomes
    ``local`` (with a note) where TE cannot run. Megatron-LM's ``--attention-dropout`` (default 0.1) has no HSAP
    implementation: it is set to 0 with a note on rank 0 naming the flag."""
    args.context_parallel_mode = args.context_parallel_mode or "hsap"
    args.attention_kernel = args.attention_kernel or "auto"
    # Megatron-LM's default RoPE fusion needs TE and is never used by HSAP (see training.model.fusion_settings);
    # off before Megatron-LM builds (and validates) the TransformerConfig from these flags
    args.apply_rope_fusion = False
    from megatron_hsap.megatron.spec import transformer_engine_usable

    if args.transformer_impl == "transformer_engine" and not transformer_engine_usable():
        _note_rank_0("megatron-hsap: --transformer-impl transformer_engine (Megatron-LM's default) needs "
                     "transformer_engine and a CUDA device; using --transformer-impl local")
        args.transformer_impl = "local"
    if args.attention_dropout:
        _note_rank_0(f"megatron-hsap: --attention-dropout {args.attention_dropout:g} set to 0: HSAP attention has no "
                     "dropout (Megatron-LM's default is 0.1; pass --attention-dropout 0 to silence this note)")
        args.attention_dropout = 0.0


def _note_rank_0(line: str) -> None:
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(line, flush=True)


def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage: Optional[int] = None,
                   config: Any = None, pg_collection: Any = None, args: Optional[argparse.Namespace] = None) -> Any:
    """Megatron-LM model provider: a GPTModel (one pipeline chunk) whose self-attention is HSAP's.

    ``args``: Megatron-LM's (default ``megatron.training.get_args()``) with ``add_hsap_args``' flags;
    ``config``: its TransformerConfig (default Megatron-LM's ``core_transformer_config_from_args``).
    The model's config keeps ``context_parallel_size=1`` (HSAP does CP inside attention; Megatron's own CP
    paths, e.g. rotary slicing, must stay off), attention dropout 0 and only the fusions whose kernels exist
    here (``training.model.fusion_settings``; RoPE fusion always off).
    ``pg_collection`` is accepted for Megatron-LM's signature; the model uses Megatron-Core's global groups.
    """
    from megatron_hsap.parallel_state import attach_cp_topology, cp_topology_is_initialized
    from megatron_hsap.training.model import build_gpt_chunk

    from megatron_hsap.training.model import fusion_settings

    del pg_collection
    args = _megatron_lm_args() if args is None else args
    _check_args(args)
    _resolve_hsap_defaults(args)
    if config is None:
        from megatron.training.arguments import core_transformer_config_from_args

        config = core_transformer_config_from_args(args)
    # fusions only where their kernels exist (none on CPU; on a GPU those training.model allows)
    fusions = fusion_settings(torch.cuda.is_available(),
                              gelu_without_bias=not config.gated_linear_unit and not config.add_bias_linear)
    config = dataclasses.replace(config, context_parallel_size=1, attention_dropout=0.0,
                                 **{k: v and getattr(config, k) for k, v in fusions.items()})
    cp_config = cp_config_from_args(args)
    if not cp_topology_is_initialized():
        attach_cp_topology(cp_config, args.ranks_per_node)
    resolve_sequence_chunks(args)
    return build_gpt_chunk(args, config, cp_config, args.padded_vocab_size, pre_process, post_process, vp_stage)


def train_valid_test_datasets_provider(train_val_test_num_samples: Sequence[int], vp_stage: Optional[int] = None,
                                       args: Optional[argparse.Namespace] = None, tokenizer: Any = None
                                       ) -> Tuple[Any, Any, Any]:
    """Megatron-LM datasets provider: GPT datasets (``GPTDataset``, ``MockGPTDataset`` with ``--mock-data``)
    from Megatron-LM's data flags, built on every rank (``is_distributed``)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset

    from megatron_hsap.training.data import dataset_config

    del vp_stage
    args = _megatron_lm_args() if args is None else args
    if tokenizer is None:
        from megatron.training import get_tokenizer

        tokenizer = get_tokenizer()
    config = dataset_config(args, tokenizer, args.data_path or args.train_data_path)
    cls = MockGPTDataset if args.mock_data else GPTDataset
    return tuple(BlendedMegatronDatasetBuilder(cls, list(train_val_test_num_samples), lambda: True, config).build())


train_valid_test_datasets_provider.is_distributed = True  # Megatron-LM: call the provider on every rank


def _unwrap(model: Any) -> Any:
    while hasattr(model, "module"):
        model = model.module
    return model


def get_batch(data_iterator: Optional[Iterator[Any]], model: Any, eod: Optional[int] = None,
              split_at_eod: Optional[bool] = None) -> PackedMicroBatch:
    """Next micro-batch for this rank, on every pipeline stage: ``tokens``/``labels``/``loss_mask`` ``[b, s]``
    (the unsliced batch, identical on the ranks of one DP rank) -> plan from its document boundaries
    (every sample, and every EOD with ``split_at_eod``) -> this CP rank's share, on the model's device.

    ``eod`` / ``split_at_eod`` default to Megatron-LM's tokenizer EOD and ``--reset-attention-mask``.
    """
    from megatron_hsap.parallel_state import get_cp_topology, get_cp_config

    if data_iterator is None:
        raise ValueError("data_iterator is None on this rank: HSAP needs the micro-batch on every pipeline stage; "
                         "use megatron_hsap.training.megatron_lm.train_valid_test_datasets_provider "
                         "(is_distributed=True)")
    if eod is None or split_at_eod is None:
        from megatron.training import get_tokenizer

        eod = get_tokenizer().eod if eod is None else eod
        split_at_eod = _megatron_lm_args().reset_attention_mask if split_at_eod is None else split_at_eod
    batch = next(data_iterator)
    device = next(_unwrap(model).parameters()).device
    return pack_micro_batch(batch, eod, split_at_eod, get_cp_topology(),
                            get_cp_config().resolved_layout).to(device)


def forward_step(data_iterator: Optional[Iterator[Any]], model: Any, return_schedule_plan: bool = False,
                 eod: Optional[int] = None, split_at_eod: Optional[bool] = None,
                 offload_activations: Optional[bool] = None) -> Tuple[torch.Tensor, Any]:
    """Megatron-LM forward step: ``(per-token losses [1, t_local], loss_func)`` for one micro-batch.

    ``loss_func`` returns Megatron-LM's three values, as its ``pretrain_gpt.py``: the loss to backpropagate
    (this CP rank's loss sum x CP size; Megatron-Core's schedule divides it by the third value's token count,
    which is the whole micro-batch's, so gradients are those of the micro-batch mean over all CP ranks' tokens,
    after DDP's average over data-parallel x CP ranks), the micro-batch's loss-token count, and
    ``{"lm loss": [this rank's loss sum, its token count]}`` which Megatron-LM sums over data-parallel x CP
    ranks for the logged (global, token-weighted) mean. ``eod`` / ``split_at_eod``: see ``get_batch``;
    ``offload_activations`` defaults to Megatron-LM's ``--offload-checkpointed-activations``."""
    from megatron.core import parallel_state as mpu

    if return_schedule_plan:
        raise ValueError("return_schedule_plan=True (Megatron-LM's combined 1F1B overlap) is not supported with "
                         "HSAP attention")
    mb = get_batch(data_iterator, model, eod, split_at_eod)
    if offload_activations is None:
        offload_activations = bool(getattr(_megatron_lm_args(), "offload_checkpointed_activations", False))
    output, _ = forward_packed(mb, model, mpu.get_context_parallel_group(), offload_activations=offload_activations)
    return output, partial(_sum_and_count_loss, mb, mpu.get_context_parallel_world_size())


def _sum_and_count_loss(mb: PackedMicroBatch, cp_size: int, output_tensor: torch.Tensor
                        ) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, torch.Tensor]]:
    """Per-token losses ``[1, t_local]`` of this CP rank -> Megatron-LM's (loss, token count, reported)."""
    mask = mb.loss_mask.view(-1).float()
    local_sum = torch.sum(output_tensor.float().view(-1) * mask)
    tokens = torch.tensor(max(mb.num_loss_tokens, 1), dtype=torch.int, device=local_sum.device)
    reported = torch.stack([local_sum.detach(), mask.sum()])
    return local_sum * cp_size, tokens, {"lm loss": reported}


#: Megatron-LM flag defaults this entry point changes (as ``pretrain_gpt.py`` passes ``args_defaults``).
ARGS_DEFAULTS = {"tokenizer_type": "GPT2BPETokenizer"}


def main(argv: Optional[List[str]] = None) -> None:
    """Megatron-LM's ``pretrain()`` with the HSAP model, datasets and forward step, in the calling form of the
    installed release (``versions.PRETRAIN_TAKES_CONFIG_CONTAINER``: 0.18+ takes a config container built from
    the parsed flags; earlier ones parse the flags themselves). ``megatron.training`` ships in the megatron-core
    wheel from 0.17; for 0.16 put Megatron-LM's source on PYTHONPATH. On a machine without CUDA the CPU shim's
    ``apply_megatron_lm_cpu_shim`` runs it on gloo ranks (``--distributed-backend gloo`` is added when absent)."""
    import sys

    from megatron_hsap.megatron import versions
    from megatron_hsap.megatron.cpu_shim import apply_megatron_lm_cpu_shim

    try:
        from megatron.core.enums import ModelType
        from megatron.training import pretrain
    except ImportError as err:
        raise SystemExit(f"megatron_hsap.training.megatron_lm needs Megatron-LM's megatron.training ({err}); put a "
                         "Megatron-LM checkout on PYTHONPATH (megatron-core 0.17+ ships it in its wheel)") from err
    argv = list(sys.argv[1:] if argv is None else argv)
    if apply_megatron_lm_cpu_shim() and "--distributed-backend" not in argv:
        argv += ["--distributed-backend", "gloo"]
    sys.argv = [sys.argv[0]] + argv
    if versions.PRETRAIN_TAKES_CONFIG_CONTAINER:
        from megatron.training.argument_utils import pretrain_cfg_container_from_args
        from megatron.training.arguments import parse_and_validate_args

        args = parse_and_validate_args(extra_args_provider=add_hsap_args, args_defaults=ARGS_DEFAULTS)
        pretrain(pretrain_cfg_container_from_args(args), train_valid_test_datasets_provider,
                 ModelType.encoder_or_decoder, forward_step, model_provider=model_provider)
    else:
        pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step,
                 args_defaults=ARGS_DEFAULTS, extra_args_provider=add_hsap_args)


if __name__ == "__main__":
    main()
