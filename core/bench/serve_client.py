"""A minimal asyncio HTTP/1.1 client for the ``bench serve`` load test: one streaming completion per
connection, SSE over chunked transfer, timestamps per event. Plain sockets, so the clients cost little of
the CPU the server and engine are measured on."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class StreamResult:
    status: int = 0
    text: str = ""
    finish_reason: Optional[str] = None
    completion_tokens: int = 0
    start: float = 0.0
    first: Optional[float] = None  # first non-empty text
    times: list[float] = field(default_factory=list)  # every event with text
    done: bool = False  # saw data: [DONE]
    disconnected: bool = False  # we hung up on purpose
    error: str = ""


async def stream_completion(host: str, port: int, body: dict, hang_up_after: Optional[int] = None) -> StreamResult:
    """POST ``body`` (with ``stream: true``) to ``/v1/completions``; ``hang_up_after``: close the connection
    after that many events (a client that goes away)."""
    res = StreamResult(start=time.perf_counter())
    data = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                     f"Accept: text/event-stream\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
        await writer.drain()
        res.status = int((await reader.readline()).split()[1])
        chunked = False
        while True:
            line = await reader.readline()
            if line in (b"\r\n", b""):
                break
            if line.lower().startswith(b"transfer-encoding:") and b"chunked" in line.lower():
                chunked = True
        if res.status != 200 or not chunked:
            res.error = (await reader.read(2000)).decode(errors="replace")
            return res
        buf, events = b"", 0
        while True:
            size = int((await reader.readline()).strip() or b"0", 16)
            if size == 0:
                break
            buf += await reader.readexactly(size)
            await reader.readline()
            while b"\n\n" in buf:
                ev, buf = buf.split(b"\n\n", 1)
                payload = ev[len(b"data: "):]
                if payload == b"[DONE]":
                    res.done = True
                    continue
                msg = json.loads(payload)
                if "error" in msg:
                    res.error = msg["error"]["message"]
                    continue
                if msg.get("usage"):
                    res.completion_tokens = msg["usage"]["completion_tokens"]
                for ch in msg["choices"]:
                    if ch["text"]:
                        now = time.perf_counter()
                        res.first = res.first or now
                        res.times.append(now)
                        res.text += ch["text"]
                    if ch["finish_reason"]:
                        res.finish_reason = ch["finish_reason"]
                events += 1
                if hang_up_after is not None and events >= hang_up_after:
                    res.disconnected = True
                    return res
        return res
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except (ConnectionError, OSError):
            pass
