"""Megatron-style distributed checkpoints: ``<dir>/iter_0000010/`` + ``latest_checkpointed_iteration.txt``.

Model and optimizer are saved as sharded state dicts, so a checkpoint reloads at
other TP/PP/DP/CP sizes (the distributed optimizer's ``dp_reshardable`` state: at
other DP x CP sizes only; see ``_content_metadata``).

Integrity (a crash at any moment never leaves a checkpoint that loads as if complete):
- a save writes into ``iter_N.partial/``; when every rank has written, the ranks
  checksum the files (each a share) and rank 0 writes ``hsap_manifest.json``
  (size and CRC-32 of every file), renames the directory to ``iter_N/`` and only
  then rewrites the tracker, atomically (temporary file, fsync, rename). Nothing
  older is deleted, except an ``iter_N/`` of the same iteration, and only after
  its replacement is complete;
- a load reads the tracker, takes the newest complete checkpoint not newer than it
  (warning about an ``iter_N.partial/`` left by an interrupted save, or a tracked
  directory that is incomplete), verifies every file against the manifest (a
  truncated or corrupted file is an error naming it) and agrees on the outcome
  with one all-gather before any collective read, so a bad checkpoint stops every
  rank with the same message instead of hanging some of them. Checkpoints
  written without a manifest (by another tool) load when dist_checkpointing marks
  them complete (``metadata.json``), unverified, with a note.
Content, as Megatron-LM's ``megatron/training/checkpointing.py`` writes it (torch_dist):
``args`` (the flag namespace), ``checkpoint_version`` (3.0), ``iteration``, ``model``,
``optimizer``, ``opt_param_scheduler`` and ``rng_state``, with the sharded-state-dict
content metadata saved alongside (``distrib_optim_sharding_type``: ``dp_reshardable``,
or ``fully_reshardable`` with ``--dist-ckpt-optim-fully-reshardable``). A load builds
its sharded state dict from the metadata stored in the checkpoint, not from the
current flags, so a checkpoint loads whichever way it was written.

As Megatron-LM, a ``--load`` directory that is missing, empty or without a tracker starts
from scratch with a rank-0 warning.

Trust (``checkpoint_trust``): every pickle in a checkpoint is read through an allow-list, on every
rank, before the load, and megatron-core's load runs with the same allow-lists, so a crafted file
stops the run naming it instead of running code. The iteration stored in the checkpoint must match
its directory's, and the manifest names files inside the checkpoint only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import re
import shutil
import time
import zlib
from functools import partial
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megatron_hsap.training import fault_injection
from megatron_hsap.training.checkpoint_trust import check_pickles, load_common, restricted_loading
from megatron_hsap.training.save_lock import LOCK_FILE

__all__ = ["save_checkpoint", "load_checkpoint", "load_args_from_checkpoint", "latest_iteration", "verify_files",
           "write_tracker", "CHECKPOINT_VERSION"]

#: Megatron-LM's ``checkpoint_version`` of its current checkpoints (the QKV ordering of megatron-core models).
CHECKPOINT_VERSION = 3.0

_TRACKER = "latest_checkpointed_iteration.txt"
_MANIFEST = "hsap_manifest.json"
_PARTIAL = ".partial"
_ITER_DIR = re.compile(r"iter_(\d{7})$")
_CHUNK = 1 << 24


def _iter_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _unwrap(chunk: Any) -> Any:
    """The GPTModel inside Megatron's DDP wrapper: checkpoint keys are the model's own (as Megatron-LM's)."""
    return getattr(chunk, "module", chunk)


def _content_metadata(args: argparse.Namespace) -> Dict[str, Any]:
    """The sharded-state-dict content metadata Megatron-LM saves with a torch_dist checkpoint (serialisable part).

    Without ``distrib_optim_sharding_type`` megatron-core's distributed optimizer falls back to a format
    its own ShardedTensor checks reject (``flattened_range is not supported``). ``dp_reshardable`` saves each
    rank's buffer shard as is (no gather; reloads at another DP x CP size only); ``fully_reshardable`` gathers
    each parameter's state on DP rank 0 (reloads at any TP/PP/DP/CP size).
    """
    metadata: Dict[str, Any] = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if args.use_distributed_optimizer:
        if args.dist_ckpt_optim_fully_reshardable:
            metadata["distrib_optim_sharding_type"] = "fully_reshardable"
            metadata["distrib_optim_fully_reshardable_mem_efficient"] = False
        else:
            metadata["distrib_optim_sharding_type"] = "dp_reshardable"
    return metadata


def _with_group(metadata: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """``metadata`` plus the DP x CP group megatron-core's sharded_state_dict methods read (never serialised)."""
    from megatron.core import parallel_state as mpu

    return dict(metadata or {}, dp_cp_group=mpu.get_data_parallel_group(with_context_parallel=True))


def _rng_state() -> Dict[str, Any]:
    """This rank's generators, under Megatron-LM's keys (``cuda_rng_state`` only where CUDA is in use)."""
    from megatron.core import tensor_parallel

    state = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(),
             "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
    return state


def _rng_sharded_object() -> Any:
    """Megatron-LM's ``rng_state`` object: one per (PP, TP) rank holding a list of RNG states.

    Megatron-LM's list has one entry, or one per DP rank with ``--data-parallel-random-init``; here it
    always has one per DP x CP rank (in that group's rank order): CP ranks hold different token counts,
    so their generators advance differently (dropout) and a resume is only exact with each rank's own.
    """
    from megatron.core import parallel_state as mpu
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    group = mpu.get_data_parallel_group(with_context_parallel=True)
    states: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(states, _rng_state(), group=group)
    return ShardedObject("rng_state", states,
                         (mpu.get_pipeline_model_parallel_world_size(), mpu.get_tensor_model_parallel_world_size()),
                         (mpu.get_pipeline_model_parallel_rank(), mpu.get_tensor_model_parallel_rank()),
                         replica_id=dist.get_rank(group))


def _restore_rng(states: List[Dict[str, Any]]) -> bool:
    """Set this rank's generators from the saved list (its own entry; the first when DP x CP changed, as
    Megatron-LM). False, nothing set, when the states come from the other device kind (CUDA vs CPU trackers)."""
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    group = mpu.get_data_parallel_group(with_context_parallel=True)
    state = states[dist.get_rank(group)] if len(states) == dist.get_world_size(group) else states[0]
    if ("cuda_rng_state" in state) != (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return False
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if "cuda_rng_state" in state:
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])
    return True


def _init_optimizer_state(optimizer: Any) -> None:
    """Give a fresh distributed optimizer its Adam state before its sharded state dict is built for a load.

    Without Apex/TE's fused Adam, megatron-core's ``DistributedOptimizer.state_dict`` reads the ``step`` of
    every parameter's Adam state, which a fresh optimizer has none of (torch's Adam creates it in the first
    step). Megatron-core fills it with one zero-gradient step for its own fsdp_dtensor load; the same here
    (the values are then replaced by the checkpoint's).
    """
    from megatron.core.optimizer import DistributedOptimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, DistributedOptimizer) and not opt.optimizer.state:
            opt._init_optimizer_states_with_dummy_values()


