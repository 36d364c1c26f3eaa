""":meth:`Router.abort` of a request that was retried (its instance died, it runs again from its prompt plus the
tokens it had streamed): its final output lists each token once. No processes: a router with stand-in instances,
driven through the messages an instance sends (``taken``, ``outputs``)."""

from __future__ import annotations

from types import SimpleNamespace

from inferhal.core.disagg.router import Router, _Rec
from inferhal.core.engine.outputs import CompletionOutput, RequestOutput
from inferhal.core.sampling.params import SamplingParams


def out(rid, tokens, new):
    return RequestOutput(rid, None, [1, 2, 3], [CompletionOutput(0, "", list(tokens), None, [])],
                         new_token_ids=list(new))


def test_aborting_a_retried_request_lists_its_earlier_tokens_once():
    router = Router.__new__(Router)  # the request bookkeeping only: no fleet, no instance processes
    sent = []
    router._send = lambda inst, msg: sent.append((inst.name, msg))
    router.insts = {n: SimpleNamespace(name=n, role="decode", live=True, gauges={}) for n in ("decode0", "decode1")}
    router.requests, router._resumed, router.retried = {}, {}, {}
    rec = router.requests["r"] = _Rec([1, 2, 3], SamplingParams(max_tokens=10), "decode", where="decode0")
    outs: list = []
    router._handle(router.insts["decode0"], "outputs", ([out("r", [10, 11], [10, 11])], {}), outs)
    router._retry("r", on="decode1")  # decode0 died after streaming 10, 11
    assert sent[-1] == ("decode1", ("add", ("r", [1, 2, 3, 10, 11], SamplingParams(max_tokens=8), True, None)))
    router._handle(router.insts["decode1"], "taken", "r", outs)
    router._handle(router.insts["decode1"], "outputs", ([out("r", [12], [12])], {}), outs)
    assert outs[-1].outputs[0].token_ids == [10, 11, 12]  # the stream goes on where it stopped
    final, = router.abort(["r"])
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert final.outputs[0].token_ids == [10, 11, 12]  # was [10, 11, 10, 11, 12]: resumed twice
    assert final.new_token_ids == [] and "r" not in router._resumed and not router.requests
    assert rec.last.outputs[0].token_ids == [10, 11, 12]
