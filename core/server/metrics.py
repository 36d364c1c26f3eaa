"""The server's Prometheus metrics (``GET /metrics``), one registry per server.

Latencies (histograms, seconds): ``inferhal_time_to_first_token_seconds``,
``inferhal_inter_token_latency_seconds`` (between a request's consecutive outputs, per token),
``inferhal_time_per_output_token_seconds`` (per finished request: decode time / (tokens - 1)),
``inferhal_e2e_request_latency_seconds``.
Engine state (gauges): ``inferhal_num_requests_running``, ``inferhal_num_requests_waiting``,
``inferhal_kv_cache_usage_ratio`` (the fullest KV pool), ``inferhal_kv_blocks_in_use`` (blocks held by requests,
every pool; prefix-cached blocks no request holds are free), ``inferhal_kv_requests`` (requests holding blocks),
``inferhal_prefix_cache_hit_rate``
(cached / queried prompt tokens since start).
Counters: ``inferhal_prompt_tokens_total``, ``inferhal_generation_tokens_total``,
``inferhal_prefix_cache_queries_total`` / ``inferhal_prefix_cache_hits_total`` (prompt tokens),
``inferhal_num_preemptions_total``, ``inferhal_spec_decode_num_draft_tokens_total`` /
``inferhal_spec_decode_num_accepted_tokens_total``, ``inferhal_request_success_total{finished_reason}``
(stop | length | abort | timeout: the request's deadline).
KV tiers (``cache.host_tier_bytes``, ``cache.disk_tier_dir``; label ``tier``: host | disk): gauges
``inferhal_kv_tier_blocks`` / ``inferhal_kv_tier_bytes`` (held now), counters ``inferhal_kv_tier_hits_total`` /
``inferhal_kv_tier_hit_bytes_total`` (blocks restored into the pool from the tier, every KV group),
``inferhal_kv_tier_failures_total`` (tier files that failed a check or could not be written) and
``inferhal_kv_tier_saved_bytes_total`` (bytes copied down from the pool); ``inferhal_kv_tier_restore_seconds_total``
(time bringing blocks back: taking them from a tier, a file read and check for the disk tier, and writing them into
the pool) and ``inferhal_kv_tier_save_seconds_total`` (the step thread's time in saves: handing them to the copy
worker, or running those it had to); gauge ``inferhal_kv_tier_pending_stores`` (pool blocks whose save to a tier has
not finished: pinned, not free) and counter ``inferhal_kv_tier_store_wait_seconds_total`` (time allocations and steps
waited for saves to finish: a pool with no other free block).

Everything but the request counters is written by the engine thread; prometheus_client is thread-safe.
"""

from __future__ import annotations