@contextlib.contextmanager
def _torch_adam_steps(optimizer: Any) -> Iterator[None]:
    """Load torch Adam's per-parameter ``step`` right through a distributed-optimizer load (no Apex/TE).

    megatron-core's ``DistributedOptimizer.load_state_dict`` sets the checkpoint's step (from the param
    groups) as one tensor shared by every parameter's state, then copies each parameter's loaded state
    over it with ``_set_main_param_and_optimizer_states``, whose per-parameter tensors have no ``step``
    (``fully_reshardable``: KeyError) or the placeholder's (``dp_reshardable``: a wrong count). Within this
    context that copy keeps the step already set; on exit each parameter gets its own copy of it (torch's
    Adam increments it in place, once per parameter). Only these optimizer objects are changed, and only
    for the load.
    """
    from megatron.core.optimizer import DistributedOptimizer

    dist_opts = [o for o in getattr(optimizer, "chained_optimizers", [optimizer])
                 if isinstance(o, DistributedOptimizer)]

    def keep_step(opt: Any, original: Callable[..., None], model_param: Any, tensors: Dict[str, Any]) -> None:
        group_index, group_order = opt.model_param_group_index_map[model_param]
        state = opt.optimizer.state[opt.optimizer.param_groups[group_index]["params"][group_order]]
        original(model_param, dict(tensors, step=state["step"]) if "step" in state else tensors)

    for opt in dist_opts:
        opt._set_main_param_and_optimizer_states = partial(keep_step, opt, opt._set_main_param_and_optimizer_states)
    try:
        yield
    finally:
        for opt in dist_opts:
            del opt._set_main_param_and_optimizer_states
            for state in opt.optimizer.state.values():
                if "step" in state:
                    state["step"] = state["step"].clone()


