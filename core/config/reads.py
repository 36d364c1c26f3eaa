"""What each command reads: the one table that decides which config fields a command honours.

Every command (``inferhal COMMAND [SUBCOMMAND]``, and ``LLM(...)`` for the Python API) declares the config
groups and fields its code path reads (:data:`READS`). A field outside that set which the user set away from
the default composition is refused at compose (:func:`inferhal.core.cli.main.compose`, exit status 2), naming
the field, the command and the commands that do read it: a field that parses and then does nothing is a lie
(STYLE 13).

*What the user set* is decided by comparison, not by override keys: the composed config is compared, field by
field, with the default composition (``conf/config.yaml`` with no overrides). So ``key=value``, ``+key``, a
group choice (``server=NAME``, ``parallel=dep2``), an experiment file and the Python API's keyword options
all count, each by the fields it changes; and a value equal to the default (``server.port=8000``) or a
group's YAML default (the ``eplb: disabled`` choice of ``conf/config.yaml``) changes nothing and is never
refused. Free-form mappings (``model.arch``, ``backend.options``) and lists compare as whole values.

An entry is a group (``"scheduler"``: every field in it), a field (``"cache.block_size"``) or ``"*"``
(everything: ``inferhal config`` only shows the config). :data:`SETS` names fields inside a read group that a
command overwrites itself (the user's value would not reach the run); :data:`WHY` and :data:`HINTS` keep
what the refusal message should say beyond "not read". A command whose words are not in the table (``bench
nope``) is left to the command, which refuses its own words.
"""

from __future__ import annotations

import dataclasses
import typing
import functools
from typing import Any, Iterable

#: what LLM.from_config builds an engine from (deterministic apart: not every command that builds one honours it)
ENGINE = ("model", "backend", "scheduler", "cache", "spec", "seed")
#: the parallel fields a generate job over EP/DP ranks reads (core/parallel/ep_generate.py, launch.py)
RANKS = ("parallel.ep", "parallel.dp", "parallel.launcher", "parallel.master_addr", "parallel.master_port",
         "parallel.timeout_s", "parallel.tbo")
#: the model fields the planner reads (core/plan/inventory.py, kv.py: sizes from the config, no weights)
PLANNED_MODEL = ("model.name", "model.family", "model.format", "model.path", "model.package", "model.dtype",
                 "model.max_model_len", "model.allow_long_context", "model.arch")
#: where every benchmark writes: output= or a file under bench.output_dir (core/bench/__init__.py: write_json)
BENCH_OUT = ("output", "bench.output_dir")


def _bench(*fields: str) -> tuple[str, ...]:
    return (*BENCH_OUT, *(f"bench.{f}" for f in fields))


