"""The agent bench's workload: sessions generated from a seed, or read from a JSONL trace.

A **session** is a system prompt and a list of turns. Each turn sends the conversation so far plus one new
user message (the task at first, then a tool's result), waits for the model's answer, appends it as the
assistant message, and waits the turn's think time before the next one: the prompt of turn ``t + 1`` starts
with the whole of turn ``t``, so an engine with a prefix cache prefills only the new message.

**Generated** (``bench.agent.trace`` unset): one system prompt shared by every session, an agent's
instructions followed by the tool schemas as JSON text (the server takes no ``tools`` field yet), about
``bench.agent.system_words`` words; ``bench.agent.sessions`` sessions of ``bench.agent.turns`` turns, each
a task and then tool results (file reads, command output, search hits) of a length drawn from
``bench.agent.tool_result_words``, a ``max_tokens`` drawn from ``bench.agent.output_tokens`` and a think
time from ``bench.agent.think_s`` (each list: equally likely values). File contents come from a small
project of files fixed by the seed, so later turns read again what earlier turns (and other sessions) read,
as agents do. Everything is a function of ``seed``.

**Trace** (``bench.agent.trace=PATH``): JSON lines, one per turn, grouped by ``session`` in file order::

    {"session": "s1", "system": "You are ...", "content": "Fix the bug in ...", "max_tokens": 128}
    {"session": "s1", "content": "Tool result: ...", "max_tokens": 64, "think_s": 0.4, "answer": "..."}

``content`` and ``max_tokens`` are required; ``system`` (on a session's first line), ``think_s`` (default 0)
and ``answer`` (the recorded assistant message, appended instead of the model's own: an exact replay whose
prompts do not depend on the model) are optional. A bad line is an error naming its line number and field.

**Salt.** Every copy of a session a user replays starts its system prompt with its own salt line, so copies
running at the same time (or replayed later) share no KV (as SemiAnalysis AgentX salts each user): prefix
hits come from a session's own earlier turns only.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

from inferhal.core.errors import UserError

_WORDS = ("value", "result", "config", "index", "buffer", "request", "token", "batch", "cache", "layer", "step",
          "count", "limit", "error", "queue", "state", "model", "output", "input", "length", "offset", "block",
          "table", "entry", "record", "stream", "worker", "thread", "handle", "update", "check", "parse", "load",
          "write", "read", "merge", "split", "order", "group", "score", "range", "shape", "field", "path")
_TOOLS = (
    ("read_file", "Read a file of the repository.", {"path": "string", "start_line": "integer", "end_line": "integer"}),
    ("run_command", "Run a shell command in the repository and return its output.", {"command": "string",
                                                                                   "timeout_s": "number"}),
    ("search_code", "Search the repository for a regular expression.", {"pattern": "string", "glob": "string"}),
    ("edit_file", "Replace a span of a file with new text.", {"path": "string", "old": "string", "new": "string"}),
    ("list_dir", "List a directory.", {"path": "string"}),
)


@dataclass(frozen=True)
class Turn:
    content: str  # the new user message (the task, or a tool's result)
    max_tokens: int
    think_s: float = 0.0  # the user's wait after the answer, before the next turn
    answer: Optional[str] = None  # a recorded assistant message to append instead of the model's (traces)


@dataclass(frozen=True)
class Session:
    name: str
    system: str
    turns: tuple[Turn, ...] = field(default_factory=tuple)

    def salted(self, salt: str) -> "Session":
        """This session with ``salt`` as the first line of its system prompt (a copy sharing no prefix)."""
        return replace(self, system=f"Session {salt}.\n{self.system}")


def system_prompt(rng: random.Random, words: int) -> str:
    tools = [{"type": "function", "function": {"name": n, "description": d, "parameters": {
        "type": "object", "properties": {k: {"type": t} for k, t in p.items()}, "required": list(p)[:1]}}}
        for n, d, p in _TOOLS]
    head = ("You are a coding agent working in a software repository. Work in small steps: think, then call one "
            "tool by answering with a JSON object {\"tool\": NAME, \"arguments\": {...}}, read its result, and go "
            "on until the task is done; then answer with a short summary.\nTools:\n")
    text = head + "\n".join(json.dumps(t) for t in tools) + "\nRules:\n"
    i = 0
    while len(text.split()) < words:
        a, b, c = rng.sample(_WORDS, 3)
        i += 1
        text += f"{i}. Never {a} the {b} without a {c} check; keep every {a} {rng.choice(_WORDS)} small.\n"
    return text


def _project(rng: random.Random, n_files: int = 12) -> dict[str, list[str]]:
    """A small repository: path → source lines."""
    files = {}
    for f in range(n_files):
        mod = f"{rng.choice(_WORDS)}_{rng.choice(_WORDS)}"
        lines = [f"\"\"\"The {mod.replace('_', ' ')} module.\"\"\"", "", "import numpy as np", ""]
        for fn in range(rng.randint(4, 9)):
            a, b = rng.sample(_WORDS, 2)
            lines += [f"def {a}_{b}({b}, {a}=None):", f"    \"\"\"{a.title()} the {b}.\"\"\"",
                      f"    if {a} is None:", f"        {a} = {b}.{rng.choice(_WORDS)}",
                      f"    return {rng.choice(_WORDS)}({b}, {a})", ""]
        files[f"src/{mod}.py"] = lines
    return files


def _tool_result(rng: random.Random, project: dict[str, list[str]], words: int) -> str:
    kind = rng.choice(("read_file", "run_command", "search_code", "list_dir"))
    path = rng.choice(sorted(project))
    out: list[str] = []
    if kind == "read_file":
        lines, i = project[path], 0
        while sum(len(x.split()) for x in out) < words:
            out.append(f"{i + 1:4d}  {lines[i % len(lines)]}")
            i += 1
        return f"Tool result (read_file {path}):\n" + "\n".join(out)
    if kind == "search_code":
        while sum(len(x.split()) for x in out) < words:
            p = rng.choice(sorted(project))
            j = rng.randrange(len(project[p]))
            out.append(f"{p}:{j + 1}: {project[p][j]}")
        return f"Tool result (search_code {rng.choice(_WORDS)}):\n" + "\n".join(out)
    if kind == "list_dir":
        while sum(len(x.split()) for x in out) < words:
            out.append(f"{rng.choice(sorted(project))}  {rng.randint(100, 9999)} bytes")
        return "Tool result (list_dir src):\n" + "\n".join(out)
    while sum(len(x.split()) for x in out) < words:
        a, b = rng.sample(_WORDS, 2)
        out.append(f"test_{a}_{b} ... {'ok' if rng.random() < 0.8 else 'FAILED'} ({rng.randint(1, 900)} ms)")
    return f"Tool result (run_command pytest {path}):\n" + "\n".join(out)


def generate(seed: int, sessions: int, turns: int, system_words: int, tool_result_words: Sequence[int],
             output_tokens: Sequence[int], think_s: Sequence[float]) -> list[Session]:
    """``sessions`` sessions of ``turns`` turns (see the module docstring), a function of ``seed``."""
    rng = random.Random(seed)
    system = system_prompt(rng, system_words)
    project = _project(rng)
    out = []
    for s in range(sessions):
        path, (a, b) = rng.choice(sorted(project)), rng.sample(_WORDS, 2)
        task = (f"Task {s + 1}: the {a} {b} in {path} returns the wrong {rng.choice(_WORDS)} when the "
                f"{rng.choice(_WORDS)} is empty. Find the cause, fix it and run the tests.")
        ts = [Turn(task, rng.choice(list(output_tokens)), rng.choice(list(think_s)))]
        for _ in range(turns - 1):
            ts.append(Turn(_tool_result(rng, project, rng.choice(list(tool_result_words))),
                           rng.choice(list(output_tokens)), rng.choice(list(think_s))))
        out.append(Session(f"s{s + 1}", system, tuple(ts)))
    return out


def load_trace(path: str) -> list[Session]:
    """The sessions of a JSONL trace (see the module docstring); a bad line is a :class:`UserError`."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise UserError(f"bench.agent.trace: cannot read {path}: {exc.strerror or exc}") from None
    order: list[str] = []
    system: dict[str, str] = {}
    turns: dict[str, list[Turn]] = {}
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"bench.agent.trace {path} line {no}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(rec, dict):
            raise UserError(f"{where}: expected a JSON object")
        unknown = set(rec) - {"session", "system", "content", "max_tokens", "think_s", "answer"}
        if unknown:
            raise UserError(f"{where}: unknown field(s) {sorted(unknown)}")
        name, content, max_tokens = rec.get("session"), rec.get("content"), rec.get("max_tokens")
        if not isinstance(name, str) or not name:
            raise UserError(f"{where}: 'session' must be a non-empty string")
        if not isinstance(content, str) or not content:
            raise UserError(f"{where}: 'content' must be a non-empty string")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise UserError(f"{where}: 'max_tokens' must be an integer >= 1")
        think = rec.get("think_s", 0.0)
        if not isinstance(think, (int, float)) or isinstance(think, bool) or think < 0:
            raise UserError(f"{where}: 'think_s' must be a number >= 0")
        for key in ("system", "answer"):
            if key in rec and not isinstance(rec[key], str):
                raise UserError(f"{where}: '{key}' must be a string")
        if name not in turns:
            order.append(name)
            turns[name] = []
            system[name] = rec.get("system", "")
        elif "system" in rec:
            raise UserError(f"{where}: 'system' only on a session's first line")
        turns[name].append(Turn(content, max_tokens, float(think), rec.get("answer")))
    if not order:
        raise UserError(f"bench.agent.trace: {path} holds no turns")
    return [Session(n, system[n], tuple(turns[n])) for n in order]
