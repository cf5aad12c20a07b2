"""The training loop: Megatron-Core model, optimizer, schedules and checkpoints around HSAP attention.

Loss with context parallelism: each CP rank sums the masked per-token losses of
its own tokens and divides by the token count of the *whole* micro-batch (known
on every rank without communication). Megatron's schedule multiplies by the CP
size and DDP averages gradients over the data-and-context-parallel group, so the
gradient equals the CP=1 gradient; the logged loss sums the CP parts.

Devices: ``torch.cuda.set_device(LOCAL_RANK % torch.cuda.device_count())`` comes before any CUDA work
(``local_device_index``: several ranks may share one GPU, as in a one-GPU validation run); micro-batches are
packed and planned on the host and moved to the model's device (``PackedMicroBatch.to``); every
reduction (loss, CP byte counters) runs on tensors on that device, as NCCL requires.

Evaluation (Megatron-LM's): every ``--eval-interval`` iterations, after training, and once on the
test split, ``--eval-iters`` global batches through Megatron-Core's schedule with
``forward_only=True``; the loss is the same micro-batch mean as in training, so it does not depend
on the CP size or mode.

Failures (docs/training.md, "Failures and preemption"): the phase and iteration
are recorded in ``progress`` for error messages; NaN/Inf stop the run before the
optimizer step (``nonfinite``); exit signals and time limits save and stop all
ranks together at an iteration boundary (``preemption``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_hsap.megatron.activation_offload import HostOffload, saved_activations_on_host
from megatron_hsap.training import fault_injection, progress
from megatron_hsap.training.arguments import cp_config_from_args
from megatron_hsap.training.iteration_log import IterationLogger, IterationRecord, peak_memory_bytes
from megatron_hsap.sequence.plan import PLAN_CACHE
from megatron_hsap.sequence.prefetch import plan_ahead
from megatron_hsap.training.packing import PackedMicroBatch, document_cu_seqlens, pack_micro_batch
from megatron_hsap.training.plan_summary import PlanSummary, plan_cache_line
from megatron_hsap.training.plan_workers import plan_in_workers
from megatron_hsap.training.startup import configuration_lines

__all__ = ["pretrain", "forward_packed", "local_device_index"]


def _init_distributed(args: argparse.Namespace) -> None:
    backend = args.distributed_backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():  # before any CUDA work: Megatron allocates on the current device
        torch.cuda.set_device(local_device_index(int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.device_count()))
    if backend != "nccl":
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", 1))))
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes))
    progress.set_phase("start-up")


def local_device_index(local_rank: int, device_count: int) -> int:
    """The GPU of local rank ``local_rank``: ``local_rank % device_count``, so ranks may share GPUs (more ranks
    than GPUs on a node, e.g. several ranks on one GPU); ValueError without a GPU."""
    if device_count < 1:
        raise ValueError(f"device_count={device_count}: no CUDA device to place local rank {local_rank} on")
    return local_rank % device_count


def _check_heads(args: argparse.Namespace, topology: Any) -> None:
    """Head counts per TP rank against the Ulysses size and the head-chunk size, identically on every rank
    (any counts split over the Ulysses group, see ``megatron_hsap.head_split``; the chunk size must fit them)."""
    cp_config = cp_config_from_args(args)
    heads_per_tp = args.num_attention_heads // args.tensor_model_parallel_size
    try:
        cp_config.resolve_head_chunk_size(heads_per_tp, topology.ulysses_size)
    except ValueError as err:
        raise ValueError(f"--head-chunk-size with --num-attention-heads ({args.num_attention_heads}) / "
                         f"--tensor-model-parallel-size ({args.tensor_model_parallel_size}) and Ulysses size "
                         f"{topology.ulysses_size}: {err}") from None


def _kernel_description(requested: str) -> str:
    """The attention kernel this run uses and why (``auto``'s choice on this machine)."""
    from megatron_hsap.kernels import AutoKernel, get_kernel

    if requested != "auto":
        return f"{requested} (--attention-kernel)"
    kernel = get_kernel("auto")
    if isinstance(kernel, AutoKernel):
        return (f"auto: per call shape and dtype, the first of {', '.join(k.name for k in kernel.kernels)} that "
                "accepts it (the ones that load on this machine)")
    return f"{kernel.name} (--attention-kernel auto: the first kernel that loads on this machine)"


def _planned_micro_batches(args: argparse.Namespace, dataset: Any, dp_rank: int, first: int, stop: Optional[int],
                           label: str, vocab_size: int, cu_seqlens_of: Callable[[Dict], torch.Tensor], topology: Any,
                           layout: str) -> Iterator[Dict[str, torch.Tensor]]:
    """This DP rank's micro-batches of iterations ``[first, stop)`` (``data.micro_batches``), planned ahead:
    read and planned in ``--num-workers`` worker processes, or with 0, read here and planned in a thread."""
    from megatron_hsap.training.data import micro_batch_at, micro_batch_indices, micro_batches

    if args.num_workers:
        read = partial(micro_batch_at, dataset, args, dp_rank, vocab_size=vocab_size, label=label)
        yield from plan_in_workers(read, micro_batch_indices(args, first, stop), cu_seqlens_of, topology, layout,
                                   num_workers=args.num_workers)
    else:
        yield from plan_ahead(micro_batches(dataset, args, dp_rank, first, vocab_size, stop, label), cu_seqlens_of,
                              topology, layout)


def _packed_iterator(batches: Iterator[Dict[str, torch.Tensor]], eod: int, split_at_eod: bool, topology: Any,
                     layout: str, device: torch.device, plan_summary: Optional[PlanSummary] = None
                     ) -> Iterator[PackedMicroBatch]:
    """Pack each micro-batch and move it to ``device``; planned ahead (``_planned_micro_batches``), its
    ``pack_micro_batch``'s own ``plan_batch`` is a cache hit. ``plan_summary`` counts each plan as it is read."""
    for batch in batches:
        mb = pack_micro_batch(batch, eod, split_at_eod, topology, layout)
        if plan_summary is not None:
            params = mb.packed_seq_params
            plan_summary.add(params.plan, params.cu_seqlens_q)
        yield mb.to(device)


def _cu_seqlens_of(eod: int, split_at_eod: bool, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    return document_cu_seqlens(batch["tokens"], eod, split_at_eod)


def _loss_func(mb: PackedMicroBatch, cp_group: Any, nan_check: Any, output_tensor: torch.Tensor
               ) -> Tuple[torch.Tensor, Dict]:
    """Per-token losses ``[1, t_local]`` -> this rank's share of the micro-batch mean loss (see module doc)."""
    local_sum = torch.sum(output_tensor.float().view(-1) * mb.loss_mask.view(-1))
    if nan_check is not None:
        nan_check.record_loss(local_sum)
    denominator = max(mb.num_loss_tokens, 1)
    reported = local_sum.detach().clone()
    if cp_group is not None and dist.get_world_size(cp_group) > 1:
        dist.all_reduce(reported, group=cp_group)
    return local_sum / denominator, {"lm loss": reported / denominator}


def forward_packed(mb: PackedMicroBatch, model: Any, cp_group: Any, nan_check: Any = None,
                   offload_activations: bool = False) -> Tuple[torch.Tensor, Any]:
    """Megatron's forward-step contract for one packed micro-batch already on the model's device:
    (per-token losses ``[1, t_local]``, loss function). Shared by this loop and ``megatron_hsap.training.megatron_lm``.
    ``offload_activations``: the activations saved for backward live in host memory (``HostOffload``)."""
    with saved_activations_on_host(offload_activations, mb.tokens.device):
        output = model(mb.tokens, mb.position_ids, None, labels=mb.labels, packed_seq_params=mb.packed_seq_params)
    return output, partial(_loss_func, mb, cp_group, nan_check)


def _forward_step(cp_group: Any, nan_check: Any, offload_activations: bool, all_chunks: List[Any],
                  data_iterator: Iterator[PackedMicroBatch], model: Any) -> Tuple[torch.Tensor, Any]:
    mb = next(data_iterator)
    fault_injection.inject("forward", progress.current_iteration(), model=all_chunks, loss_mask=mb.loss_mask)
    return forward_packed(mb, model, cp_group, nan_check, offload_activations)


def _eval_forward_step(cp_group: Any, data_iterator: Iterator[PackedMicroBatch], model: Any
                       ) -> Tuple[torch.Tensor, Any]:
    return forward_packed(next(data_iterator), model, cp_group)


def _check_then_finalize(nan_check: Any, finalize: Any, *args: Any, **kwargs: Any) -> Any:
    """Megatron's ``finalize_model_grads`` (DP/CP gradient reduction), after looking at this rank's own grads."""
    nan_check.check_grads()
    return finalize(*args, **kwargs)


def _reduce_loss(losses: List[Dict[str, torch.Tensor]], device: torch.device) -> float:
    """Mean micro-batch loss over the global batch(es), available on every rank (one world all-reduce on
    ``device``, the model's: NCCL reduces only CUDA tensors)."""
    from megatron.core import parallel_state as mpu

    contributes = (mpu.is_pipeline_last_stage(ignore_virtual=True) and mpu.get_tensor_model_parallel_rank() == 0
                   and mpu.get_context_parallel_rank() == 0)
    buf = torch.zeros(2, dtype=torch.float64, device=device)
    if contributes and losses:
        buf[0] = torch.stack([x["lm loss"].to(device=device, dtype=torch.float64) for x in losses]).sum()
        buf[1] = len(losses)
    dist.all_reduce(buf)
    return float(buf[0] / buf[1])


def _bytes_by_op(sent: Dict[Tuple[str, str], int]) -> Dict[str, int]:
    out: Dict[str, int] = {}
    for (op, _), nbytes in sent.items():
        out[op] = out.get(op, 0) + nbytes
    return out


def _setup(args: argparse.Namespace) -> Tuple[Any, ...]:
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_hsap.megatron.cpu_shim import apply_cpu_shim
    from megatron_hsap.parallel_state import initialize_model_parallel

    apply_cpu_shim()
    topology = initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size, cp_config=cp_config_from_args(args),
        ranks_per_node=args.ranks_per_node, distributed_timeout_minutes=args.distributed_timeout_minutes,
        virtual_pipeline_model_parallel_size=None if args.num_layers_per_virtual_pipeline_stage is None else
        args.num_layers // args.pipeline_model_parallel_size // args.num_layers_per_virtual_pipeline_stage)
    # Every rank has finished building its groups before any can fail the check below and exit
    # (a rank that left early would stall peers still connecting to it).
    dist.barrier()
    _check_heads(args, topology)
    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed)
    return topology, mpu


def pretrain(args: argparse.Namespace) -> List[IterationRecord]:
    """Train per ``args`` (already validated by ``parse_args``); returns rank 0's iteration records."""
    from megatron_hsap.parallel_state import destroy_model_parallel
    from megatron_hsap.training.preemption import ExitSignalHandler

    started = time.time()
    signals = ExitSignalHandler(args.exit_signal) if args.exit_signal_handler else None
    PLAN_CACHE.set_max_bytes(int(args.plan_cache_mb * (1 << 20)))  # before the data-loader workers fork
    _init_distributed(args)
    # No collective teardown when _train raises: the other ranks may be anywhere (a rank that
    # waited for them in destroy_process_group could hang); exiting the process frees the group.
    records = _train(args, signals, started)
    progress.set_phase("finished")
    destroy_model_parallel()
    dist.destroy_process_group()
    if signals is not None:
        signals.restore()
    return records


class _Evaluator:
    """Megatron-LM's evaluation: ``--eval-iters`` global batches of a split, forward only, without gradients.

    The k-th validation reads the split's global batches ``(k-1)*eval_iters ... k*eval_iters - 1`` (it
    continues where the previous one stopped, as Megatron-LM's validation iterator), so a resumed run
    evaluates exactly the samples the uninterrupted run would have.
    """

    def __init__(self, args: argparse.Namespace, model: List[Any], forward_backward: Any, cp_group: Any,
                 make_iterator: Any, device: torch.device) -> None:
        self.args, self.model, self.forward_backward, self.device = args, model, forward_backward, device
        self.step = partial(_eval_forward_step, cp_group)
        self.make_iterator = make_iterator  # (dataset, first global batch, stop, label) -> packed micro-batches

    def loss(self, dataset: Any, index: int, label: str) -> float:
        """Mean lm loss over evaluation number ``index`` (0-based) of ``dataset``."""
        args = self.args
        first = index * args.eval_iters
        iterators = [self.make_iterator(dataset, first, first + args.eval_iters, label) for _ in self.model]
        for chunk in self.model:
            chunk.eval()
        losses: List[Dict[str, torch.Tensor]] = []
        with torch.no_grad():
            for _ in range(args.eval_iters):
                losses += self.forward_backward(
                    forward_step_func=self.step, data_iterator=iterators if len(self.model) > 1 else iterators[0],
                    model=self.model, num_microbatches=args.num_microbatches,
                    seq_length=args.micro_batch_size * args.seq_length, micro_batch_size=1, forward_only=True)
        for chunk in self.model:
            chunk.train()
        return _reduce_loss(losses, self.device)


@dataclass
class _TrainingRun:
    """What the setup phase builds and the step, evaluation and save phases use."""

    args: argparse.Namespace
    log: IterationLogger
    model: List[Any]  # the model chunks (one per virtual pipeline stage)
    optimizer: Any
    scheduler: Any
    device: torch.device
    data_iterator: Any  # one packed micro-batch iterator, or one per model chunk (interleaved schedule)
    forward_backward: Any  # Megatron-Core's schedule
    step: Callable[..., Tuple[torch.Tensor, Any]]  # the forward step it calls
    evaluator: _Evaluator
    nan_check: Any
    valid_dataset: Any
    test_dataset: Any
    plan_summary: Optional[PlanSummary]
    start: int  # the last iteration done before this run (0, or the loaded checkpoint's)
    flops: Optional[float]  # model FLOPs of one global batch (--log-throughput)


def _train(args: argparse.Namespace, signals: Any, started: float) -> List[IterationRecord]:
    """Megatron-LM's ``train``: setup, then per iteration a step, a periodic evaluation, an exit check and a
    save; after the last iteration (no early exit) the final validation and test evaluations."""
    run = _setup_training(args)
    records: List[IterationRecord] = []
    iteration = run.start
    for iteration in range(run.start + 1, args.train_iters + 1):
        record = _train_step(run, iteration)
        records.append(record)
        run.log.record(record)
        if run.valid_dataset is not None and iteration % args.eval_interval == 0:
            _log_evaluation(run.evaluator, run.log, run.valid_dataset, "validation",
                            iteration // args.eval_interval - 1, f"iteration {iteration}", iteration, args, "periodic")
        reason = _exit_reason(run, iteration, signals, started)
        stop = iteration == args.train_iters or bool(reason)
        if args.save is not None and ((args.save_interval and iteration % args.save_interval == 0) or stop):
            _save(run, iteration)
        if reason:
            run.log.info(f"exiting after iteration {iteration}: {reason}")
            break
    else:  # training completed (no early exit): Megatron-LM's final validation and test evaluations
        _final_evaluations(run, iteration)
    if records:
        run.log.info(f"done: lm loss {records[0].loss:.4f} (iteration {records[0].iteration}) -> "
                     f"{records[-1].loss:.4f} (iteration {records[-1].iteration})")
    if run.plan_summary is not None and run.plan_summary.run.planned.micro_batches:
        run.log.info(plan_cache_line(PLAN_CACHE))
        run.log.info(run.plan_summary.run.line())
    run.log.close()
    return records


def _setup_training(args: argparse.Namespace) -> _TrainingRun:
    """Process groups, logger, tokenizer, datasets, model, optimizer and scheduler (loaded from --load), the
    gradient hooks, the start-up lines, and the packed micro-batch iterators from the first iteration to run."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_hsap.training.checkpoint import load_checkpoint
    from megatron_hsap.training.data import build_datasets
    from megatron_hsap.training.iteration_log import make_writers, num_floating_point_operations
    from megatron_hsap.training.model import build_model, padded_vocab_size, transformer_config
    from megatron_hsap.training.nonfinite import NonFiniteCheck
    from megatron_hsap.training.tokenizer import build_tokenizer

    topology, mpu = _setup(args)
    writers = make_writers(args.tensorboard_dir, args.wandb_project, args.wandb_exp_name, args.wandb_save_dir,
                           vars(args)) if dist.get_rank() == 0 else []
    cp_config = cp_config_from_args(args)
    layout = cp_config.resolved_layout
    # Rank 0 sums what its training micro-batches' plans did (and zigzag's on the same samples).
    plan_summary = _plan_summary(args, layout) if dist.get_rank() == 0 else None
    log = IterationLogger(args.train_iters, dist.get_rank(), args.log_json, writers,
                          progress_bar=not args.no_progress_bar, log_interval=args.log_interval,
                          plan_summary=plan_summary)
    tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_size, args.vocab_file,
                                args.merge_file, args.tiktoken_pattern)
    dataset, valid_dataset, test_dataset = build_datasets(args, tokenizer)
    config = transformer_config(args)
    model = build_model(args, config, cp_config, tokenizer.vocab_size)
    optimizer, scheduler = _build_optimizer(args, config, model)
    start = 0
    if args.load is not None:
        progress.set_phase("loading checkpoint")
        start = load_checkpoint(args.load, model, optimizer, scheduler, args, log=log.info)

    nan_check = NonFiniteCheck(model) if args.check_for_nan_in_loss_and_grad else None
    _install_gradient_hooks(config, optimizer, model, nan_check)
    for line in configuration_lines(args, topology, cp_config, _kernel_description(cp_config.kernel)):
        log.info(line)
    log.info(f"megatron-hsap: model: {sum(p.numel() for m in model for p in m.parameters())} parameters on rank 0")

    device = next(model[0].parameters()).device
    dp_rank = mpu.get_data_parallel_rank()
    eod, split_at_eod = tokenizer.eod, args.reset_attention_mask
    cu_seqlens_of = partial(_cu_seqlens_of, eod, split_at_eod)

    def packed(data: Any, first: int, stop: Optional[int], label: str = "", plan_summary: Optional[PlanSummary] = None
               ) -> Iterator[PackedMicroBatch]:
        batches = _planned_micro_batches(args, data, dp_rank, first, stop, label, tokenizer.vocab_size, cu_seqlens_of,
                                         topology, layout)
        return _packed_iterator(batches, eod, split_at_eod, topology, layout, device, plan_summary)

    # One iterator per model chunk: the interleaved schedule reads each micro-batch once per chunk.
    iterators = [packed(dataset, start, None, plan_summary=plan_summary if i == 0 else None)
                 for i in range(len(model))]
    forward_backward = get_forward_backward_func()
    cp_group = mpu.get_context_parallel_group()
    flops = (num_floating_point_operations(args, args.global_batch_size,
                                           padded_vocab_size(tokenizer.vocab_size, args))
             if args.log_throughput else None)
    return _TrainingRun(
        args=args, log=log, model=model, optimizer=optimizer, scheduler=scheduler, device=device,
        data_iterator=iterators if len(model) > 1 else iterators[0], forward_backward=forward_backward,
        step=partial(_forward_step, cp_group, nan_check, args.offload_checkpointed_activations, model),
        evaluator=_Evaluator(args, model, forward_backward, cp_group, packed, device), nan_check=nan_check,
        valid_dataset=valid_dataset, test_dataset=test_dataset, plan_summary=plan_summary, start=start, flops=flops)


def _build_optimizer(args: argparse.Namespace, config: Any, model: List[Any]) -> Tuple[Any, Any]:
    """Megatron-Core's Adam (distributed with --use-distributed-optimizer) and its learning-rate scheduler."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
                        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, clip_grad=args.clip_grad,
                        bf16=args.bf16, params_dtype=config.params_dtype,
                        decoupled_lr=args.decoupled_lr, decoupled_min_lr=args.decoupled_min_lr,
                        use_distributed_optimizer=args.use_distributed_optimizer), model)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_steps, lr_decay_steps=args.lr_decay_steps, lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay, end_wd=args.weight_decay, wd_incr_steps=args.wd_incr_steps,
        wd_incr_style="constant", override_opt_param_scheduler=args.override_opt_param_scheduler,
        use_checkpoint_opt_param_scheduler=not args.override_opt_param_scheduler)
    return optimizer, scheduler