#: command words → the groups and fields its code path reads (besides ``command`` and ``log_level``, which every
#: command reads). Keep each entry next to the code it summarises when that code changes.
READS: dict[str, tuple[str, ...]] = {
    "config": ("*",),  # prints the composed config: it shows every field
    "backends": ("backend",),  # cmd_backends: the selected backend's config decides how its probe runs
    "kernels compile": ("target", "output"),  # every backend's aot_compiler extra; no backend is selected
    "generate": (*ENGINE, "deterministic", "sampling", "prompt", "prompt_ids", "messages", "prompts_file", "output",
                 "eplb", *RANKS),  # core/cli/generate.py, core/parallel/ep_generate.py
    "serve": (*ENGINE, "deterministic", "server", "disagg", "parallel.role", "parallel.timeout_s",  # server/serve.py
              *RANKS, "parallel.dp_balance", "parallel.dp_balance_margin", "parallel.restarts", "parallel.front",
              "parallel.start_timeout_s", "eplb"),  # dp_serve, dp_link
    "qualify": ("backend", "qualify"),  # cmd_qualify, core/qualify/ (golden and audits run their own tiny models)
    "plan": (*PLANNED_MODEL, "parallel.tp", "parallel.dp", "parallel.ep", "plan", "cache.kv_dtype",
             "scheduler.max_num_batched_tokens", "output"),  # core/plan/deploy.py
    "plan kv": (*PLANNED_MODEL, "cache.block_size", "cache.kv_cache_bytes", "cache.kv_dtype", "scheduler.max_num_seqs",
                "scheduler.max_num_batched_tokens", "output"),  # plan.kv.plan_kv
    "plan devices": ("output",),  # every catalogued device
    "plan calibrate": ("output",),  # core/plan/anchors.yaml holds each anchor's own config
    # core/bench/<kind>.py run(cfg)
    "bench cpu_linear": ("backend.name", *_bench("concurrency", "repeats")),
    "bench deterministic": ("model", "backend.name",  # its two engines from this model config, the mode set by it
                            *_bench("concurrency", "max_tokens", "warmup", "repeats")),
    "bench disagg": ("model", "backend", "scheduler", "cache", *_bench("num_prompts", "max_tokens", "repeats")),
    "bench e2e": (*ENGINE, "deterministic", *_bench("concurrency", "num_prompts", "max_tokens", "warmup", "repeats",
                                                    "peers")),
    "bench engine": ("backend", "cache.block_size",  # its model is deepseek_v4_tiny, its engines sized per section
                     *_bench("concurrency", "num_prompts", "max_tokens", "warmup", "repeats")),
    "bench ep": (*ENGINE, *_bench("num_prompts", "max_tokens", "warmup", "repeats")),  # its own dep1/2/4 layouts
    "bench eplb": ("seed", *_bench("repeats", "peers")),  # synthetic loads at V4 sizes, no model
    "bench eplb_live": (*ENGINE, "eplb.policy", "eplb.drift", "eplb.num_groups", "eplb.num_nodes",
                        *_bench("num_prompts", "max_tokens", "warmup", "repeats")),  # its own dep2 and EPLB cadence
    "bench greedy_head": (*ENGINE, *_bench("concurrency", "max_tokens", "repeats")),
    "bench kv_capacity": ("cache.kv_cache_bytes", "scheduler.max_num_seqs", "scheduler.max_num_batched_tokens",
                          *BENCH_OUT),  # its own models and contexts
    "bench kv_tiers": (*ENGINE, "deterministic",  # cache.*tier*/retain_windows size its variants (kv_tiers.py)
                       *_bench("max_tokens", "warmup", "repeats", "kv_tiers")),
    "bench kv_fidelity": ("backend.name", *_bench("max_tokens", "repeats")),  # its own tiny V4 variants
    "bench ops": (*ENGINE, *_bench("concurrency", "num_prompts", "max_tokens", "warmup", "repeats")),
    "bench agent": (*ENGINE, "deterministic", "server.served_model_name", "server.max_body_bytes",
                    "server.max_queued_requests", "server.max_queued_tokens", "server.request_timeout_s",
                    "server.shutdown_timeout_s", "server.reasoning_parser",  # each inferhal serve child's
                    *_bench("concurrency", "warmup", "repeats", "url", "peers", "agent")),  # core/bench/agent.py
    "bench serve": (*ENGINE, "deterministic", "server.served_model_name", "server.max_body_bytes",
                    "server.max_queued_requests", "server.max_queued_tokens", "server.request_timeout_s",
                    "server.shutdown_timeout_s", "server.reasoning_parser",  # its server child's (serve(cfg))
                    *_bench("concurrency", "num_prompts", "max_tokens", "warmup"),
                    *RANKS, "parallel.dp_balance", "parallel.dp_balance_margin", "parallel.restarts"),  # serve_dp.py
    "bench soak": (*ENGINE, "deterministic", "server.served_model_name", "server.max_body_bytes",
                   "server.max_queued_requests", "server.max_queued_tokens", "server.request_timeout_s",
                   "server.shutdown_timeout_s", "server.reasoning_parser",  # its server child's, as bench serve's
                   *_bench("soak", "max_tokens", "url")),  # core/bench/soak.py
    "bench spec": ("backend", *_bench("num_prompts", "max_tokens", "warmup", "repeats")),  # deepseek_v4_tiny_mtp
    "bench structured": ("model", "backend.name", *_bench("max_tokens")),  # LLM.from_config(cfg)
    # the Python API: LLM(...) composes as this command (core/engine/llm.py); one process, no prompts of its own
    "LLM": (*ENGINE, "deterministic"),
}

