"""One request of ``inferhal bench soak`` over a plain asyncio socket: OpenAI's completions and chat completions
and Anthropic's messages, JSON or SSE, read to the end or hung up on purpose at a set point. Plain sockets (as
:mod:`.serve_client`): the clients share the host with the server they load, so each costs little CPU; any
route and both error shapes, and the outcome of every request classified for the report."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Union

#: where a client hangs up: "send" right after its request (before the first token; in a long prompt's prefill),
#: "headers" once the status line came, or after that many stream events (mid-stream)
Hang = Union[None, str, int]


@dataclass
class Result:
    status: int = 0
    outcome: str = ""  # ok | hung_up | http_<status> | stream_error | truncated | timeout | connection
    texts: dict[int, str] = field(default_factory=dict)  # choice index -> its text (content, for chat)
    finish: dict[int, str] = field(default_factory=dict)  # choice index -> its finish or stop reason
    start: float = 0.0
    first: Optional[float] = None  # the first text
    end: float = 0.0
    error: str = ""


def _choices(path: str, msg: dict, res: Result, stream: bool) -> bool:
    """Fold one JSON reply or SSE event into ``res``; → True when it held text."""
    got = False
    if path == "/v1/messages":
        kind = msg.get("type")
        if kind == "content_block_delta" and msg["delta"].get("type") == "text_delta":
            res.texts[0] = res.texts.get(0, "") + msg["delta"]["text"]
            got = True
        elif kind == "message_delta":
            res.finish[0] = msg["delta"].get("stop_reason")
        elif kind == "message":  # the JSON reply
            res.texts[0] = "".join(b.get("text", "") for b in msg["content"] if b.get("type") == "text")
            res.finish[0] = msg.get("stop_reason")
        return got
    for ch in msg.get("choices", ()):
        i = ch["index"]
        if path == "/v1/completions":
            text = ch.get("text") or ""
        elif stream:
            text = (ch.get("delta") or {}).get("content") or ""
        else:
            text = (ch.get("message") or {}).get("content") or ""
        if text:
            res.texts[i] = res.texts.get(i, "") + text
            got = True
        else:
            res.texts.setdefault(i, "")
        if ch.get("finish_reason"):
            res.finish[i] = ch["finish_reason"]
    return got


async def _lines(reader: asyncio.StreamReader, chunked: bool, length: Optional[int]):
    """The body's bytes, chunk by chunk (chunked transfer) or at once (Content-Length)."""
    if not chunked:
        yield await reader.readexactly(length) if length is not None else await reader.read()
        return
    while True:
        size = int((await reader.readline()).strip() or b"0", 16)
        if size == 0:
            return
        data = await reader.readexactly(size)
        await reader.readline()
        yield data


async def send(host: str, port: int, path: str, body: dict, hang: Hang = None, timeout_s: float = 300.0) -> Result:
    """POST ``body`` to ``path``; ``hang``: where to hang up (None: read the whole answer)."""
    res = Result(start=time.perf_counter())
    try:
        await asyncio.wait_for(_send(host, port, path, body, hang, res), timeout_s)
    except asyncio.TimeoutError:
        res.outcome, res.error = "timeout", f"no whole answer within {timeout_s:g} s"
    except (ConnectionError, OSError, asyncio.IncompleteReadError) as exc:
        res.outcome, res.error = "connection", f"{type(exc).__name__}: {exc}"
    except (ValueError, KeyError) as exc:  # a reply that is not what the API sends
        res.outcome, res.error = "bad_reply", f"{type(exc).__name__}: {exc}"
    res.end = time.perf_counter()
    return res


async def _send(host: str, port: int, path: str, body: dict, hang: Hang, res: Result) -> None:
    data = json.dumps(body).encode()
    stream = body.get("stream") is True
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        await writer.drain()
        if hang == "send":
            res.outcome = "hung_up"
            return
        res.status = int((await reader.readline()).split()[1])
        chunked, length = False, None
        while True:
            line = (await reader.readline()).lower()
            if line in (b"\r\n", b""):
                break
            if line.startswith(b"transfer-encoding:") and b"chunked" in line:
                chunked = True
            elif line.startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        if hang == "headers":
            res.outcome = "hung_up"
            return
        if res.status != 200:
            raw = b"".join([c async for c in _lines(reader, chunked, length)])
            res.outcome, res.error = f"http_{res.status}", raw[:300].decode(errors="replace")
            return
        if not stream:
            raw = b"".join([c async for c in _lines(reader, chunked, length)])
            _choices(path, json.loads(raw), res, False)
            res.first = res.first or time.perf_counter()
            res.outcome = "ok"
            return
        await _events(reader, chunked, length, path, hang, res)
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except (ConnectionError, OSError):
            pass


async def _events(reader, chunked, length, path: str, hang: Hang, res: Result) -> None:
    buf, events, done = b"", 0, False
    async for chunk in _lines(reader, chunked, length):
        buf += chunk
        while b"\n\n" in buf:
            ev, buf = buf.split(b"\n\n", 1)
            payload = next((x[6:] for x in ev.split(b"\n") if x.startswith(b"data: ")), None)
            if payload is None:
                continue
            if payload == b"[DONE]":
                done = True
                continue
            msg: Any = json.loads(payload)
            if "error" in msg and ("choices" not in msg):
                res.outcome, res.error = "stream_error", json.dumps(msg["error"])[:300]
                return
            if _choices(path, msg, res, True):
                res.first = res.first or time.perf_counter()
            done = done or msg.get("type") == "message_stop"
            events += 1
            if isinstance(hang, int) and events >= hang:
                res.outcome = "hung_up"
                return
    res.outcome = "ok" if done else "truncated"
