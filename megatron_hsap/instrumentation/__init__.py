"""Measurement that stays on: communication bytes (``comm``) and peak live memory (``memory``)."""

from megatron_hsap.instrumentation.comm import CommStats, comm_stats, count_comm, reset_comm_stats

__all__ = ["CommStats", "comm_stats", "count_comm", "reset_comm_stats"]
