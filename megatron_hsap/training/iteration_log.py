"""Megatron-LM's log lines and TensorBoard/W&B scalars, plus the HSAP fields, with a progress bar and JSON records.

Lines, scalar names and meanings follow Megatron-LM's ``training_log`` and
``evaluate_and_print_results`` so its log parsers and dashboards work unchanged:

- every ``--log-interval`` iterations one line ``iteration N/T | consumed samples | elapsed time per
  iteration (ms) | [throughput per GPU (TFLOP/s/GPU)] | learning rate | global batch size | lm loss |
  loss scale | grad norm | number of skipped iterations | number of nan iterations |`` where time,
  throughput and loss are averages over the interval (as Megatron-LM), followed by the HSAP fields
  (tokens/s, peak memory, CP bytes sent per rank intra-/inter-node) of the logged iteration; its JSON
  record also holds the plan summary (``plan_summary``: the interval's and the run's plans vs zigzag's);
- every iteration the scalars ``learning-rate``, ``batch-size``, ``lm loss``, ``loss-scale``,
  ``grad-norm`` (each also ``... vs samples``), ``iteration-time``, ``throughput`` (with
  ``--log-throughput``) and ``hsap/...`` for the HSAP fields;
- each evaluation: ``validation loss at iteration N | lm loss value: X | lm loss PPL: Y |`` between
  dashed lines, scalars ``lm loss validation`` and ``lm loss validation ppl`` (and ``... vs samples``);
  the final test evaluation prints ``validation loss at iteration N on test set`` (Megatron-LM's words)
  and writes ``lm loss test`` / ``lm loss test ppl`` (Megatron-LM reuses the validation names).

Writers are optional (the ``tensorboard`` and ``wandb`` extras); ``make_writers`` raises a clear error
when a flag asks for one that is not installed. Only rank 0 prints and writes.
"""

from __future__ import annotations

import datetime
import json
import math
import resource
import sys
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Protocol

import torch

__all__ = ["IterationRecord", "IterationLogger", "ScalarWriter", "make_writers", "peak_memory_bytes",
           "num_floating_point_operations"]


def peak_memory_bytes() -> int:
    """This process's peak memory: ``torch.cuda.max_memory_allocated`` on GPU, peak RSS on CPU."""
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


#: The first megatron-core release whose Megatron-LM FLOPs formula counts causal attention at half
#: (``megatron/training/training.py``, ``num_floating_point_operations``: "only half of the attention
#: matrix is non-zero"); earlier releases count the full ``seq_length x seq_length`` score matrix.
CAUSAL_HALF_FROM = (0, 12)


def _installed_megatron_core_version() -> str:
    from importlib.metadata import version

    return version("megatron-core")


def num_floating_point_operations(args: Any, batch_size: int, padded_vocab_size: int,
                                  megatron_core_version: Optional[str] = None) -> float:
    """Model FLOPs of one iteration (forward + backward), Megatron-LM's formula for a dense GPT as the
    given megatron-core release (default: the installed one) writes it, so the logged TFLOP/s/GPU equals
    what that Megatron-LM would print.

    Attention is counted over the full ``--seq-length`` per sample, as Megatron-LM does (causal: half of
    the score matrix from ``CAUSAL_HALF_FROM`` on); with packed documents the attention actually computed
    is smaller, so this is the figure Megatron-LM would report.
    """
    release = megatron_core_version or _installed_megatron_core_version()
    major_minor = tuple(int(part) for part in release.split(".")[:2])
    causal_fraction = 1 / 2 if major_minor >= CAUSAL_HALF_FROM else 1
    kv_channels = getattr(args, "kv_channels", None) or args.hidden_size // args.num_attention_heads
    query_size = kv_channels * args.num_attention_heads
    key_value_size = 2 * kv_channels * args.num_query_groups
    ffn = args.ffn_hidden_size or 4 * args.hidden_size
    ffn_matrices = 3 if args.swiglu else 2  # SwiGLU stacks the gate and up projections
    # Per token and layer, multiply-adds (x 2 FLOPs) of the forward and both backward GEMMs (x 3).
    attention = (args.hidden_size * (query_size + key_value_size) + query_size * args.hidden_size
                 + 2 * query_size * args.seq_length * causal_fraction)  # QK^T and (QK^T)V
    mlp = args.hidden_size * ffn * ffn_matrices
    logits = args.hidden_size * padded_vocab_size
    return 6 * batch_size * args.seq_length * (args.num_layers * (attention + mlp) + logits)