def _state_dict(args: argparse.Namespace, model: List[Any], optimizer: Any, scheduler: Any, iteration: int,
                metadata: Optional[Dict[str, Any]], rng: bool, is_loading: bool) -> Dict[str, Any]:
    """Megatron-LM's ``generate_state_dict`` for torch_dist (``optimizer``/``scheduler`` None: not included)."""
    state: Dict[str, Any] = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration}
    full_metadata = _with_group(metadata)
    if len(model) == 1:
        state["model"] = _unwrap(model[0]).sharded_state_dict(metadata=full_metadata)
    else:
        for i, chunk in enumerate(model):
            state[f"model{i}"] = _unwrap(chunk).sharded_state_dict(metadata=full_metadata)
    if optimizer is not None:
        if is_loading:
            _init_optimizer_state(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=full_metadata)
    if scheduler is not None:
        state["opt_param_scheduler"] = scheduler.state_dict()
    if rng:
        state["rng_state"] = _rng_sharded_object()
    return state


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomically(path: str, text: str) -> None:
    """Readers see the old content or the new one, never a mix or an empty file."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def write_tracker(root: str, iteration: int) -> None:
    """Point ``root``'s tracker file at ``iteration`` (atomic)."""
    _write_atomically(os.path.join(root, _TRACKER), str(iteration))


def _files(path: str) -> List[str]:
    """Every file under ``path`` (relative, sorted), the manifest excepted."""
    out = []
    for dirpath, _, names in os.walk(path):
        out.extend(os.path.relpath(os.path.join(dirpath, n), path) for n in names)
    return sorted(f for f in out if f != _MANIFEST)


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(_CHUNK)
            if not block:
                return crc
            crc = zlib.crc32(block, crc)


def _all_gather(value: Any) -> List[Any]:
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def save_checkpoint(root: str, iteration: int, model: List[Any], optimizer: Any, scheduler: Any,
                    args: argparse.Namespace) -> str:
    """Write iteration ``iteration``'s checkpoint under ``root`` (collective); returns its directory."""
    from megatron.core import dist_checkpointing

    final = _iter_dir(root, iteration)
    staging = final + _PARTIAL
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        if os.path.exists(staging):  # left by an interrupted save: never a good checkpoint
            shutil.rmtree(staging)
        os.makedirs(staging)
    dist.barrier()
    metadata = _content_metadata(args)
    fault_injection.inject("before-save", iteration)
    try:
        with _writer_error_log() as logged:
            dist_checkpointing.save(_state_dict(args, model, optimizer, scheduler, iteration, metadata, rng=True,
                                                is_loading=False), staging, content_metadata=metadata)
    except CheckpointException as err:  # a BaseException: its message lists ranks, not the cause
        raise RuntimeError(f"--save {root!r}: saving iteration {iteration} into {staging} failed: "
                           f"{_checkpoint_failure(err, logged)}") from None
    fault_injection.inject("save", iteration)
    dist.barrier()
    try:
        _complete_save(root, staging, final, iteration, rank, world)
    except OSError as err:
        raise RuntimeError(f"--save {root!r}: completing iteration {iteration}'s checkpoint failed: "
                           f"{_os_error(err)}") from None
    dist.barrier()
    return final


def _os_error(err: OSError) -> str:
    """``err`` as 'No space left on device: <path>' (its description and file), else its text."""
    if err.strerror and err.filename:
        return f"{err.strerror}: {err.filename}"
    return f"{type(err).__name__}: {err}"


@contextlib.contextmanager
def _writer_error_log() -> Iterator[List[str]]:
    """The error lines megatron-core's checkpoint writer logs in this process meanwhile: from 0.19 it passes
    on only the class of a write error (an assertion on its type) and logs the error itself."""
    logged: List[str] = []

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            logged.append(record.getMessage())

    logger = logging.getLogger("megatron.core.dist_checkpointing.strategies.filesystem_async")
    handler = _Collect(logging.ERROR)
    logger.addHandler(handler)
    try:
        yield logged
    finally:
        logger.removeHandler(handler)