from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        lab = ["model_name"]

        def h(name, doc, buckets=_LATENCY):
            return Histogram(name, doc, lab, buckets=buckets, registry=r).labels(model_name)

        def g(name, doc):
            return Gauge(name, doc, lab, registry=r).labels(model_name)

        def c(name, doc):
            return Counter(name, doc, lab, registry=r).labels(model_name)

        self.ttft = h("inferhal_time_to_first_token_seconds", "Time from arrival to a request's first token")
        self.itl = h("inferhal_inter_token_latency_seconds", "Time between a request's consecutive tokens")
        self.tpot = h("inferhal_time_per_output_token_seconds", "Decode time per output token of a finished request")
        self.e2e = h("inferhal_e2e_request_latency_seconds", "Time from arrival to a request's end")
        self.running = g("inferhal_num_requests_running", "Requests in the running batch")
        self.waiting = g("inferhal_num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_usage = g("inferhal_kv_cache_usage_ratio", "Fraction of KV blocks in use (the fullest pool)")
        self.kv_blocks = g("inferhal_kv_blocks_in_use", "KV blocks held by requests, every pool")
        self.kv_requests = g("inferhal_kv_requests", "Requests holding KV blocks")
        self.hit_rate = g("inferhal_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / queried")
        self.prompt_tokens = c("inferhal_prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = c("inferhal_generation_tokens", "Tokens generated")
        self.pc_queries = c("inferhal_prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.pc_hits = c("inferhal_prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.preemptions = c("inferhal_num_preemptions", "Requests preempted (recomputed later)")
        self.drafts = c("inferhal_spec_decode_num_draft_tokens", "Speculative draft tokens verified")
        self.accepted = c("inferhal_spec_decode_num_accepted_tokens", "Speculative draft tokens accepted")
        self._success = Counter("inferhal_request_success", "Finished requests by finish reason",
                                ["model_name", "finished_reason"], registry=r)
        self._model = model_name
        for reason in ("stop", "length", "abort", "timeout"):
            self._success.labels(model_name, reason)
        self._seen = {"pre": 0, "draft": 0, "acc": 0}
        tl = ["model_name", "tier"]
        self.tier_blocks = Gauge("inferhal_kv_tier_blocks", "KV blocks held by a tier", tl, registry=r)
        self.tier_bytes = Gauge("inferhal_kv_tier_bytes", "Bytes held by a KV tier", tl, registry=r)
        self.tier_hits = Counter("inferhal_kv_tier_hits", "KV blocks restored from a tier", tl, registry=r)
        self.tier_hit_bytes = Counter("inferhal_kv_tier_hit_bytes", "Bytes restored from a KV tier", tl, registry=r)
        self.tier_failures = Counter("inferhal_kv_tier_failures", "KV tier files unusable or unwritten", tl, registry=r)
        self.tier_saved = c("inferhal_kv_tier_saved_bytes", "Bytes copied from the KV pool to its tiers")
        self.tier_restore_s = c("inferhal_kv_tier_restore_seconds", "Seconds bringing KV blocks back from the tiers")
        self.tier_save_s = c("inferhal_kv_tier_save_seconds", "Step-thread seconds in KV saves to the tiers")
        self.tier_pending = g("inferhal_kv_tier_pending_stores", "KV blocks whose save to a tier has not finished")
        self.tier_wait_s = c("inferhal_kv_tier_store_wait_seconds", "Seconds allocations waited for KV tier saves")
        self._queried = self._hits = 0

    def finished(self, out, track, now: float, reason: Optional[str] = None) -> None:
        """A request finished (engine thread): its latencies, tokens and outcome."""
        self.e2e.observe(now - track.arrival)
        if track.first is not None and track.num_out > 1:
            self.tpot.observe((now - track.first) / (track.num_out - 1))
        self.prompt_tokens.inc(track.num_prompt)
        self.generation_tokens.inc(track.num_out)
        self.pc_queries.inc(track.num_prompt)
        self.pc_hits.inc(out.num_cached_tokens)
        self._queried += track.num_prompt
        self._hits += out.num_cached_tokens
        self.hit_rate.set(self._hits / self._queried if self._queried else 0.0)
        self._success.labels(self._model, str(reason or out.finish_reason or "abort")).inc()

    def engine_state(self, engine) -> None:
        """After every loop turn (engine thread): gauges and the engine's own running counters."""
        s = engine.scheduler
        self.running.set(len(s.running))
        self.waiting.set(len(s.waiting))
        kv = engine.kv_manager
        self.kv_usage.set(kv.usage())
        if hasattr(kv, "num_free_blocks"):  # (a router's stand-in has the usage only)
            free = kv.num_free_blocks()
            self.kv_blocks.set(sum(n - free[g] for g, n in kv.num_blocks.items()))
            self.kv_requests.set(len(kv.reqs))
        for key, now, counter in (("pre", s.num_preemptions, self.preemptions),
                                  ("draft", s.num_draft_tokens, self.drafts),
                                  ("acc", s.num_accepted_tokens, self.accepted)):
            if now > self._seen[key]:
                counter.inc(now - self._seen[key])
            self._seen[key] = now
        tiers = getattr(engine, "kv_offload", None)
        if tiers is not None:
            self._tiers(tiers.stats())

    def _tiers(self, st: dict) -> None:
        """The KV tiers' state (core/paging/offload.py: KVOffload.stats) into the tier series."""
        for name, t in st["tiers"].items():
            self.tier_blocks.labels(self._model, name).set(t["blocks"])
            self.tier_bytes.labels(self._model, name).set(t["bytes"])
            for key, counter in (("restored", self.tier_hits), ("restored_bytes", self.tier_hit_bytes),
                                 ("failures", self.tier_failures)):
                seen, child = self._seen.get((name, key), 0), counter.labels(self._model, name)  # shown from 0
                if t[key] > seen:
                    child.inc(t[key] - seen)
                self._seen[(name, key)] = t[key]
        self.tier_pending.set(st.get("pending_stores", 0))
        for key, counter in (("saved_bytes", self.tier_saved), ("restore_s", self.tier_restore_s),
                             ("save_s", self.tier_save_s), ("store_wait_s", self.tier_wait_s)):
            now = st.get(key, 0)
            if now > self._seen.get(key, 0):
                counter.inc(now - self._seen.get(key, 0))
            self._seen[key] = now

    def render(self) -> bytes:
        return generate_latest(self.registry)