class ScalarWriter(Protocol):
    """What the logger needs of a TensorBoard ``SummaryWriter`` (and of the W&B adapter)."""

    def add_scalar(self, tag: str, value: float, step: int) -> None: ...

    def close(self) -> None: ...


class _WandbWriter:
    """W&B run behind the ``add_scalar`` interface (Megatron-LM logs the same names to both)."""

    def __init__(self, wandb: Any, project: str, name: Optional[str], save_dir: Optional[str], config: Dict) -> None:
        self._wandb = wandb
        self._run = wandb.init(project=project, name=name, dir=save_dir, config=config)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self._run.log({tag: value}, step=step)

    def close(self) -> None:
        self._run.finish()


def make_writers(tensorboard_dir: Optional[str], wandb_project: Optional[str] = None,
                 wandb_exp_name: Optional[str] = None, wandb_save_dir: Optional[str] = None,
                 config: Optional[Dict] = None) -> List[ScalarWriter]:
    """The scalar writers the flags ask for (call on rank 0 only). ImportError naming the pip command when a
    requested one is not installed."""
    writers: List[ScalarWriter] = []
    if tensorboard_dir:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ImportError("--tensorboard-dir needs the tensorboard package: pip install tensorboard "
                              "(or pip install 'megatron-hsap[tensorboard]')") from err
        writers.append(SummaryWriter(log_dir=tensorboard_dir))
    if wandb_project:
        try:
            import wandb
        except ImportError as err:
            raise ImportError("--wandb-project needs the wandb package: pip install wandb "
                              "(or pip install 'megatron-hsap[wandb]')") from err
        writers.append(_WandbWriter(wandb, wandb_project, wandb_exp_name, wandb_save_dir, config or {}))
    return writers


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
    consumed_samples: int
    global_batch_size: int
    loss_scale: float
    skipped: bool  # the optimizer skipped the update (fp16 loss scaling found inf/NaN gradients)
    tflops_per_gpu: Optional[float]  # None unless --log-throughput
    host_offload_bytes: int = 0  # activations this rank copied to host memory (--offload-checkpointed-activations)
    #: Set when the line is printed, with a plan summary: ``{"interval": figures of the micro-batches since the
    #: previous line (or None), "run": figures so far}`` (``plan_summary.PlanTotals.as_dict``).
    plan: Optional[Dict[str, Any]] = None


