"""SIGTERM / SIGINT drain for ``inferhal serve`` (a uvicorn server that drains before it stops).

On the first signal the server stops admitting: new requests get 503 (``shutting_down``, with
``Retry-After``) and ``/health`` answers 503 ``draining``, while the listening socket stays open, so a load
balancer moves clients elsewhere instead of seeing refused connections. Requests already admitted run on;
once none is left, or ``server.shutdown_timeout_s`` has passed (0: at once), the rest are aborted (their
streams end with ``finish_reason="abort"`` and their KV is freed) and uvicorn shuts down, giving responses
:data:`FLUSH_S` to finish sending. A second signal aborts everything and stops at once.
"""

from __future__ import annotations

import asyncio
import time
from typing import Optional

import uvicorn

#: after the drain, how long uvicorn lets connections send what they hold (uvicorn's graceful timeout)
FLUSH_S = 2.0


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine, shutdown_timeout_s: float) -> None:
        super().__init__(config)
        self.engine, self.shutdown_timeout_s = engine, float(shutdown_timeout_s)
        self.deadline: Optional[float] = None
        self.loop: Optional[asyncio.AbstractEventLoop] = None

    async def serve(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame) -> None:  # a signal handler: hand the work to the event loop
        if self.loop is None:
            return super().handle_exit(sig, frame)
        if self.deadline is None:
            self.loop.call_soon_threadsafe(self.start_drain)
        else:
            self.loop.call_soon_threadsafe(self.engine.abort_all)
            super().handle_exit(sig, frame)

    def start_drain(self) -> None:
        if self.deadline is not None:
            return
        self.engine.drain()
        self.deadline = time.monotonic() + self.shutdown_timeout_s
        self._check()

    def _check(self) -> None:
        if self.deadline is None or self.should_exit:
            return
        if self.engine.num_unfinished == 0:
            self.should_exit = True
        elif time.monotonic() >= self.deadline:
            self.engine.abort_all()
            self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        self._check()
        return await super().on_tick(counter)
