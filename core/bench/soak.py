"""``inferhal bench soak``: a bounded, self-stopping load of ``bench.soak.requests`` mixed requests against one
server, then what it left behind.

The server is ``inferhal serve`` with this run's config, started in a child process on a free loopback port
(as ``bench serve`` starts it; add ``spec=ngram`` for drafts), or the one at ``bench.url``.
``bench.soak.concurrency`` clients send the seeded plan of :mod:`.soak_traffic` (chat and completions and
Anthropic's messages, streamed and not, ``n`` = 2, JSON-schema outputs, long and short prompts sharing
prefixes; clients hanging up before the first token, mid-stream and in a long prefill, some sending the same
body again at once). Measured and checked:

- every request's outcome (:class:`~.soak_client.Result`): completed, hung up on purpose, or failed by
  reason (an HTTP status, a stream error, a truncated stream, a timeout, a dropped connection);
- greedy outputs that differ from the offline engine's (``LLM.generate`` on the same config, before the
  server starts): must be 0; a JSON-schema output that ends by itself must parse;
- after the load: requests running and waiting, KV blocks in use and requests holding blocks, from
  ``/metrics`` once the server is idle: must all be 0, and ``/health`` ok;
- the server process's RSS and open file descriptors every ``bench.soak.sample_s`` (psutil; not for a
  ``bench.url`` server on another host): after the first ``bench.soak.warmup`` of the run, growth at most
  ``bench.soak.max_growth`` (the median of the last tenth of the samples over the median of the first tenth
  after the warm-up: medians, so one request's buffers in flight do not count);
- end-to-end latency of completed requests and TTFT of completed streams, p50 and p99.

JSON to ``output=`` (default ``<bench.output_dir>/soak.json``), ``soak.png`` beside it (RSS and fds over time,
stamped with commit, host and date), a table readable when piped. Exit 1 when a check fails.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections import Counter
from typing import Any, Optional

from omegaconf import OmegaConf

from inferhal.core import procs
from inferhal.core.bench import write_json
from inferhal.core.bench.agent import _stamp
from inferhal.core.bench.agent_report import pct
from inferhal.core.bench.serve import _free_port, _get, _metric, _serve_child
from inferhal.core.bench.soak_client import Result, send
from inferhal.core.bench.soak_traffic import Job, plan, references
from inferhal.core.errors import UserError

#: the gauges read once the server is idle: each must be 0
END_GAUGES = ("num_requests_running", "num_requests_waiting", "kv_blocks_in_use", "kv_requests")


def check(s: Any) -> None:
    for name in ("requests", "concurrency"):
        if int(s[name]) < 1:
            raise UserError(f"bench.soak.{name} must be >= 1; got {s[name]}")
    for name in ("disconnect", "resend", "warmup", "max_growth"):
        if not 0.0 <= float(s[name]) <= 1.0:
            raise UserError(f"bench.soak.{name} is a share in [0, 1]; got {s[name]}")
    for name in ("sample_s", "timeout_s"):
        if float(s[name]) <= 0:
            raise UserError(f"bench.soak.{name} must be > 0; got {s[name]}")


class Sampler(threading.Thread):
    """The server process's RSS (bytes) and open fds every ``every`` seconds: ``samples`` of (t, rss, fds)."""

    def __init__(self, pid: int, every: float) -> None:
        import psutil

        super().__init__(daemon=True, name="inferhal-soak-sampler")
        self.proc, self.every = psutil.Process(pid), every
        self.samples: list[tuple[float, int, int]] = []
        self.halt = threading.Event()
        self.t0 = time.perf_counter()

    def run(self) -> None:
        self.t0 = time.perf_counter()
        while not self.halt.is_set():
            try:
                self.samples.append((time.perf_counter() - self.t0, self.proc.memory_info().rss, self.proc.num_fds()))
            except Exception:  # noqa: BLE001 - the process ended
                return
            self.halt.wait(self.every)