class IterationLogger:
    """Prints on rank 0 only; ``train_iters`` sizes the progress bar. ``writers`` receive every scalar."""

    def __init__(self, train_iters: int, rank: int, json_path: Optional[str] = None,
                 writers: Optional[List[ScalarWriter]] = None, progress_bar: bool = True,
                 log_interval: int = 1, plan_summary: Any = None) -> None:
        self.train_iters = train_iters
        self.plan_summary = plan_summary  # a plan_summary.PlanSummary fed as micro-batches are read, or None
        self.enabled = rank == 0
        self.progress_bar = progress_bar
        self.log_interval = log_interval
        self._json = open(json_path, "a") if (self.enabled and json_path) else None
        self.writers: List[ScalarWriter] = list(writers or []) if self.enabled else []
        self._interval: List[IterationRecord] = []
        self._skipped = 0
        self._nan = 0

    def info(self, message: str) -> None:
        if self.enabled:
            print(message, flush=True)

    def _bar(self, iteration: int, width: int = 20) -> str:
        done = width * iteration // self.train_iters
        return "[" + "#" * done + "." * (width - done) + "]"

    def _scalar(self, tag: str, value: float, step: int) -> None:
        for writer in self.writers:
            writer.add_scalar(tag, value, step)

    def record(self, rec: IterationRecord) -> None:
        """Every iteration: scalars now; the line (averaged over the interval) and the JSON record at
        every ``log_interval``-th iteration and at the last one."""
        if not self.enabled:
            return
        self._interval.append(rec)
        self._skipped += int(rec.skipped)
        self._nan += int(not math.isfinite(rec.loss))
        step, samples = rec.iteration, rec.consumed_samples
        for tag, value in (("learning-rate", rec.lr), ("batch-size", rec.global_batch_size), ("lm loss", rec.loss),
                           ("loss-scale", rec.loss_scale), ("grad-norm", rec.grad_norm)):
            self._scalar(tag, value, step)
            self._scalar(f"{tag} vs samples", value, samples)
        self._scalar("iteration-time", rec.elapsed_ms / 1000, step)
        if rec.tflops_per_gpu is not None:
            self._scalar("throughput", rec.tflops_per_gpu, step)
        for tag, value in (("hsap/tokens-per-second", rec.tokens_per_s), ("hsap/peak-memory-bytes",
                                                                          rec.peak_memory_bytes),
                           ("hsap/cp-bytes-intra", rec.cp_bytes_intra), ("hsap/cp-bytes-inter", rec.cp_bytes_inter)):
            self._scalar(tag, value, step)
        if rec.iteration % self.log_interval == 0 or rec.iteration == self.train_iters:
            self._print(rec)

    def _print(self, rec: IterationRecord) -> None:
        interval, self._interval = self._interval, []
        elapsed_ms = sum(r.elapsed_ms for r in interval) / len(interval)
        finite = [r.loss for r in interval if math.isfinite(r.loss)]
        bar = self._bar(rec.iteration) + " " if self.progress_bar else ""
        now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
        line = (f"{bar}[{now}] iteration {rec.iteration:8d}/{self.train_iters:8d} | consumed samples: "
                f"{rec.consumed_samples:12d} | elapsed time per iteration (ms): {elapsed_ms:.1f} |")
        if rec.tflops_per_gpu is not None:
            tflops = rec.tflops_per_gpu * rec.elapsed_ms / elapsed_ms  # per-iteration FLOPs over the mean time
            line += f" throughput per GPU (TFLOP/s/GPU): {tflops:.1f} |"
        line += f" learning rate: {rec.lr:.6E} | global batch size: {rec.global_batch_size:5d} |"
        if finite:
            line += f" lm loss: {sum(finite) / len(finite):.6E} |"
        line += (f" loss scale: {rec.loss_scale:.1f} | grad norm: {rec.grad_norm:.3f} | number of skipped "
                 f"iterations: {self._skipped:3d} | number of nan iterations: {self._nan:3d} | tokens/s: "
                 f"{rec.tokens_per_s:.1f} | peak memory (MB): {rec.peak_memory_bytes / 2**20:.1f} | "
                 f"CP bytes sent/rank intra: {rec.cp_bytes_intra} inter: {rec.cp_bytes_inter} |")
        self._skipped = self._nan = 0
        print(line, flush=True)
        if self.plan_summary is not None:
            interval = self.plan_summary.take_interval()
            rec.plan = {"interval": None if interval is None else interval.as_dict(),
                        "run": self.plan_summary.run.as_dict()}
        if self._json is not None:
            self._json.write(json.dumps(asdict(rec)) + "\n")
            self._json.flush()

    def evaluation(self, split: str, prefix: str, loss: float, iteration: int, consumed_samples: int,
                   detail: str = "") -> None:
        """Megatron-LM's evaluation block ``validation loss at <prefix> | lm loss value | lm loss PPL`` (the
        same words for the test split, as Megatron-LM: the prefix says "on test set"), scalars
        ``lm loss <split>`` and ``lm loss <split> ppl`` (``split``: 'validation' or 'test'). ``detail`` (which
        evaluation, which batches) follows as a last field, so a periodic and a final evaluation at the same
        iteration read apart while Megatron-LM's fields keep their place."""
        if not self.enabled:
            return
        ppl = math.exp(min(20.0, loss))
        text = f" validation loss at {prefix} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} | "
        text += f"{detail} | " if detail else ""
        print("-" * (len(text) + 1), text, "-" * (len(text) + 1), sep="\n", flush=True)
        for tag, value in ((f"lm loss {split}", loss), (f"lm loss {split} ppl", ppl)):
            self._scalar(tag, value, iteration)
            self._scalar(f"{tag} vs samples", value, consumed_samples)
        if self._json is not None:
            self._json.write(json.dumps({"evaluation": split, "iteration": iteration, "lm_loss": loss,
                                         "ppl": ppl, "detail": detail}) + "\n")
            self._json.flush()

    def close(self) -> None:
        if self._json is not None:
            self._json.close()
        for writer in self.writers:
            writer.close()
        sys.stdout.flush()
