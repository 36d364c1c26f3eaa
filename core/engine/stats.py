"""The engine's running totals (``Engine.stats``) and each step's timings (``Engine.last_step``)."""

from __future__ import annotations

from typing import Any


def new_stats() -> dict:
    return {"steps": 0, "schedule_s": 0.0, "prepare_s": 0.0, "model_s": 0.0, "sample_s": 0.0,
            "mask_s": 0.0,  # structured-output bitmasks: the part the step waited out, in sample_s
            "fill_s": 0.0,  # structured-output bitmasks filled on the side while the model ran
            "update_s": 0.0, "tokens": 0, "draft_tokens": 0, "accepted_tokens": 0,
            "drafted_at": [], "accepted_at": [],  # [i]: steps that verified / accepted draft i
            "device_busy_s": 0.0, "device_gap_s": 0.0}  # the runner's steps, the host time between them


def record_step(stats: dict, out: Any, res: Any, scheduler: Any, executor: Any, t0: float, t1: float, t2: float,
                t3: float) -> dict:
    """Add one step to ``stats`` (schedule ``t0..t1``, execute ``t1..t2``, update ``t2..t3``) → its own timings."""
    stats["steps"] += 1
    stats["schedule_s"] += t1 - t0
    for k in ("prepare_s", "model_s", "sample_s", "mask_s", "fill_s"):
        stats[k] += getattr(res, k)
    stats["update_s"] += t3 - t2
    stats["tokens"] += out.num_scheduled_tokens
    stats["draft_tokens"], stats["accepted_tokens"] = scheduler.num_draft_tokens, scheduler.num_accepted_tokens
    stats["drafted_at"], stats["accepted_at"] = list(scheduler.drafted_at), list(scheduler.accepted_at)
    stats["device_busy_s"], stats["device_gap_s"] = executor.busy_s, executor.gap_s
    return {"schedule_s": t1 - t0, "execute_s": t2 - t1, "prepare_s": res.prepare_s, "model_s": res.model_s,
            "sample_s": res.sample_s, "update_s": t3 - t2, "num_seqs": len(out.seqs),
            "num_tokens": out.num_scheduled_tokens}
