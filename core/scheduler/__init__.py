"""Continuous batching: requests in, :class:`~inferhal.core.scheduler.output.SchedulerOutput` out."""
