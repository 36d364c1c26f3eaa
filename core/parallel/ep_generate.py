"""``inferhal generate`` over EP ranks: ``parallel=ep2`` spawns the ranks itself (``launcher=local``) or
runs as one rank under torchrun (``launcher=torchrun``); each rank builds the same engine, joins the
process group through the backend's communicator and becomes an EP rank (:func:`.ep_engine.attach_ep`),
or with ``parallel.dp = parallel.ep > 1`` (``parallel=dep2``) a DP attention × EP MoE rank
(:func:`.dp_engine.attach_dp`) behind the :class:`~.dp_engine.DPEngine` front end, which places the
job's prompts over the ranks. Rank 0 prints; the other ranks run silently. A rank that fails ends the
launch with its error.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Callable

from omegaconf import OmegaConf

from inferhal.core.backend import ParallelLayout
from inferhal.core.errors import UserError
from inferhal.core.parallel.dp_engine import DPEngine, DPRank, attach_dp
from inferhal.core.parallel.dp_graphs import check_graphs
from inferhal.core.parallel.ep_engine import EPRank, attach_ep, check_expert_slots
from inferhal.core.parallel.launch import check_layout, launch


def ep_llm(cfg: Any, layout: ParallelLayout) -> tuple[Any, EPRank]:
    """An :class:`~inferhal.core.engine.llm.LLM` from the composed ``cfg`` acting as rank ``layout.rank``."""
    from inferhal.core.engine.llm import LLM

    llm = LLM.from_config(cfg)
    comm = llm.engine.backend.communicator(layout)
    return llm, attach_ep(llm.engine, comm, cfg.eplb)


def dp_llm(cfg: Any, layout: ParallelLayout) -> tuple[Any, DPRank]:
    """An LLM acting as DP/EP rank ``layout.rank``: its ``engine`` is the :class:`DPEngine` front end over
    this rank's own engine (every rank must be handed the same prompts)."""
    from inferhal.core.engine.llm import LLM

    llm = LLM.from_config(cfg)
    hook = attach_dp(llm.engine, llm.engine.backend.communicator(layout), cfg.eplb, tbo=bool(cfg.parallel.tbo))
    llm.engine = DPEngine(llm.engine, hook)
    return llm, hook


def run_rank(layout: ParallelLayout, cfg_node: dict, body: Callable[[Any, Any, Any], int]) -> int:
    """One rank of ``inferhal generate``: ``body(cfg, llm, out)`` over this rank's engine (the CLI's generate;
    rank 0 writes to stdout, the others to nothing); returns its exit status."""
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // layout.world_size))  # ranks share this host's cores
    cfg = OmegaConf.create(cfg_node)
    dp = int(cfg.parallel.dp) > 1
    llm, hook = (dp_llm if dp else ep_llm)(cfg, layout)
    if layout.rank == 0:
        rc = body(cfg, llm, sys.stdout)
    else:
        with open(os.devnull, "w") as null, contextlib.redirect_stderr(null):  # no second progress display
            rc = body(cfg, llm, null)
    if dp:
        work = dp_work(hook)  # collective: every rank gets here (the front end ends the job on all at once)
        if layout.rank == 0:
            print(work, file=sys.stderr)
    return rc


def dp_work(hook: DPRank) -> str:
    """What each DP rank did over the job, counted (collective): a line for the user."""
    from inferhal.core.parallel.sync import gather_objects

    mine = (sum(s.attn_tokens for s in hook.log), sum(s.moe.a2a_bytes for s in hook.log), hook.step)
    got = gather_objects(hook.comm, mine)
    return (f"[dp{len(got)} ranks over {got[0][2]} steps: attention tokens {', '.join(str(g[0]) for g in got)} "
            f"(each rank its own requests); all-to-all bytes sent {', '.join(str(g[1]) for g in got)}]")


def _spawned_rank(layout: ParallelLayout, cfg_node: dict, body: Callable[[Any, Any, Any], int]) -> None:
    try:
        rc = run_rank(layout, cfg_node, body)
    except UserError as exc:
        print(f"inferhal: rank {layout.rank}: {exc}", file=sys.stderr)
        sys.exit(2)
    if rc:
        sys.exit(rc)


