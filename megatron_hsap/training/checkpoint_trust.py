"""Loading a checkpoint runs no code from it: every pickle in it is read through an allow-list.

A ``torch_dist`` checkpoint holds three kinds of pickle:
- ``.metadata``: ``torch.distributed.checkpoint``'s ``Metadata``, which its ``FileSystemReader.read_metadata``
  reads with a plain ``pickle.load``;
- the non-sharded objects (``args``, ``iteration``, content metadata): ``common.pt``, a ``torch.save`` file
  (megatron-core up to 0.16), or the ``common_state`` sharded object (0.19);
- sharded objects (``rng_state``, layers' ``_extra_state``): ``torch.save`` bytes inside the ``.distcp``
  files, which torch's ``DefaultLoadPlanner.load_bytes`` reads with ``torch.load(weights_only=False)``.

A crafted pickle of any kind would run code on every rank at resume. Here:
- ``check_pickles`` reads each of them through an allow-list before anything is loaded (``.metadata``
  with ``CheckpointUnpickler``, which allows only ``torch.distributed.checkpoint``'s metadata classes; the
  ``torch.save`` files and objects with ``torch.load(weights_only=True)`` plus ``OBJECT_GLOBALS``, the few
  non-tensor classes this project's checkpoints hold) and returns an error naming the file and the class;
- ``restricted_loading`` keeps megatron-core's own load on the same allow-lists (``.metadata`` through
  ``CheckpointUnpickler``; every ``torch.load`` weights-only, via torch's ``TORCH_FORCE_WEIGHTS_ONLY_LOAD``),
  so a file changed after the check is refused too.

The manifest's CRC-32s detect damage, not tampering: they can be recomputed by whoever edits the files.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import pickle
import re
from typing import IO, Any, Iterator, List

import numpy as np
import torch

__all__ = ["UnsafeCheckpointError", "CheckpointUnpickler", "OBJECT_GLOBALS", "check_pickles", "read_metadata",
           "restricted_loading", "load_common"]

_METADATA = ".metadata"
_COMMON = "common.pt"


class UnsafeCheckpointError(ValueError):
    """A checkpoint pickle names a class outside the allow-list (or is not a pickle of this project)."""


def _metadata_globals() -> frozenset:
    """(module, name) of every class ``torch.distributed.checkpoint`` writes into ``.metadata`` (its metadata
    and plan records, ``_StorageInfo``), and the torch objects they hold (sizes, dtypes, layouts)."""
    from torch.distributed.checkpoint import filesystem, metadata, planner

    names = {(metadata.__name__, n) for n in ("ChunkStorageMetadata", "_MEM_FORMAT_ENCODING", "TensorProperties",
                                              "TensorStorageMetadata", "BytesStorageMetadata", "StorageMeta",
                                              "Metadata", "MetadataIndex")}
    names |= {(planner.__name__, n) for n in ("WriteItemType", "LoadItemType", "BytesIOWriteData",
                                              "TensorWriteData", "WriteItem", "ReadItem", "SavePlan", "LoadPlan")}
    names |= {(filesystem.__name__, "_StorageInfo"), ("torch", "Size"), ("torch.serialization", "_get_layout"),
              ("collections", "OrderedDict")}
    names |= {("torch", n) for n, v in vars(torch).items() if isinstance(v, torch.dtype)}
    return frozenset(names)


def _object_globals() -> List[Any]:
    """The non-tensor classes of this project's ``torch.save`` objects besides what weights-only torch allows:
    the ``args`` namespace, NumPy's RNG state (an array), and ``io.BytesIO`` (Transformer Engine's
    ``_extra_state`` in some releases)."""
    core = getattr(np, "_core", None) or np.core
    return [argparse.Namespace, np.ndarray, np.dtype, type(np.dtype(np.uint32)), core.multiarray._reconstruct,
            io.BytesIO]


OBJECT_GLOBALS = _object_globals()


class CheckpointUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that builds only ``torch.distributed.checkpoint``'s metadata classes; any other
    global (a function such as ``os.system``, any other class) raises ``UnsafeCheckpointError`` naming the
    file and the global, before it is looked up."""

    _allowed = None

    def __init__(self, file: IO[bytes], where: str) -> None:
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if CheckpointUnpickler._allowed is None:
            CheckpointUnpickler._allowed = _metadata_globals()
        if (module, name) not in CheckpointUnpickler._allowed:
            raise UnsafeCheckpointError(_refusal(self.where, f"{module}.{name}"))
        return super().find_class(module, name)


def _refusal(where: str, name: str) -> str:
    return (f"{where} names {name}, which a checkpoint of this project never holds: refusing to load it (a "
            "crafted pickle could run code; load only checkpoints your own jobs wrote)")


def _restricted_pickle_load(file: IO[bytes], *args: Any, **kwargs: Any) -> Any:
    """``pickle.load`` for ``torch.distributed.checkpoint.filesystem`` within ``restricted_loading``."""
    return CheckpointUnpickler(file, getattr(file, "name", _METADATA)).load()


