"""The DP ranks' series in ``/metrics`` (``inferhal serve parallel=dep2``; :mod:`.dp_serve`), label ``dp_rank``,
in the server's registry beside :class:`~.metrics.ServerMetrics`' series (which sum over the ranks).

Gauges: ``inferhal_dp_requests_running`` / ``inferhal_dp_requests_waiting``, ``inferhal_dp_kv_cache_usage_ratio``,
``inferhal_dp_kv_blocks_in_use``, ``inferhal_dp_load_tokens`` (prompt tokens still to prefill + tokens with KV in
use: what ``parallel.dp_balance=tokens_cache`` balances). Counters: ``inferhal_dp_prompt_tokens_total`` and
``inferhal_dp_prefix_cache_hits_total`` (prompt tokens of the rank's finished requests, and of those the ones its
prefix cache held), ``inferhal_dp_generation_tokens_total``, ``inferhal_dp_attention_tokens_total`` (tokens its
attention ran on), ``inferhal_dp_prefix_placed_total`` (requests placed on it for a cached prefix),
``inferhal_dp_session_placed_total`` (requests placed on it where their session key was placed before).
``inferhal_dp_balance{figure}``: max / mean over the ranks of ``attention_tokens`` (the work so far) and
``load_tokens`` (now); 1.0 is even. ``inferhal_dp_restarts_total``: the group's restarts after a rank died.
With EPLB (``eplb=default``): ``inferhal_dp_expert_load{dp_rank, layer}``, the token rows every rank routed to
the experts that rank holds, over EPLB's window (``eplb.window_size`` steps), and
``inferhal_dp_balance{figure="expert_load"}`` (max / mean over the ranks, summed over the layers).

``dp_rank`` is a rank's number in ``parallel.dp`` as the group started. After elastic EP goes on without a lost
rank (:mod:`.dp_elastic`) the survivors keep their numbers (dp0 and dp2 after dp1's loss), the lost rank's series
are removed (none is left at its last value), the balance figures are taken over the survivors and the expert
load over their slots; a restart of the whole group shows every rank's series again, counting from 0.

:class:`RankCounts` and :class:`RankPools` are the group's ``scheduler`` and ``kv_manager`` as the server's own
series read them: sums over the ranks (the fullest rank's KV usage).
"""

from __future__ import annotations

from typing import Any, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge

from inferhal.core.parallel.dp_balance import balance

GAUGES = (("running", "inferhal_dp_requests_running", "Requests in a DP rank's running batch"),
          ("waiting", "inferhal_dp_requests_waiting", "Requests waiting in a DP rank's scheduler"),
          ("kv_usage", "inferhal_dp_kv_cache_usage_ratio", "Fraction of a DP rank's KV blocks in use"),
          ("kv_blocks", "inferhal_dp_kv_blocks_in_use", "KV blocks held by a DP rank's requests"),
          ("load_tokens", "inferhal_dp_load_tokens", "A DP rank's prompt tokens to prefill + tokens with KV in use"))
COUNTERS = (("prompt_tokens", "inferhal_dp_prompt_tokens", "Prompt tokens of a DP rank's finished requests"),
            ("cached_tokens", "inferhal_dp_prefix_cache_hits", "Prompt tokens a DP rank found in its prefix cache"),
            ("generation_tokens", "inferhal_dp_generation_tokens", "Tokens a DP rank generated"),
            ("attn_tokens", "inferhal_dp_attention_tokens", "Tokens a DP rank's attention ran on"),
            ("prefix_placed", "inferhal_dp_prefix_placed", "Requests placed on a DP rank for a prefix it held"),
            ("session_placed", "inferhal_dp_session_placed",
             "Requests placed on a DP rank where their session key (prompt_cache_key, X-Session-Id) was placed before"))


class RankCounts:
    """The scheduler fields :class:`~.metrics.ServerMetrics` reads of an engine, over a DP group's ranks (their
    last gauges; counters of the group's earlier lives included)."""

    def __init__(self, group: Any) -> None:
        self._g = group

    def _sum(self, key: str) -> int:
        return sum(int(g.get(key, 0)) for g in self._g.rank_gauges)

    @property
    def running(self) -> range:
        return range(self._sum("running"))

    @property
    def waiting(self) -> range:
        return range(self._sum("waiting"))

    @property
    def num_preemptions(self) -> int:
        return self._g.totals.get("preemptions", 0) + self._sum("preemptions")

    @property
    def num_draft_tokens(self) -> int:
        return self._g.totals.get("drafts", 0) + self._sum("drafts")

    @property
    def num_accepted_tokens(self) -> int:
        return self._g.totals.get("accepted", 0) + self._sum("accepted")


class RankPools:
    """The KV pool fields :class:`~.metrics.ServerMetrics` reads of an engine, over a DP group's ranks."""

    def __init__(self, group: Any) -> None:
        self._g = group

    def usage(self) -> float:
        """The fullest rank's KV pool."""
        return max((float(g.get("kv_usage", 0.0)) for g in self._g.rank_gauges), default=0.0)

    # the blocks in use and the requests holding them, summed over the ranks (as one pool "all")
    @property
    def num_blocks(self) -> dict[str, int]:
        return {"all": sum(int(g.get("kv_blocks", 0)) for g in self._g.rank_gauges)}

    def num_free_blocks(self) -> dict[str, int]:
        return {"all": 0}

    @property
    def reqs(self) -> range:
        return range(sum(int(g.get("kv_requests", 0)) for g in self._g.rank_gauges))