#: command → fields inside a group it reads that it sets itself: field → what it sets (a user's value is refused)
SETS: dict[str, dict[str, str]] = {
    "bench kv_tiers": {f"cache.{f}": "its pools: cache.num_blocks, else cache.kv_cache_bytes, else "
                                     "bench.kv_tiers.pool_sessions" for f in ("memory_fraction", "auto_kv_cap_bytes")},
    "bench e2e": {"scheduler.max_num_seqs": "the largest bench.concurrency level",
                  "cache.enable_prefix_caching": "false: every repeat prefills every prompt, as the peers do"},
    "bench ops": {"cache.enable_prefix_caching": "false: the runs repeat their prompts, each must prefill them all"},
    "bench serve": {"parallel.dp_balance": "with parallel.dp > 1 it runs every policy in turn (core/bench/serve_dp.py)"},
}

#: field → why few commands read it (the refusal message says it after naming the commands that do)
WHY: dict[str, str] = {
    "parallel.tp": "tensor parallelism is not implemented; the planner sizes TP layouts the engine cannot run yet",
    "parallel.dp": "data-parallel attention x EP MoE runs over spawned or torchrun ranks (core/parallel/dp_engine.py)",
    "parallel.ep": "expert parallelism runs over spawned or torchrun ranks, one engine per rank",
    "parallel.role": "prefill/decode disaggregation (pd: one launch; prefill | decode | router: separate launches, "
                     "core/disagg)",
    "deterministic": "the others build their engine or backend without the mode",
}

#: (command, field) → a pointer for that command's users
_ONE_PROCESS = ("LLM(...) is one process: `inferhal generate parallel=...` spawns the ranks (or, on each rank, "
                "inferhal.core.parallel.ep_generate.ep_llm / dp_llm)")
HINTS: dict[tuple[str, str], str] = {
    ("qualify", "output"): "qualify writes its report under qualify.output_dir",
    ("bench serve", "server.api_key"): "its clients send no key",
    ("LLM", "parallel.ep"): _ONE_PROCESS,
    ("LLM", "parallel.dp"): _ONE_PROCESS,
}

#: read by every command: the command words themselves and the log level (core/cli/main.py: dispatch)
ALWAYS = ("command", "log_level")


@functools.lru_cache(maxsize=None)
def leaves(root: Any = None, prefix: str = "") -> tuple[str, ...]:
    """Dotted paths of every field of the schema (``root``: a dataclass, default the root config), descending
    into nested config dataclasses; mappings and lists are leaves."""
    if root is None:
        from inferhal.core.config.schema import InferhalConfig

        root = InferhalConfig
    hints = typing.get_type_hints(root)
    out: list[str] = []
    for f in dataclasses.fields(root):
        kind = hints[f.name]
        out += leaves(kind, f"{prefix}{f.name}.") if dataclasses.is_dataclass(kind) else [prefix + f.name]
    return tuple(out)


def covers(entries: Iterable[str], path: str) -> bool:
    return any(e == "*" or path == e or path.startswith(e + ".") for e in entries)


def reads(command: str, path: str) -> bool:
    """Whether ``command`` honours a value the user gives ``path`` (False also for a field it sets itself)."""
    entries = READS[command]
    return (covers(entries, path) or path in ALWAYS) and path not in SETS.get(command, {})


