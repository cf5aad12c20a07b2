"""Megatron-style iteration lines with a progress bar, optional JSON records and TensorBoard scalars."""

from __future__ import annotations

import json
import resource
import sys
from dataclasses import asdict, dataclass
from typing import Any, Dict, Optional

import torch

__all__ = ["IterationRecord", "IterationLogger", "peak_memory_bytes"]


def peak_memory_bytes() -> int:
    """This process's peak memory: ``torch.cuda.max_memory_allocated`` on GPU, peak RSS on CPU."""
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


@dataclass
class IterationRecord:
    """One iteration's figures, as printed and as written to the JSON log (full float precision)."""

    iteration: int
    loss: float
    lr: float
    grad_norm: float
    tokens_per_s: float
    elapsed_ms: float
    peak_memory_bytes: int
    cp_bytes_intra: int
    cp_bytes_inter: int
    cp_bytes_by_op: Dict[str, int]  # this rank's sent bytes per collective ("ring_kv", "upipe_qkv", ...)


class IterationLogger:
    """Prints on rank 0 only; ``train_iters`` sizes the progress bar."""

    def __init__(self, train_iters: int, rank: int, json_path: Optional[str] = None,
                 tensorboard_dir: Optional[str] = None, progress_bar: bool = True) -> None:
        self.train_iters = train_iters
        self.enabled = rank == 0
        self.progress_bar = progress_bar
        self._json = open(json_path, "a") if (self.enabled and json_path) else None
        self._tb: Any = None
        if self.enabled and tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=tensorboard_dir)

    def info(self, message: str) -> None:
        if self.enabled:
            print(message, flush=True)

    def _bar(self, iteration: int, width: int = 20) -> str:
        done = width * iteration // self.train_iters
        return "[" + "#" * done + "." * (width - done) + "]"

    def log(self, rec: IterationRecord) -> None:
        if not self.enabled:
            return
        bar = self._bar(rec.iteration) + " " if self.progress_bar else ""
        print(f"{bar}iteration {rec.iteration:>6}/{self.train_iters:>6} | elapsed time per iteration (ms): "
              f"{rec.elapsed_ms:.1f} | tokens/s: {rec.tokens_per_s:.1f} | learning rate: {rec.lr:.6E} | "
              f"lm loss: {rec.loss:.6E} | grad norm: {rec.grad_norm:.4f} | "
              f"peak memory (MB): {rec.peak_memory_bytes / 2**20:.1f} | "
              f"CP bytes sent/rank intra: {rec.cp_bytes_intra} inter: {rec.cp_bytes_inter}", flush=True)
        if self._json is not None:
            self._json.write(json.dumps(asdict(rec)) + "\n")
            self._json.flush()
        if self._tb is not None:
            for key in ("loss", "lr", "grad_norm", "tokens_per_s", "cp_bytes_intra", "cp_bytes_inter"):
                self._tb.add_scalar(key, getattr(rec, key), rec.iteration)

    def close(self) -> None:
        if self._json is not None:
            self._json.close()
        if self._tb is not None:
            self._tb.close()
        sys.stdout.flush()