def _checkpoint_failure(err: BaseException, logged: Sequence[str] = ()) -> str:
    """The causes inside torch's ``CheckpointException`` (rank -> (exception, traceback)), one per rank; an
    OS error as its description and file, also when megatron-core's writer passed it on as text or only
    logged it (``logged``: this rank's writer error lines)."""
    causes = []
    for rank, (exc, _) in sorted(getattr(err, "failures", {}).items()):
        while not isinstance(exc, OSError) and (exc.__cause__ or exc.__context__) is not None:
            exc = exc.__cause__ or exc.__context__
        texts = [str(exc)] + (list(logged) if rank == dist.get_rank() else [])
        os_error = next(filter(None, (re.search(r"\[Errno \d+\] ([^:]+): '([^']+)'", t) for t in texts)), None)
        cause = (_os_error(exc) if isinstance(exc, OSError) else f"{os_error.group(1)}: {os_error.group(2)}"
                 if os_error else f"{type(exc).__name__}: {exc}")
        causes.append(f"rank {rank}: {cause}")
    return "; ".join(causes) or "on another rank (its error names the cause)"


def _complete_save(root: str, staging: str, final: str, iteration: int, rank: int, world: int) -> None:
    """The manifest (every rank checksums its share, rank 0 writes it), the rename to ``final`` and the tracker."""
    names = _files(staging)
    mine = {name: [os.path.getsize(os.path.join(staging, name)), _crc32(os.path.join(staging, name))]
            for name in names[rank::world]}
    manifest: Dict[str, List[int]] = {}
    for part in _all_gather(mine):
        manifest.update(part)
    if rank == 0:
        _write_atomically(os.path.join(staging, _MANIFEST), json.dumps({"iteration": iteration, "files": manifest},
                                                                        indent=0, sort_keys=True))
        replaced = final + ".replaced"
        if os.path.exists(final):
            if os.path.exists(replaced):
                shutil.rmtree(replaced)
            os.rename(final, replaced)
        os.rename(staging, final)
        _fsync_dir(root)
        write_tracker(root, iteration)
        if os.path.exists(replaced):
            shutil.rmtree(replaced)


def latest_iteration(root: str) -> Optional[int]:
    """The iteration recorded in ``root``'s tracker file, None if there is none; ValueError if it is unreadable."""
    tracker = os.path.join(root, _TRACKER)
    if not os.path.exists(tracker):
        return None
    try:
        with open(tracker) as f:
            return int(f.read().strip())
    except (OSError, ValueError) as err:
        raise ValueError(f"--load {root!r}: cannot read {tracker} ({err})") from err


def _is_complete(path: str) -> bool:
    from megatron.core import dist_checkpointing

    return os.path.isfile(os.path.join(path, _MANIFEST)) or dist_checkpointing.check_is_distributed_checkpoint(path)


def _choose(root: str) -> Tuple[Optional[int], List[str]]:
    """The iteration to load (None: start from scratch) and warnings for rank 0 to print; ValueError if none can be."""
    if not os.path.isdir(root):
        return None, [f"WARNING: --load {root!r} does not exist; starting from scratch"]
    entries = sorted(e for e in os.listdir(root) if e != LOCK_FILE)  # the lock of a job saving here
    if not entries:
        return None, [f"WARNING: --load {root!r} is empty (no checkpoint saved yet); starting from scratch"]
    tracked = latest_iteration(root)
    warnings = [f"WARNING: ignoring {os.path.join(root, e)}: a save interrupted before it completed"
                for e in entries if e.endswith(_PARTIAL)]
    if tracked is None:
        return None, warnings + [f"WARNING: --load {root!r} has no {_TRACKER}; starting from scratch"]
    found = sorted((int(m.group(1)) for m in map(_ITER_DIR.match, entries) if m), reverse=True)
    for iteration in (i for i in found if i <= tracked):
        if _is_complete(_iter_dir(root, iteration)):
            if iteration != tracked:
                warnings.append(f"WARNING: {_iter_dir(root, tracked)} (named by {_TRACKER}) is missing or "
                                f"incomplete; loading the previous complete checkpoint, iteration {iteration}")
            return iteration, warnings
    raise ValueError(f"--load {root!r}: {_TRACKER} names iteration {tracked}, but {_iter_dir(root, tracked)} is "
                     "missing or incomplete and no earlier complete checkpoint exists")