class DPMetrics:
    """Per-rank series of ``num_ranks`` DP ranks in ``registry``; :meth:`update` after every step of the group."""

    def __init__(self, registry: CollectorRegistry, model_name: str, num_ranks: int) -> None:
        labels = ["model_name", "dp_rank"]
        self._model, self._seen = model_name, {}
        self._gone: set[str] = set()  # ranks lost (elastic EP): their series removed
        self._layers = 0  # MoE layers seen in expert_load
        self.gauges = {k: Gauge(n, d, labels, registry=registry) for k, n, d in GAUGES}
        self.counters = {k: Counter(n, d, labels, registry=registry) for k, n, d in COUNTERS}
        for r in range(num_ranks):  # every rank's series shown from the start
            for metric in (*self.gauges.values(), *self.counters.values()):
                metric.labels(model_name, str(r))
        self.balance = Gauge("inferhal_dp_balance", "max / mean over the DP ranks (1 = even)", ["model_name", "figure"],
                             registry=registry)
        self.restarts = Counter("inferhal_dp_restarts", "Restarts of the DP group after a rank died", ["model_name"],
                                registry=registry).labels(model_name)
        self.expert_load = Gauge("inferhal_dp_expert_load", "Token rows routed to a DP rank's experts of a MoE "
                                 "layer over EPLB's window", ["model_name", "dp_rank", "layer"], registry=registry)

    def update(self, ranks: list[dict], lost: Iterable[int] = ()) -> None:
        """The ranks' gauges at their original numbers (:meth:`~inferhal.core.parallel.dp_serve_engine.
        ServeDPEngine.gauges`, ``{}`` for a rank not heard from yet or lost); ``lost``: the numbers of the ranks the
        group went on without (their series are removed). A rank's counters start from 0 again when its group
        restarts."""
        gone = {str(r) for r in lost}
        for rank in sorted(gone - self._gone):
            self._remove(rank)
        for rank in sorted(self._gone - gone):  # back after a restart: shown from 0 again
            for metric in (*self.gauges.values(), *self.counters.values()):
                metric.labels(self._model, rank)
        self._gone = gone
        live = [(str(i), g) for i, g in enumerate(ranks) if str(i) not in gone]
        for rank, g in live:
            if not g:
                continue
            g = dict(g, load_tokens=int(g["prefill_tokens"]) + int(g["kv_tokens"]))
            for key, gauge in self.gauges.items():
                gauge.labels(self._model, rank).set(g[key])
            for key, counter in self.counters.items():
                seen, now = self._seen.get((rank, key), 0), int(g[key])
                if now != seen:
                    counter.labels(self._model, rank).inc(now - seen if now > seen else now)
                self._seen[(rank, key)] = now
        heard = [(rank, g) for rank, g in live if g]
        if heard and len(heard) == len(live) and all("expert_rows" in g for _, g in heard):
            per_rank = self._expert_load([rank for rank, _ in heard], [g["expert_rows"] for _, g in heard])
            self.balance.labels(self._model, "expert_load").set(balance([sum(layers) for layers in per_rank]))
        if heard:
            self.balance.labels(self._model, "attention_tokens").set(balance([g["attn_tokens"] for _, g in heard]))
            self.balance.labels(self._model, "load_tokens").set(
                balance([int(g["prefill_tokens"]) + int(g["kv_tokens"]) for _, g in heard]))

    def _expert_load(self, labels: list[str], rows: list) -> list[list[int]]:
        """``[rank][layer]`` rows routed to the experts each rank in place holds (slots ``r * R/n .. (r+1) * R/n - 1``
        of the placement in use, as core/parallel/dp_moe.py sends them), from every such rank's
        ``expert_rows[layer][slot]``; each set as a gauge under the rank's label."""
        n, layers, slots = len(rows), len(rows[0]), len(rows[0][0])
        per = slots // n
        out = [[sum(rows[src][layer][s] for src in range(n) for s in range(r * per, (r + 1) * per))
                for layer in range(layers)] for r in range(n)]
        self._layers = max(self._layers, layers)
        for label, loads in zip(labels, out):
            for layer, v in enumerate(loads):
                self.expert_load.labels(self._model, label, str(layer)).set(v)
        return out

    def _remove(self, rank: str) -> None:
        """Drop every series of DP rank ``rank`` (lost): none stays at its last value."""
        for metric in (*self.gauges.values(), *self.counters.values()):
            try:
                metric.remove(self._model, rank)
            except KeyError:
                pass
        for layer in range(self._layers):
            try:
                self.expert_load.remove(self._model, rank, str(layer))
            except KeyError:
                pass
        self._seen = {k: v for k, v in self._seen.items() if k[0] != rank}

    def restarted(self) -> None:
        """The group was spawned again: its ranks count from 0."""
        self._seen = {}
        self.restarts.inc()