def _install_gradient_hooks(config: Any, optimizer: Any, model: List[Any], nan_check: Any) -> None:
    """The schedule's hooks on the transformer config: loss scaling, the DP/CP gradient reduction (after the
    NaN/Inf check of this rank's gradients when it is on) and DDP's no_sync per chunk."""
    from megatron.core.distributed import finalize_model_grads

    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = (finalize_model_grads if nan_check is None else
                                        partial(_check_then_finalize, nan_check, finalize_model_grads))
    config.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync


def _train_step(run: _TrainingRun, iteration: int) -> IterationRecord:
    """One iteration: forward-backward over the global batch, the NaN/Inf check, the optimizer and scheduler
    step, then the record (loss on every rank, CP bytes as the maximum over ranks)."""
    from megatron_hsap.instrumentation import comm_stats

    args, model, optimizer = run.args, run.model, run.optimizer
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    progress.set_phase("forward-backward", iteration)
    before, t0 = comm_stats(), time.perf_counter()
    offloaded_before = HostOffload.total_offloaded_bytes
    losses = run.forward_backward(forward_step_func=run.step, data_iterator=run.data_iterator, model=model,
                                  num_microbatches=args.num_microbatches,
                                  seq_length=args.micro_batch_size * args.seq_length, micro_batch_size=1,
                                  forward_only=False)
    progress.set_phase("optimizer step", iteration)
    if run.nan_check is not None:
        run.nan_check.raise_if_found(iteration)
    update_ok, grad_norm, _ = optimizer.step()
    if update_ok:
        run.scheduler.step(increment=args.global_batch_size)
    elif run.nan_check is not None:  # only fp16 loss scaling skips an update, and only on non-finite gradients
        raise RuntimeError(f"iteration {iteration}: optimizer step skipped (non-finite gradients)")
    loss = _reduce_loss(losses, run.device)
    elapsed = time.perf_counter() - t0
    sent = comm_stats().minus(before)
    cp_bytes = torch.tensor([sent.send_bytes_intra, sent.send_bytes_inter], dtype=torch.int64, device=run.device)
    dist.all_reduce(cp_bytes, op=dist.ReduceOp.MAX)
    return IterationRecord(iteration=iteration, loss=loss, lr=run.scheduler.get_lr(optimizer.param_groups[0]),
                           grad_norm=float("nan") if grad_norm is None else float(grad_norm),
                           tokens_per_s=args.global_batch_size * args.seq_length / elapsed,
                           elapsed_ms=1000 * elapsed, peak_memory_bytes=peak_memory_bytes(),
                           cp_bytes_intra=int(cp_bytes[0]), cp_bytes_inter=int(cp_bytes[1]),
                           cp_bytes_by_op=_bytes_by_op(sent.sent),
                           consumed_samples=iteration * args.global_batch_size,
                           global_batch_size=args.global_batch_size,
                           loss_scale=float(optimizer.get_loss_scale()), skipped=not update_ok,
                           tflops_per_gpu=(None if run.flops is None else
                                           run.flops / (elapsed * 1e12 * args.world_size)),
                           host_offload_bytes=HostOffload.total_offloaded_bytes - offloaded_before)