def verify_files(path: str, rank: int = 0, world_size: int = 1) -> List[str]:
    """Problems with ``path``'s files against its manifest (this rank's share of them); [] when fine or no manifest."""
    manifest_path = os.path.join(path, _MANIFEST)
    if not os.path.isfile(manifest_path):
        return []
    try:
        with open(manifest_path) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError) as err:
        return [f"{manifest_path} is unreadable ({type(err).__name__}: {err})"]
    problems = []
    for name in sorted(files)[rank::world_size]:
        size, crc = files[name]
        full = os.path.join(path, name)
        if os.path.isabs(name) or os.path.normpath(name).split(os.sep)[0] == os.pardir:
            problems.append(f"{manifest_path} names {name!r}, outside the checkpoint directory: refusing to read it")
        elif not os.path.isfile(full):
            problems.append(f"{full} is missing")
        elif os.path.getsize(full) != size:
            problems.append(f"{full} is truncated or damaged: {os.path.getsize(full)} bytes, {size} written")
        elif _crc32(full) != crc:
            problems.append(f"{full} is corrupted: its CRC-32 differs from the one written")
    return problems


#: Megatron-LM's ``check_checkpoint_args``: flags whose checkpoint values must equal the run's (and the MLP and
#: grouped-query shapes, which otherwise fail deep inside the load).
_MODEL_ARGS_CHECKED = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "num_query_groups",
                       "swiglu")


def _model_arg(args: argparse.Namespace, name: str) -> Any:
    """Flag ``name``'s effective value (``--ffn-hidden-size`` default: 4 x hidden size, as the model builds it)."""
    if name == "ffn_hidden_size":
        return args.ffn_hidden_size or 4 * args.hidden_size
    return getattr(args, name)
#: The model flags ``--use-checkpoint-args`` takes from the checkpoint (Megatron-LM's ``load_args_from_checkpoint``);
#: the first group only where the command line left them at their defaults, the second always.
_ARGS_UNLESS_GIVEN = ("num_layers", "hidden_size", "ffn_hidden_size", "seq_length", "num_attention_heads",
                      "max_position_embeddings", "make_vocab_size_divisible_by")
_ARGS_ALWAYS = ("num_query_groups", "position_embedding_type", "rotary_base", "disable_bias_linear", "swiglu",
                "untie_embeddings_and_output_weights", "normalization", "attention_dropout", "hidden_dropout")


def _read_common(path: str) -> Dict[str, Any]:
    """The checkpoint's non-sharded objects (``args``, ``iteration``, content metadata, ...); a file read only."""
    return load_common(path)