def growth(samples: list[tuple[float, int, int]], warmup: float, end: float) -> dict[str, Optional[float]]:
    """RSS and fds growth between the warm-up and ``end`` (when the plan ran out: the clients then leave one by one,
    their connections with them), as the module docstring says; None with fewer than 10 samples."""
    after = [s for s in samples if warmup * end <= s[0] <= end]
    k = max(1, len(after) // 10)
    out: dict[str, Optional[float]] = {"samples_after_warmup": len(after)}
    for col, name in ((1, "rss"), (2, "fds")):
        if len(after) < 10:
            out[name] = None
            continue
        first, last = pct([s[col] for s in after[:k]], 50), pct([s[col] for s in after[-k:]], 50)
        out[name] = last / first - 1.0 if first else None
    return out


async def load(host: str, port: int, jobs: list[Job], concurrency: int, timeout_s: float,
               progress=lambda done: None) -> tuple[list, float]:
    """Run the plan with ``concurrency`` clients → ([(job, Result, is_resend)], when the last job was taken:
    ``time.perf_counter()``, from which the load winds down); ``progress(requests done)`` after each."""
    todo, out, ran_out = list(jobs), [], [0.0]

    async def client():
        while todo:
            job = todo.pop(0)
            if not todo:
                ran_out[0] = time.perf_counter()
            res = await send(host, port, job.path, job.body, job.hang, timeout_s)
            out.append((job, res, False))
            progress(len(out))
            if job.resend:
                out.append((job, await send(host, port, job.path, job.body, None, timeout_s), True))
                progress(len(out))

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return out, ran_out[0] or time.perf_counter()


def judge(results: list, refs: dict) -> dict:
    """Outcomes by kind, failures by reason, greedy mismatches and latencies of the completed requests."""
    by_kind: dict[str, Counter] = {}
    failures, mismatches, bad_json, e2e, ttft = Counter(), [], 0, [], []
    for job, res, resent in results:
        by_kind.setdefault(job.kind, Counter())[res.outcome] += 1
        if res.outcome == "hung_up":
            continue
        if res.outcome != "ok":
            failures[res.outcome] += 1
            continue
        e2e.append(res.end - res.start)
        if job.body.get("stream") and res.first is not None:
            ttft.append(res.first - res.start)
        n = int(job.body.get("n", 1))
        if sorted(res.texts) != list(range(n)) or len(res.finish) != n:
            failures["missing_choices"] += 1
        elif job.ref is not None and res.texts[0] != refs[job.ref]:
            mismatches.append({"kind": job.kind, "ref": list(job.ref), "resent": resent, "got": res.texts[0][:200],
                               "want": refs[job.ref][:200]})
        if job.kind == "structured" and res.finish.get(0) == "stop":
            try:
                json.loads(res.texts.get(0, ""))
            except ValueError:
                bad_json += 1
    return {"by_kind": {k: dict(v) for k, v in sorted(by_kind.items())}, "failures": dict(failures),
            "mismatches": len(mismatches), "mismatch_examples": mismatches[:5], "bad_json": bad_json,
            "completed": len(e2e), "e2e_s": {"p50": pct(e2e, 50), "p99": pct(e2e, 99)},
            "ttft_s": {"p50": pct(ttft, 50), "p99": pct(ttft, 99)}}


def end_state(base: str, timeout_s: float = 60.0) -> dict:
    """The gauges once the server reports nothing running or waiting (or at ``timeout_s``), and /health."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = _get(base + "/metrics")[1]
        got = {k: _metric(text, f"inferhal_{k}") for k in END_GAUGES}
        if all(v == 0 for v in got.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    got["kv_cache_usage_ratio"] = _metric(text, "inferhal_kv_cache_usage_ratio")
    got["health"] = _get(base + "/health")[0]
    return got


def counters(base: str) -> dict:
    """What the server's counters say the run exercised (informative, not checked)."""
    text = _get(base + "/metrics")[1]
    return {k: _metric(text, f"inferhal_{k}_total") for k in (
        "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens", "num_preemptions",
        "prefix_cache_queries", "prefix_cache_hits", "generation_tokens")}


def run(cfg) -> int:
    from inferhal.core.bench.soak_report import plot, report
    from inferhal.core.console import console
    from inferhal.core.engine.llm import LLM

    con = console(min_width=120)
    b, s = cfg.bench, cfg.bench.soak
    check(s)
    conc, n = int(s.concurrency), int(s.requests)
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    for path, least in (("scheduler.max_num_seqs", 2 * conc), ("server.max_queued_requests", 4 * conc)):
        OmegaConf.update(cfg, path, max(int(OmegaConf.select(cfg, path)), least), merge=False)
    model = str(cfg.server.served_model_name or cfg.model.name)
    jobs = plan(n, model, int(b.max_tokens), float(s.disconnect), float(s.resend), int(s.seed))
    con.print(f"[bench soak] {n} requests ({len(jobs)} planned bodies) at concurrency {conc} against "
              f"{b.url or 'inferhal serve ' + model + ' (spec=' + str(cfg.spec.method) + ')'}; offline references first",
              highlight=False)
    llm = LLM.from_config(cfg)
    refs = references(llm, jobs)
    del llm
    proc, base = None, str(b.url).rstrip("/") if b.url else None
    if base is None:

        port = _free_port()
        proc = procs.context().Process(target=_serve_child, args=(cfg, port), daemon=False)
        proc.start()
        base = f"http://127.0.0.1:{port}"
    host, port = base.split("//", 1)[1].rsplit(":", 1)
    deadline = time.monotonic() + 600
    while _get(base + "/health")[0] != 200:
        if (proc is not None and not proc.is_alive()) or time.monotonic() > deadline:
            con.print(f"[bench soak] the server at {base} did not come up", highlight=False)
            if proc is not None:
                proc.kill()
            return 1
        time.sleep(0.2)
    sampler = Sampler(proc.pid, float(s.sample_s)) if proc is not None else None
    try:
        if sampler is not None:
            sampler.start()
        t0 = time.perf_counter()
        every = max(1, n // 10)

        def progress(k: int) -> None:
            if k % every == 0:
                con.print(f"  {k} / {n} requests in {time.perf_counter() - t0:.0f} s", highlight=False)

        results, ran_out = asyncio.run(load(host, int(port), jobs, conc, float(s.timeout_s), progress))
        wall = time.perf_counter() - t0
        end = end_state(base)
        exercised = counters(base)
        if sampler is not None:
            sampler.halt.set()
            sampler.join(5)
    finally:
        if proc is not None:
            proc.terminate()  # SIGTERM: the drain; nothing is open
            proc.join(120)
    verdict = judge(results, refs)
    samples = sampler.samples if sampler is not None else []
    load_end = ran_out - sampler.t0 if sampler is not None else 0.0
    grew = {**growth(samples, float(s.warmup), load_end), "load_end_s": load_end}
    payload = {"model": model, "backend": str(cfg.backend.name), "spec": str(cfg.spec.method), "stamp": _stamp(),
               "requests": len(results), "concurrency": conc, "wall_s": wall, "requests_per_s": len(results) / wall,
               "settings": OmegaConf.to_container(s), "max_tokens": int(b.max_tokens), **verdict, "end_state": end, "counters": exercised,
               "growth": grew, "server_exit": proc.exitcode if proc is not None else None,
               "samples": [[round(t, 2), rss, fds] for t, rss, fds in samples[:: max(1, len(samples) // 2000)]],
               "note": "clients and server on one shared host"}
    payload["failed_checks"] = failed = report(payload, float(s.max_growth), con)
    out = write_json(cfg, "soak.json", payload)
    png = os.path.splitext(out)[0] + ".png"
    if samples:
        plot(payload, png)
    con.print(f"wrote {out}" + (f" and {png}" if samples else ""), highlight=False)
    return 1 if failed else 0