def _exit_reason(run: _TrainingRun, iteration: int, signals: Any, started: float) -> str:
    """Why all ranks stop after ``iteration`` (an exit signal, --exit-duration-in-mins, --exit-interval), or ""."""
    from megatron_hsap.training.preemption import exit_reason

    args = run.args
    check_exit = signals is not None or args.exit_duration_in_mins is not None
    reason = exit_reason(signals, started, args.exit_duration_in_mins, run.device) if check_exit else ""
    if args.exit_interval and iteration % args.exit_interval == 0:
        reason = reason or f"--exit-interval {args.exit_interval}"
    return reason


def _save(run: _TrainingRun, iteration: int) -> None:
    from megatron_hsap.training.checkpoint import save_checkpoint

    progress.set_phase("saving checkpoint", iteration)
    t_save = time.perf_counter()
    save_checkpoint(run.args.save, iteration, run.model, run.optimizer, run.scheduler, run.args)
    run.log.info(f"saved checkpoint at iteration {iteration} to {run.args.save} in "
                 f"{time.perf_counter() - t_save:.2f} s")


def _final_evaluations(run: _TrainingRun, iteration: int) -> None:
    """Megatron-LM's evaluations after the last iteration: the validation split's next, then the test split's."""
    args = run.args
    if run.valid_dataset is not None:
        _log_evaluation(run.evaluator, run.log, run.valid_dataset, "validation", args.train_iters // args.eval_interval,
                        f"iteration {iteration} on validation set", iteration, args, "final")
    if run.test_dataset is not None:
        _log_evaluation(run.evaluator, run.log, run.test_dataset, "test", 0, f"iteration {iteration} on test set",
                        iteration, args, "final")


def _plan_summary(args: argparse.Namespace, layout: str) -> PlanSummary:
    """The run's ``PlanSummary``, with one tensor-parallel rank's attention geometry."""
    tp = args.tensor_model_parallel_size
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    return PlanSummary(layout, args.num_attention_heads // tp, args.num_query_groups // tp,
                       args.hidden_size // args.num_attention_heads, dtype)


def _log_evaluation(evaluator: _Evaluator, log: IterationLogger, dataset: Any, split: str, index: int, prefix: str,
                    iteration: int, args: argparse.Namespace, kind: str) -> None:
    """One evaluation, labelled with its kind (``periodic`` or ``final``) and the split's global batches it read,
    so two evaluations at the same iteration never carry the same label."""
    progress.set_phase("evaluation", iteration)
    loss = evaluator.loss(dataset, index, f"{split} ")
    first = index * args.eval_iters
    log.evaluation(split, prefix, loss, iteration, iteration * args.global_batch_size,
                   detail=f"{kind} evaluation of {split} batches {first}-{first + args.eval_iters - 1}")