def check_ranks(cfg: Any, front: bool = False) -> int:
    """Every refusal a rank of any command would meet that can be known from the config alone, before any
    process starts or any weight loads: the layout (:func:`~.launch.check_layout`), the spec config, the
    backend's availability (probe only), whether the model has routed experts that divide among the EP ranks
    and, with DP attention, synchronous scheduling and no ``backend.options.ep_exchange=padded``. Returns the
    world size. ``front``: as :func:`~.launch.check_layout`'s."""
    from inferhal.core.config.schema import BackendConfig, SpecConfig
    from inferhal.core.models.registry import routed_experts
    from inferhal.core.registry import BackendRegistry
    from inferhal.core.spec.ngram import check_spec_config

    world = check_layout(cfg.parallel, front=front)
    check_spec_config(SpecConfig(**OmegaConf.to_container(cfg.spec, resolve=True)))
    BackendRegistry.discover().require(BackendConfig(**OmegaConf.to_container(cfg.backend, resolve=True)))
    experts = routed_experts(cfg.model)
    if experts == 0:
        raise UserError(f"model {cfg.model.name!r} (family {cfg.model.family}) is dense: parallel.ep={cfg.parallel.ep} "
                        f"needs a model with routed experts (e.g. model=deepseek_v4_tiny), or use parallel=single")
    if experts is not None:
        check_expert_slots(experts, cfg.eplb, world)
    check_graphs(bool(cfg.backend.graphs), bool(cfg.eplb.enabled))
    dp = int(cfg.parallel.dp)
    if dp > 1 and bool(cfg.scheduler.async_scheduling):
        raise UserError("scheduler.async_scheduling=true does not run with data-parallel attention "
                        f"(parallel.dp={dp}) yet; use scheduler.async_scheduling=false")
    exchange = (cfg.backend.get("options") or {}).get("ep_exchange")
    if dp > 1 and exchange == "padded":  # equal blocks of T x top_k rows: every rank must dispatch the same T
        raise UserError(f"backend.options.ep_exchange=padded does not run with data-parallel attention "
                        f"(parallel.dp={dp}): the DP ranks' eager steps dispatch different numbers of rows, and the "
                        f"padded exchange's equal-split all-to-all needs the same on every rank; leave "
                        f"backend.options.ep_exchange=auto under DP (auto pads inside captured graph steps only, "
                        f"where the ranks agree on one padded batch)")
    return world


def check_before_spawn(cfg: Any) -> int:
    """:func:`check_ranks`, and with DP attention whether the job gives every DP rank a prompt. Returns the
    world size."""
    world = check_ranks(cfg)
    dp = int(cfg.parallel.dp)
    if dp > 1:
        n = count_prompts(cfg)
        if n < dp:
            raise UserError(f"parallel.dp={dp} but the job has {n} prompt{'s' if n != 1 else ''}: {dp - n} DP "
                            f"rank{'s' if dp - n != 1 else ''} would get no request; pass at least {dp} prompts "
                            f"(prompts_file=x.jsonl) or use parallel.dp <= {n} (parallel=ep{dp} replicates "
                            f"attention instead)")
    return world


def count_prompts(cfg: Any) -> int:
    """Prompts a ``generate`` job gives the front end: one (``prompt``, ``prompt_ids``, ``messages``, or the
    default prompt), or the non-blank lines of ``prompts_file``."""
    path = cfg.get("prompts_file")
    if path is None:
        return 1
    try:
        with open(str(path)) as f:
            return sum(1 for ln in f if ln.strip())
    except OSError as exc:
        raise UserError(f"prompts_file={str(path)!r}: {exc.strerror}") from None


def generate_parallel(cfg: Any, body: Callable[[Any, Any, Any], int]) -> int:
    """Run ``inferhal generate`` on ``parallel.tp * parallel.ep`` ranks (with ``parallel.dp = parallel.ep``
    each a DP attention rank): ``body(cfg, llm, out)`` on each (a module-level function: spawned ranks get
    it by reference); the exit status of rank 0 (or of the first rank that failed). :func:`check_before_spawn`
    runs first."""
    check_before_spawn(cfg)
    node = OmegaConf.to_container(cfg, resolve=True)
    if str(cfg.parallel.launcher) == "torchrun" or "RANK" in os.environ:
        rcs: list[int] = []
        launch(lambda lay, c: rcs.append(run_rank(lay, c, body)), cfg.parallel, node)
        return rcs[0] if rcs else 0
    import torch.multiprocessing as mp

    try:
        launch(_spawned_rank, cfg.parallel, node, body)
    except mp.ProcessExitedException as exc:
        print(f"inferhal: EP rank {exc.error_index} exited with status {exc.exit_code}", file=sys.stderr)
        return int(exc.exit_code) if exc.exit_code and exc.exit_code > 0 else 1
    except mp.ProcessRaisedException as exc:
        raise UserError(f"EP rank {exc.error_index} failed:\n{exc}") from None
    return 0
