"""The AsyncEngine's admission and deadlines, on a scripted engine (no model): the queued-token bound counts
prompts until their first token and refuses with QueueFull past it (a prompt larger than the bound alone is
a UserError); a request's deadline, or the server's default, ends it with finish reason ``timeout`` and
aborts it in the engine; after ``drain`` nothing is admitted and ``abort_all`` ends what is open."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

import pytest

from inferhal.core.errors import UserError
from inferhal.core.server.async_engine import AsyncEngine, Draining, QueueFull


@dataclass
class Out:
    request_id: str
    new_token_ids: list
    finished: bool = False
    finish_reason: str | None = None
    logprobs: list = field(default_factory=list)
    num_cached_tokens: int = 0


class Scripted:
    """Holds its requests until ``go`` is set; then each step gives every request one token, and a request
    ends (``length``) after ``n`` tokens."""

    def __init__(self, n: int = 3) -> None:
        self.reqs: dict[str, int] = {}
        self.go = threading.Event()
        self.aborted: list[str] = []
        self.n = n

    def make_request(self, prompt, params, request_id=None):
        return request_id

    def add(self, rid):
        self.reqs[rid] = 0

    def has_unfinished(self):
        return bool(self.reqs)

    def step(self):
        if not self.go.wait(0.01):
            return []
        outs = []
        for rid in list(self.reqs):
            self.reqs[rid] += 1
            done = self.reqs[rid] >= self.n
            outs.append(Out(rid, [7], done, "length" if done else None))
            if done:
                del self.reqs[rid]
        return outs

    def abort(self, rids):
        self.aborted += rids
        return [Out(r, [], True, "abort") for r in rids if self.reqs.pop(r, None) is not None]


async def drain_queue(q) -> list:
    got = []
    while not got or not got[-1].finished:
        got.append(await asyncio.wait_for(q.get(), 10))
    return got


def run(coro_fn, eng: Scripted, **kw):
    async def main():
        ae = AsyncEngine(eng, **kw)
        ae.start(asyncio.get_running_loop())
        try:
            return await coro_fn(ae)
        finally:
            ae.stop()

    return asyncio.run(main())


def test_queued_tokens_count_prompts_until_their_first_token():
    eng = Scripted()

    async def body(ae):
        _, q1 = await ae.submit(range(60), None)
        assert ae.queued_tokens == 60
        with pytest.raises(QueueFull, match="server.max_queued_tokens=100"):
            await ae.submit(range(50), None)
        with pytest.raises(UserError, match="more than the server queues at once"):
            await ae.submit(range(101), None)
        _, q2 = await ae.submit(range(40), None)  # 60 + 40 fits
        eng.go.set()
        outs = await drain_queue(q1)
        await drain_queue(q2)
        assert [o.finish_reason for o in outs][-1] == "length" and ae.queued_tokens == 0
        _, q3 = await ae.submit(range(100), None)  # the first tokens came: the bound is free again
        await drain_queue(q3)
        return ae.num_unfinished

    assert run(body, eng, max_queued_tokens=100) == 0


def test_check_room_counts_several_requests_together():
    """An ``n > 1`` completion's choices are checked as one (service.start calls check_room before admitting any):
    one by one, a choice finishing between two admissions would let the whole through the bound."""
    eng = Scripted(n=1)

    async def body(ae):
        ae.check_room(3, 20)  # fits an empty queue
        with pytest.raises(QueueFull, match="0 requests are queued or running and 4 more would pass "
                                            "server.max_queued_requests=3"):
            ae.check_room(4, 4)
        with pytest.raises(QueueFull, match="30 more would pass server.max_queued_tokens=20"):
            ae.check_room(1, 30)
        _, q = await ae.submit([1, 2], None)
        with pytest.raises(QueueFull, match="1 requests are queued or running and 3 more"):
            ae.check_room(3, 3)
        eng.go.set()
        await drain_queue(q)  # finished: its room is free again
        ae.check_room(3, 20)
        return ae.num_unfinished

    assert run(body, eng, max_queued=3, max_queued_tokens=20) == 0


def test_a_deadline_ends_the_request_with_timeout_and_aborts_it():
    eng = Scripted()

    async def body(ae):
        rid, q = await ae.submit([1, 2], None, timeout_s=0.2)
        outs = await drain_queue(q)
        rid2, q2 = await ae.submit([1, 2], None)  # the server's default deadline
        outs2 = await drain_queue(q2)
        return rid, outs, rid2, outs2, ae.num_unfinished, ae.queued_tokens

    rid, outs, rid2, outs2, open_, queued = run(body, eng, request_timeout_s=0.3)
    assert outs[-1].finish_reason == "timeout" and outs2[-1].finish_reason == "timeout"
    assert eng.aborted == [rid, rid2] and not eng.reqs and open_ == 0 and queued == 0


def test_draining_admits_nothing_and_abort_all_ends_what_is_open():
    eng = Scripted()

    async def body(ae):
        subs = [await ae.submit([1], None) for _ in range(3)]
        ae.drain()
        with pytest.raises(Draining):
            await ae.submit([1], None)
        ae.abort_all()
        outs = [await drain_queue(q) for _, q in subs]
        return outs, ae.num_unfinished

    outs, open_ = run(body, eng)
    assert [o[-1].finish_reason for o in outs] == ["abort"] * 3 and open_ == 0 and not eng.reqs


class Dies(Scripted):
    """Its first step with a request waits for ``release``, then raises as a router whose last instance died."""

    def __init__(self) -> None:
        super().__init__()
        self.inside, self.release = threading.Event(), threading.Event()

    def step(self):
        self.inside.set()
        self.release.wait(10)
        raise RuntimeError("every engine instance is dead (decode: killed)")


def test_a_request_queued_while_the_loop_dies_learns_why():
    """A request sent while the step that kills the loop runs never reaches the engine; it fails with the step's
    reason, as the running ones do (it read only "the engine loop stopped" before)."""
    from inferhal.core.errors import EngineDead

    eng = Dies()

    async def body(ae):
        await ae.submit([1], None)
        await asyncio.get_running_loop().run_in_executor(None, eng.inside.wait, 10)
        late = asyncio.ensure_future(ae.submit([2], None))
        await asyncio.sleep(0.05)  # its add command is queued behind the running step
        eng.release.set()
        with pytest.raises(EngineDead, match="every engine instance is dead"):
            await asyncio.wait_for(late, 10)

    run(body, eng)
