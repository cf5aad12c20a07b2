"""Megatron-style distributed checkpoints: ``<dir>/iter_0000010/`` + ``latest_checkpointed_iteration.txt``.

Model and optimizer are saved as sharded state dicts, so a checkpoint reloads at
other TP/PP/DP/CP sizes (the distributed optimizer uses its fully-resharding
format).

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
As Megatron-LM, a ``--load`` directory without a tracker (or missing) starts from scratch with a warning.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch.distributed as dist

from megatron_hsap.training import fault_injection

__all__ = ["save_checkpoint", "load_checkpoint", "latest_iteration", "verify_files", "write_tracker"]

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


def _state_dict(model: List[Any], optimizer: Any, scheduler: Any, iteration: int, is_loading: bool) -> Dict[str, Any]:
    state: Dict[str, Any] = {"iteration": iteration, "opt_param_scheduler": scheduler.state_dict()}
    if len(model) == 1:
        state["model"] = _unwrap(model[0]).sharded_state_dict()
    else:
        for i, chunk in enumerate(model):
            state[f"model{i}"] = _unwrap(chunk).sharded_state_dict()
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading)
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


def save_checkpoint(root: str, iteration: int, model: List[Any], optimizer: Any, scheduler: Any) -> str:
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
    dist_checkpointing.save(_state_dict(model, optimizer, scheduler, iteration, is_loading=False), staging)
    fault_injection.inject("save", iteration)
    dist.barrier()
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
    dist.barrier()
    return final


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
    tracked = latest_iteration(root)
    entries = sorted(os.listdir(root))
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
        if not os.path.isfile(full):
            problems.append(f"{full} is missing")
        elif os.path.getsize(full) != size:
            problems.append(f"{full} is truncated or damaged: {os.path.getsize(full)} bytes, {size} written")
        elif _crc32(full) != crc:
            problems.append(f"{full} is corrupted: its CRC-32 differs from the one written")
    return problems


def load_checkpoint(root: str, model: List[Any], optimizer: Any, scheduler: Any, load_optimizer: bool = True,
                    log: Callable[[str], None] = print) -> int:
    """Load the newest complete checkpoint under ``root`` into model/optimizer/scheduler; returns its iteration
    (0 when starting from scratch). ``log`` gets rank 0's warnings.

    Raises RuntimeError on every rank (never a hang) when the checkpoint cannot be read.
    """
    from megatron.core import dist_checkpointing

    problems: List[str] = []
    try:
        iteration, warnings = _choose(root)
    except ValueError as err:
        problems, iteration, warnings = [str(err)], None, []
    if iteration is not None:
        problems += [f"--load {root!r}: {p}"
                     for p in verify_files(_iter_dir(root, iteration), dist.get_rank(), dist.get_world_size())]
    everyone = list(dict.fromkeys(p for part in _all_gather(problems) for p in part))
    if everyone:
        raise RuntimeError("; ".join(everyone))
    if dist.get_rank() == 0:
        for warning in warnings:
            log(warning)
    if iteration is None:
        return 0
    path = _iter_dir(root, iteration)
    if not os.path.isfile(os.path.join(path, _MANIFEST)) and dist.get_rank() == 0:
        log(f"note: {path} has no {_MANIFEST} (written by another tool); its files are not verified")
    opt = optimizer if load_optimizer else None
    try:
        state = dist_checkpointing.load(_state_dict(model, opt, scheduler, iteration, is_loading=True), path)
    except Exception as err:  # noqa: BLE001 - any read failure becomes one clear message
        raise RuntimeError(f"--load {root!r}: failed to read iteration {iteration}: "
                           f"{type(err).__name__}: {err}") from err
    if len(model) == 1:
        _unwrap(model[0]).load_state_dict(state["model"])
    else:
        for i, chunk in enumerate(model):
            _unwrap(chunk).load_state_dict(state[f"model{i}"])
    if opt is not None:
        opt.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["opt_param_scheduler"])
    return int(state["iteration"])