def readers(path: str, but: str = "") -> list[str]:
    """The commands other than ``config`` (and ``but``) that read ``path``, in table order."""
    return [c for c in READS if c not in ("config", but) and reads(c, path)]


def who(command: str) -> str:
    return "LLM(...)" if command == "LLM" else f"`inferhal {command}`"


def _names(commands: list[str]) -> str:
    """``generate, plan, bench e2e, ops``: a command all of whose subcommands are listed by its name alone, the
    listed subcommands of the others after their command's name (once, when they all have words)."""
    groups: dict[str, list[str]] = {}
    for c in commands:
        head, _, rest = c.partition(" ")
        groups.setdefault(head, []).append(rest)
    out = []
    for head, rests in groups.items():
        every = [c.partition(" ")[2] for c in READS if c.partition(" ")[0] == head]
        name = "LLM(...)" if head == "LLM" else head
        if rests == every:
            out.append(name)
        elif all(rests):  # bench e2e, ops
            out.append(f"{name} {', '.join(rests)}")
        else:
            out += [f"{name} {r}".strip() for r in rests]
    return ", ".join(out) or "no command"


def _show(value: Any) -> str:
    text = str(value).lower() if isinstance(value, bool) else repr(value)  # as an override writes it
    return text if len(text) <= 60 else text[:57] + "..."


_MISSING = object()


def _at(tree: Any, path: str) -> Any:
    for part in path.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return _MISSING
        tree = tree[part]
    return tree


def changed(cfg: Any, defaults: Any) -> dict[str, Any]:
    """``path → value`` of every schema field whose value in ``cfg`` differs from ``defaults`` (the composition
    without the user's overrides)."""
    from omegaconf import OmegaConf

    now, then = (OmegaConf.to_container(c, resolve=True, throw_on_missing=False) for c in (cfg, defaults))
    return {p: _at(now, p) for p in leaves() if p != "command" and _at(now, p) != _at(then, p)}


def unread(cfg: Any, defaults: Any, command: str) -> list[tuple[str, str]]:
    """``(path, message)`` for each field the user set that ``command`` does not read (none for a command the
    table does not name: its own words are refused when it runs). Several fields of a group the command reads
    nothing of (a group choice such as ``model=NAME``) make one message naming each (``path``: their paths,
    joined by ", ")."""
    if command not in READS:
        return []
    found = {p: v for p, v in changed(cfg, defaults).items() if not reads(command, p)}
    out = []
    for group in dict.fromkeys(p.split(".")[0] for p in found):
        paths = [p for p in found if p.split(".")[0] == group]
        if len(paths) > 1 and not any(reads(command, leaf) for leaf in leaves() if leaf.startswith(group + ".")):
            others = [c for c in READS if c not in ("config", command)
                      and any(reads(c, leaf) for leaf in leaves() if leaf.startswith(group + "."))]
            values = ", ".join(f"{p}={_show(found[p])}" for p in paths)
            hints = "".join(dict.fromkeys(f"; {HINTS[command, p]}" for p in paths if (command, p) in HINTS))
            out.append((", ".join(paths), f"{values} are refused by {who(command)}, which reads no {group} field "
                                          f"({_names(others)} {'reads' if len(others) == 1 else 'read'} them){hints}"))
            continue
        out += [(p, _one(command, p, found[p])) for p in paths]
    return out


def _one(command: str, path: str, value: Any) -> str:
    sets = SETS.get(command, {}).get(path)
    if sets is not None:
        msg = f"{path}={_show(value)} is refused by {who(command)}, which sets it itself ({sets})"
    else:
        others = readers(path, command)
        msg = (f"{path}={_show(value)} is refused by {who(command)}, which does not read it "
               f"({_names(others)} {'reads' if len(others) == 1 else 'read'} it)")
        if path in WHY:
            msg += f": {WHY[path]}"
    if (command, path) in HINTS:
        msg += f"; {HINTS[command, path]}"
    return msg