def load_args_from_checkpoint(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """``--use-checkpoint-args``: take the model flags from the checkpoint ``--load`` names, before validation.

    Flags of ``_ARGS_UNLESS_GIVEN`` still at ``parser``'s default, and all of ``_ARGS_ALWAYS``, get the
    checkpoint's values (as Megatron-LM, whose defaults for the first group are None). ValueError when
    there is no checkpoint to take them from.
    """
    if args.load is None:
        raise ValueError("--use-checkpoint-args needs --load")
    iteration, _ = _choose(args.load)
    if iteration is None:
        raise ValueError(f"--use-checkpoint-args: --load {args.load!r} holds no checkpoint")
    saved = _read_common(_iter_dir(args.load, iteration)).get("args")
    if saved is None:
        raise ValueError(f"--use-checkpoint-args: {_iter_dir(args.load, iteration)} was saved without its args")
    for name in _ARGS_UNLESS_GIVEN + _ARGS_ALWAYS:
        given = name in _ARGS_UNLESS_GIVEN and getattr(args, name) != parser.get_default(name)
        if hasattr(saved, name) and not given:
            setattr(args, name, getattr(saved, name))


def _problems(root: str, iteration: int, args: argparse.Namespace) -> Tuple[List[str], Dict[str, Any]]:
    """What is wrong with loading ``iteration``'s (verified) files under ``args``, and the checkpoint's common
    state (empty when unreadable)."""
    path = _iter_dir(root, iteration)
    unsafe = check_pickles(path)  # before anything else is read from the checkpoint
    if unsafe:
        return [f"--load {root!r}: {p}" for p in unsafe], {}
    try:
        common = _read_common(path)
    except Exception as err:  # noqa: BLE001 - any read failure becomes one clear message
        return [f"--load {root!r}: cannot read {path} ({type(err).__name__}: {err})"], {}
    problems: List[str] = []
    if common.get("iteration") is not None and int(common["iteration"]) != iteration:
        problems.append(f"--load {root!r}: {path} holds iteration {common['iteration']}, not {iteration} (its "
                        "directory was renamed or swapped with another): refusing to resume at the wrong iteration")
    saved = common.get("args")
    for name in _MODEL_ARGS_CHECKED if saved is not None else ():
        if hasattr(saved, name) and _model_arg(saved, name) != _model_arg(args, name):
            problems.append(f"--load {root!r}: --{name.replace('_', '-')} is {_model_arg(args, name)} but {path} was "
                            f"written with {_model_arg(saved, name)} (--use-checkpoint-args takes the checkpoint's)")
    metadata = common.get("content_metadata") or {}
    sharding = metadata.get("distrib_optim_sharding_type")
    saved_tp_pp = (getattr(saved, "tensor_model_parallel_size", 1), getattr(saved, "pipeline_model_parallel_size", 1))
    tp_pp = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    load_optim = not (args.no_load_optim or args.finetune)
    if load_optim and (sharding is not None) != args.use_distributed_optimizer:
        problems.append(f"--load {root!r}: its optimizer state was saved "
                        f"{'with' if sharding else 'without'} --use-distributed-optimizer and loads only so "
                        "(megatron-core converts neither way); pass --no-load-optim to load the model alone")
    elif load_optim and sharding == "dp_reshardable" and saved_tp_pp != tp_pp:
        problems.append(f"--load {root!r}: its distributed-optimizer state ('dp_reshardable') was saved at "
                        f"TP x PP = {saved_tp_pp[0]} x {saved_tp_pp[1]} and reloads only at that size, not "
                        f"{tp_pp[0]} x {tp_pp[1]} (save with --dist-ckpt-optim-fully-reshardable, or pass "
                        "--no-load-optim)")
    return problems, common


def _read_and_apply(root: str, path: str, iteration: int, model: List[Any], optimizer: Any, scheduler: Any,
                    metadata: Dict[str, Any], args: argparse.Namespace, rng: bool) -> Dict[str, Any]:
    """Read ``path`` into the objects given (``optimizer``/``scheduler`` None: not loaded); returns the state."""
    from megatron.core import dist_checkpointing

    try:
        with restricted_loading():
            state = dist_checkpointing.load(_state_dict(args, model, optimizer, scheduler, iteration, metadata,
                                                        rng=rng, is_loading=True), path)
    except CheckpointException as err:  # a BaseException: its message lists ranks, not the cause
        raise RuntimeError(f"--load {root!r}: failed to read iteration {iteration}: "
                           f"{_checkpoint_failure(err)}") from None
    except Exception as err:  # noqa: BLE001 - any read failure becomes one clear message
        raise RuntimeError(f"--load {root!r}: failed to read iteration {iteration}: "
                           f"{type(err).__name__}: {err}") from err
    if len(model) == 1:
        _unwrap(model[0]).load_state_dict(state["model"])
    else:
        for i, chunk in enumerate(model):
            _unwrap(chunk).load_state_dict(state[f"model{i}"])
    if optimizer is not None:
        with _torch_adam_steps(optimizer):
            optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None:
        schedule_note = _schedule_change_note(scheduler, state["opt_param_scheduler"])
        scheduler.load_state_dict(state["opt_param_scheduler"])
        if schedule_note:
            state["schedule_note"] = schedule_note
    return state


#: The scheduler fields a resumed run may be asked to change (Megatron's OptimizerParamScheduler state names).
_SCHEDULE_FIELDS = ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style")


def _schedule_change_note(scheduler: Any, saved: Dict[str, Any]) -> str:
    """What happens to the learning rate when the flags ask for a schedule other than the checkpoint's ('' when
    they do not): a longer run on the checkpoint's schedule otherwise sits at min-lr without a word."""
    asked = {name: getattr(scheduler, name) for name in _SCHEDULE_FIELDS}
    differ = [name for name in _SCHEDULE_FIELDS if name in saved and saved[name] != asked[name]]
    if not differ:
        return ""
    change = ", ".join(f"{name} {saved[name]} (the flags: {asked[name]})" for name in differ)
    if scheduler.override_opt_param_scheduler:
        return (f"note: --override-opt_param-scheduler: the flags' learning-rate schedule replaces the "
                f"checkpoint's {change}")
    after = ""
    if saved.get("lr_decay_steps") is not None and asked["lr_decay_steps"] > saved["lr_decay_steps"]:
        after = (f"; the learning rate reaches min-lr {saved.get('min_lr')} at sample {saved['lr_decay_steps']} and "
                 f"stays there")
    return (f"note: the checkpoint's learning-rate schedule continues (as Megatron-LM by default): {change}{after}; "
            "--override-opt_param-scheduler uses the flags' schedule instead")


def _raise_on_every_rank(problems: List[str]) -> None:
    """RuntimeError on every rank when any rank has a problem (one all-gather; no rank is left waiting)."""
    everyone = list(dict.fromkeys(p for part in _all_gather(problems) for p in part))
    if everyone:
        raise RuntimeError("; ".join(everyone))


def load_checkpoint(root: str, model: List[Any], optimizer: Any, scheduler: Any, args: argparse.Namespace,
                    log: Callable[[str], None] = print) -> int:
    """Load the newest complete checkpoint under ``root`` into model/optimizer/scheduler and the RNGs, as
    Megatron-LM's ``load_checkpoint`` (``--no-load-optim``, ``--no-load-rng``, ``--finetune``); returns the
    iteration to continue from (0 when starting from scratch or fine-tuning). ``log`` gets rank 0's messages.

    Raises RuntimeError on every rank (never a hang) when the checkpoint cannot be read.
    """
    from megatron.core import dist_checkpointing

    t0 = time.perf_counter()
    try:
        iteration, warnings = _choose(root)
        problems = [] if iteration is None else [
            f"--load {root!r}: {p}" for p in verify_files(_iter_dir(root, iteration), dist.get_rank(),
                                                         dist.get_world_size())]
    except ValueError as err:
        iteration, warnings, problems = None, [], [str(err)]
    _raise_on_every_rank(problems)  # first the files (each rank a share), then what they hold
    if iteration is not None:
        problems, common = _problems(root, iteration, args)
        _raise_on_every_rank(problems)
    rank0 = dist.get_rank() == 0
    notes = list(warnings)
    if iteration is None:
        for note in notes if rank0 else ():
            log(note)
        return 0
    path = _iter_dir(root, iteration)
    if not os.path.isfile(os.path.join(path, _MANIFEST)):
        notes.append(f"note: {path} has no {_MANIFEST}: unverified (written by another tool, or the manifest was "
                     "removed): its files' sizes and CRC-32s are not checked (its pickles still go through the "
                     "allow-list, docs/training.md 'Trust model')")
    saved = common.get("args")
    metadata = dist_checkpointing.load_content_metadata(preloaded_state_dict=common) or {}
    load_optim = not (args.no_load_optim or args.finetune)
    same_tp_pp = (getattr(saved, "tensor_model_parallel_size", 1), getattr(saved, "pipeline_model_parallel_size", 1)
                  ) == (args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    load_rng = not (args.no_load_rng or args.finetune) and saved is not None and same_tp_pp
    if saved is None:
        notes.append(f"note: {path} has no args/rng_state (an older checkpoint); the RNG state is not restored")
    elif not same_tp_pp and not (args.no_load_rng or args.finetune):
        notes.append("note: TP x PP differs from the checkpoint's; its RNG state is ignored (as Megatron-LM)")
    # No autograd: the distributed optimizer's fp32 main parameters are views of the model's (leaf) ones.
    with torch.no_grad():
        state = _read_and_apply(root, path, iteration, model, optimizer if load_optim else None,
                                None if args.finetune else scheduler, metadata, args, load_rng)
        if not load_optim:  # the optimizer's main (fp32) copies would otherwise keep the initial weights
            optimizer.reload_model_params()
    if state.get("schedule_note"):
        notes.append(state["schedule_note"])
    if load_rng and not _restore_rng(state["rng_state"]):
        notes.append("note: the checkpoint's RNG state is from another device kind (CPU vs CUDA); not restored")
    if rank0:
        for note in notes:
            log(note)
        done = (f"loaded model weights from {root} iteration {iteration} (--finetune: starting at iteration 0)"
                if args.finetune else f"loaded checkpoint from {root} at iteration {iteration}")
        log(f"{done} in {time.perf_counter() - t0:.2f} s (checkpoint version {state.get('checkpoint_version', 0)})")
    return 0 if args.finetune else int(state["iteration"])