def read_metadata(path: str) -> Any:
    """``path``'s ``torch.distributed.checkpoint`` ``Metadata``, read through ``CheckpointUnpickler``."""
    where = os.path.join(path, _METADATA)
    with open(where, "rb") as f:
        try:
            return CheckpointUnpickler(f, where).load()
        except UnsafeCheckpointError:
            raise
        except Exception as err:  # noqa: BLE001 - any other unpickling failure is a damaged file
            raise UnsafeCheckpointError(f"{where} is not a torch.distributed.checkpoint metadata file "
                                        f"({type(err).__name__}: {err})") from err


def _torch_load(source: Any, where: str) -> Any:
    """``torch.load(weights_only=True)`` with ``OBJECT_GLOBALS``; UnsafeCheckpointError naming ``where`` and the
    refused global."""
    try:
        with torch.serialization.safe_globals(OBJECT_GLOBALS):
            return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"GLOBAL (\S+)", str(err))
        name = found.group(1) if found else f"something weights-only torch refuses ({str(err).splitlines()[0]})"
        name = name if not found or "." in name else f"builtins.{name}"  # torch names builtins without module
        raise UnsafeCheckpointError(_refusal(where, name)) from None
    except Exception as err:  # noqa: BLE001 - a damaged object is named too
        raise UnsafeCheckpointError(f"{where} cannot be read ({type(err).__name__}: {err})") from err


def load_common(path: str) -> Any:
    """``path``'s non-sharded objects (``args``, ``iteration``, ...), read weights-only with ``OBJECT_GLOBALS``:
    from ``common.pt`` (megatron-core up to 0.16), else from the ``common_state`` sharded object (0.19)."""
    common = os.path.join(path, _COMMON)
    if os.path.exists(common):
        return _torch_load(common, common)
    metadata = read_metadata(path)
    found = [(index, info) for index, info in metadata.storage_data.items() if index.fqn.startswith("common_state")]
    if not found:
        raise UnsafeCheckpointError(f"{path} holds neither {_COMMON} nor a common_state object: not a "
                                    "megatron-core torch_dist checkpoint")
    return _stored_object(path, *found[0])[0]


def _stored_object(path: str, index: Any, info: Any) -> Any:
    """The sharded object ``index`` (a ``MetadataIndex``) stored at ``info`` (a ``_StorageInfo``), weights-only."""
    where = f"{os.path.join(path, info.relative_path)} (object {index.fqn!r})"
    with open(os.path.join(path, info.relative_path), "rb") as f:
        f.seek(info.offset)
        data = f.read(info.length)
    return _torch_load(io.BytesIO(data), where)


def check_pickles(path: str) -> List[str]:
    """Problems with the pickles of checkpoint directory ``path`` ([] when every one is within the allow-lists):
    ``.metadata``, ``common.pt`` and every sharded object the metadata points at (its bytes in a ``.distcp`` file)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

    try:
        metadata = read_metadata(path)
        if not isinstance(metadata, Metadata):
            return [f"{os.path.join(path, _METADATA)} holds a {type(metadata).__name__}, not a "
                    "torch.distributed.checkpoint Metadata"]
        if os.path.exists(os.path.join(path, _COMMON)):
            load_common(path)
    except (UnsafeCheckpointError, OSError) as err:
        return [str(err)]
    byte_keys = {key for key, meta in metadata.state_dict_metadata.items() if isinstance(meta, BytesStorageMetadata)}
    for index, info in sorted(metadata.storage_data.items(), key=lambda kv: kv[0].fqn):
        if index.fqn in byte_keys:
            try:
                _stored_object(path, index, info)
            except (UnsafeCheckpointError, OSError) as err:
                return [str(err)]
    return []


@contextlib.contextmanager
def restricted_loading() -> Iterator[None]:
    """Within: ``torch.distributed.checkpoint`` reads ``.metadata`` through ``CheckpointUnpickler`` and every
    ``torch.load`` is weights-only with ``OBJECT_GLOBALS`` (torch's ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` overrides
    the ``weights_only=False`` of its ``load_bytes``)."""
    from torch.distributed.checkpoint import filesystem

    saved_env = {k: os.environ.get(k) for k in ("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")}
    saved_pickle = filesystem.pickle
    os.environ.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    filesystem.pickle = _RestrictedPickleModule()
    try:
        with torch.serialization.safe_globals(OBJECT_GLOBALS):
            yield
    finally:
        filesystem.pickle = saved_pickle
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class _RestrictedPickleModule:
    """The ``pickle`` module with ``load`` through ``CheckpointUnpickler`` (the rest unchanged)."""

    load = staticmethod(_restricted_pickle_load)

    def __getattr__(self, name: str) -> Any:
        return getattr(pickle, name)
