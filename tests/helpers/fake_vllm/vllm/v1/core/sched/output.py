"""As vLLM's: what the scheduler hands the model runner for one step."""

from vllm.entrypoints.cli.main import _Scheduled as SchedulerOutput

__all__ = ["SchedulerOutput"]
