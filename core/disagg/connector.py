"""The KV connector contract: how a prefill instance hands a request (its KV blocks and its state) to a
decode instance.

A connector moves :class:`KVPayload` objects one way, in order, between two peers, and exchanges one
handshake first. Core ships two transports:

- :class:`TorchDistConnector`, the default: point-to-point ``torch.distributed`` send/recv on a process
  group (the host's collective library on the host; a device library where a backend's communicator provides one);
- :class:`LoopbackConnector`, a pair of in-process queues (tests, and prefill and decode engines in one
  process).

A backend may provide a faster transport (NIXL, Mooncake, DeepEP-style RDMA) through the optional
``inferhal_kv_connector`` hook (:mod:`inferhal.core.hookspecs`); it returns an object with these methods.
"""

from __future__ import annotations

import io
import pickle
import queue
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, runtime_checkable

import torch


@dataclass
class KVPayload:
    """One request, handed from prefill to decode.

    ``state``: plain data (request id, prompt and output tokens, sampling parameters, generator state,
    the first token's logprobs, the number of computed positions ``P``); ``blocks[group]``: that group's
    KV of the request, ``[layers, blocks, slots_per_block, *slot]`` in the stored format (quantised records
    stay records), its logical blocks ``first_block[group] ..`` (a sliding group sends only its window)."""

    state: dict[str, Any]
    blocks: dict[str, torch.Tensor] = field(default_factory=dict)
    first_block: dict[str, int] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """KV bytes moved (the state's few hundred bytes of plain data not counted)."""
        return sum(t.numel() * t.element_size() for t in self.blocks.values())


@runtime_checkable
class KVConnector(Protocol):
    def handshake(self, local: Mapping[str, Any]) -> dict[str, Any]:
        """Send this side's description and return the peer's (both sides call it once, first)."""

    def send(self, payload: KVPayload) -> None: ...

    def recv(self, timeout: float | None = None) -> KVPayload:
        """The next payload (``timeout`` seconds at most where the transport can bound it)."""

    def close(self) -> None: ...


class ConnectorError(RuntimeError):
    """The peer is gone or answered out of turn; the message says which transfer and why."""


class LoopbackConnector:
    """One end of an in-process pair (:meth:`pair`): what one end sends, the other receives."""

    def __init__(self, out: "queue.Queue", inbox: "queue.Queue") -> None:
        self._out, self._in = out, inbox

    @classmethod
    def pair(cls) -> tuple["LoopbackConnector", "LoopbackConnector"]:
        a, b = queue.Queue(), queue.Queue()
        return cls(a, b), cls(b, a)

    def handshake(self, local: Mapping[str, Any]) -> dict[str, Any]:
        self._out.put(("hello", dict(local)))
        return self._take("hello", 30.0)

    def send(self, payload: KVPayload) -> None:
        self._out.put(("kv", payload))

    def recv(self, timeout: float | None = None) -> KVPayload:
        return self._take("kv", timeout)

    def _take(self, kind: str, timeout: float | None) -> Any:
        try:
            got, obj = self._in.get(timeout=timeout)
        except queue.Empty:
            raise ConnectorError(f"no {kind!r} message from the peer within {timeout} s") from None
        if got != kind:
            raise ConnectorError(f"expected a {kind!r} message from the peer, got {got!r}")
        return obj

    def close(self) -> None:
        pass


class TorchDistConnector:
    """Point-to-point over ``torch.distributed`` (the default transport): this rank and rank ``peer`` of
    ``group``. ``group`` None: the default group (``init_process_group`` done); otherwise a process group
    object whose ``send``/``recv`` take group ranks, registered with torch.distributed or not (the 2-rank
    gloo group of one prefill/decode pair, :func:`~inferhal.core.disagg.link.pair_group`). Each message is a
    length-prefixed pickle of the plain data (shapes and dtypes included), then every KV tensor as it is
    stored."""

    def __init__(self, peer: int, group: Any = None) -> None:
        import torch.distributed as dist

        if group is None and not dist.is_initialized():
            raise ConnectorError("TorchDistConnector needs torch.distributed initialised (init_process_group) or a "
                                 "process group")
        self.dist, self.peer, self.group = dist, int(peer), group
        self.rank = dist.get_rank() if group is None else int(group.rank())

    def _send(self, t: torch.Tensor) -> None:
        if self.group is None:
            self.dist.send(t, self.peer)
        else:
            self.group.send([t], self.peer, 0).wait()

    def _recv(self, t: torch.Tensor) -> None:
        if self.group is None:
            self.dist.recv(t, self.peer)
        else:
            self.group.recv([t], self.peer, 0).wait()

    def _send_obj(self, obj: Any) -> None:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        self._send(torch.tensor([data.numel()], dtype=torch.long))
        self._send(data)

    def _recv_obj(self) -> Any:
        n = torch.zeros(1, dtype=torch.long)
        self._recv(n)
        data = torch.empty(int(n), dtype=torch.uint8)
        self._recv(data)
        return pickle.load(io.BytesIO(data.numpy().tobytes()))

    def handshake(self, local: Mapping[str, Any]) -> dict[str, Any]:
        if self.rank < self.peer:  # a fixed order: no two blocking sends face each other
            self._send_obj(dict(local))
            return self._recv_obj()
        peer = self._recv_obj()
        self._send_obj(dict(local))
        return peer

    def send(self, payload: KVPayload) -> None:
        meta = {g: (tuple(t.shape), str(t.dtype).replace("torch.", "")) for g, t in payload.blocks.items()}
        self._send_obj({"state": payload.state, "first_block": payload.first_block, "blocks": meta})
        for g in meta:  # as bytes: every transport carries uint8, whatever the stored dtype
            self._send(payload.blocks[g].contiguous().cpu().reshape(-1).view(torch.uint8))

    def recv(self, timeout: float | None = None) -> KVPayload:
        head = self._recv_obj()  # (the process group's own timeout bounds a silent peer)
        blocks = {}
        for g, (shape, dtype) in head["blocks"].items():
            dt = getattr(torch, dtype)
            raw = torch.empty(int(torch.Size(shape).numel()) * torch.empty((), dtype=dt).element_size(),
                              dtype=torch.uint8)
            self._recv(raw)
            blocks[g] = raw.view(dt).view(shape)
        return KVPayload(head["state"], blocks, head["first_block"])

    def close(self) -> None:
        pass


def connect(backend: Any, peer: int, group: Any = None) -> Any:
    """The KV connector to rank ``peer`` of ``group``: the backend's own (``inferhal_kv_connector``), or
    torch.distributed point-to-point (:class:`TorchDistConnector`) where it has none."""
    conn = backend.kv_connector(peer, group)
    return conn if conn is not None else TorchDistConnector(peer, group)
