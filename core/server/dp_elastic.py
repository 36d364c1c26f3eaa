"""Elastic EP behind ``inferhal serve parallel=depN``: when a DP rank dies and the placement in use holds a
replica of every expert outside it (``eplb.survive_rank_loss`` makes every plan so), the survivors go on
serving without it instead of the whole group restarting (:mod:`inferhal.core.parallel.elastic`).

The front (:class:`ElasticGroup`, mixed into :class:`~.dp_serve.DPGroup`), when a step of the group fails:

1. waits briefly for a rank process to have exited: none (a rank raised, or hangs) or none left → the usual
   restart;
2. sends every survivor ``("shrink", (lost ranks, master address, a new free port))``; each answers
   ``("shrink", {"ok": ..., ...})`` after :func:`rank_shrink` (its replies to the failed step, read first, are
   dropped: every request is placed again anyway). A survivor that finds the loss not covered says so and
   changes nothing; any refusal, error or silence, or survivors that disagree on the new placement → the usual
   restart (which brings back every rank);
3. on success keeps the survivors (renumbered ``0 .. n-2`` in their group; ``/health`` and ``/metrics`` keep
   each rank's original ``dp<i>`` label, the lost one shown as ``lost``: ``/health`` answers 200 ``degraded``),
   and places every open request again from its prompt and the tokens it streamed, as after a restart
   (:meth:`~.dp_serve.DPGroup._again`): the survivors dropped every request, because the dead rank's KV is
   gone and the failed step is torn on every rank.

A later death is handled the same way when the placement then in use covers it; otherwise the group restarts
with all ``parallel.dp`` ranks. ``shrinks`` counts the group's shrinks (``restarts`` is unchanged by them).
Local ranks only: under ``parallel.launcher=torchrun`` a rank's death restarts the group (torchrun's agent
stops the other workers of its host anyway).
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

log = logging.getLogger("inferhal.server")

EXIT_WAIT_S = 5.0
"""How long a failed step waits for a rank's process to be seen exited before it restarts the group."""


def rank_shrink(dpe: Any, arg: tuple) -> dict:
    """The rank side of ``("shrink", (lost, master_addr, master_port))``: → ``{"ok": True, **shrink's answer}``
    or ``{"ok": False, "why": ...}`` when the loss is not covered or the group did not re-form."""
    from inferhal.core.eplb.validate import PlacementError
    from inferhal.core.errors import UserError
    from inferhal.core.parallel.elastic import shrink, survivor_layout

    lost, addr, port = arg
    try:
        info = shrink(dpe, lost, survivor_layout(dpe.comm.layout, lost, addr, port))
    except (PlacementError, UserError) as exc:
        return {"ok": False, "why": str(exc)}
    return dict(info, ok=True)


class ElasticGroup:
    """The elastic part of :class:`~.dp_serve.DPGroup` (module docstring). Needs the group's ``dp``, ``ranks``
    (``process``, ``conn``, ``gauges``), ``requests``, ``totals``, ``timeout_s``, ``_cfg``, ``_again`` and
    ``_adds``/``_aborts``."""

    def _full_group(self) -> None:
        """Every rank in place (at start and after a restart): labels ``0 .. dp-1``, none lost."""
        self.size = getattr(self, "size", self.dp)  # parallel.dp
        self.dp = self.size
        self.labels = list(range(self.size))  # each rank's original number, in the group's order
        self.lost: dict[int, str] = {}  # original number -> why it is out
        self.shrinks = getattr(self, "shrinks", 0)

    def labelled(self, values: list) -> list:
        """``values`` of the ranks in place, at their original numbers (``{}`` where a rank was lost)."""
        out: list = [{} for _ in range(self.size)]
        for label, v in zip(self.labels, values):
            out[label] = v
        return out

    def lost_health(self) -> dict[str, str]:
        return {f"dp{label}": f"lost: {why}" for label, why in sorted(self.lost.items())}

    def _shrink(self, why: str) -> bool:
        """After a failed step (``why``): go on with the survivors when they can (module docstring); False: the
        caller restarts the group."""
        if getattr(self, "door", None) is not None:  # parallel.launcher=torchrun: its agent restarts the whole group
            return False
        deadline = time.monotonic() + EXIT_WAIT_S
        while all(r.process.is_alive() for r in self.ranks) and time.monotonic() < deadline:
            time.sleep(0.05)
        keep = [i for i, r in enumerate(self.ranks) if r.process.is_alive()]
        lost = [i for i in range(len(self.ranks)) if i not in keep]
        if not lost or not keep:
            return False
        from inferhal.core.parallel.launch import free_port

        addr = str(self._cfg["parallel"]["master_addr"])
        msg = ("shrink", (lost, addr, free_port(addr)))
        answers = {}
        try:
            for i in keep:
                self.ranks[i].conn.send(msg)
            end = time.monotonic() + 2 * self.timeout_s + 10
            for i in keep:
                conn = self.ranks[i].conn
                while True:  # the survivor's answer to the failed step comes first
                    if not conn.poll(max(0.0, end - time.monotonic())):
                        return self._refused(f"DP rank {i} did not answer the shrink")
                    kind, arg = conn.recv()
                    if kind == "shrink":
                        answers[i] = arg
                        break
                    if kind not in ("stepped", "error"):
                        return self._refused(f"DP rank {i} answered {kind!r} to the shrink")
        except (EOFError, OSError, ValueError) as exc:
            return self._refused(f"a surviving DP rank is gone too ({type(exc).__name__})")
        bad = [f"DP rank {i}: {a['why']}" for i, a in answers.items() if not a["ok"]]
        if bad:
            return self._refused("; ".join(bad))
        if len({a["placement"] for a in answers.values()}) != 1:
            return self._refused("the survivors hold different expert placements")
        for i in lost:
            r = self.ranks[i]
            self.lost[self.labels[i]] = f"{why} (the survivors went on without it)"
            for key in ("preemptions", "drafts", "accepted"):  # the server's totals keep what it counted
                self.totals[key] = self.totals.get(key, 0) + int(r.gauges.get(key, 0))
            r.process.join(1)
            r.conn.close()
        self.labels = [self.labels[i] for i in keep]
        self.ranks = [self.ranks[i] for i in keep]
        self.dp, self.busy, self._aborts, self._adds = len(keep), False, [], []
        self.shrinks += 1
        for rid in list(self.requests):
            self._again(rid)
        log.warning("DP rank(s) %s lost (%s); %d ranks go on without them", lost, why, len(keep))
        print(f"[serve] the DP group goes on with {len(keep)} ranks (dp{', dp'.join(map(str, self.labels))}) "
              f"without dp{', dp'.join(str(l) for l in sorted(self.lost))}", file=sys.stderr, flush=True)
        return True

    def _refused(self, why: str) -> bool:
        log.error("the DP survivors cannot go on without the lost rank, restarting the group: %s", why)
        return False
