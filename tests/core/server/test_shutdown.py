"""How ``inferhal serve`` processes end (SmolLM2-135M-Instruct), each in a process of its own, as vLLM's
tests/v1/shutdown and tests/entrypoints/openai/*/test_shutdown.py end theirs: SIGTERM under load with a drain
timeout (every admitted stream to its end) and without one (``server.shutdown_timeout_s=0``: aborted, out
within 4.1 s), SIGKILL of the server, and ``parallel.role=pd`` (a router with a spawned prefill and decode
process) stopped by SIGTERM or killed by SIGKILL. After each: every process the server started has ended (no
orphan), and no port any of them listened on is still listening or refuses a new server's bind."""

from __future__ import annotations

import os
import signal
import socket
import time

import pytest

from serve_process import ServeProcess
from server_fixtures import MODEL
from test_drain import get, start

psutil = pytest.importorskip("psutil")


def listening(pids) -> set[int]:
    """The TCP ports these processes listen on."""
    ports = set()
    for pid in pids:
        try:
            conns = psutil.Process(pid).net_connections(kind="tcp")
        except psutil.NoSuchProcess:
            continue
        ports |= {c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN}
    return ports


def family(p: ServeProcess) -> list:
    """The server process and every process under it (spawned instances, multiprocessing's helpers)."""
    me = psutil.Process(p.p.pid)
    return [me, *me.children(recursive=True)]


def gone(procs, ports, timeout: float = 15.0) -> None:
    """Each of ``procs`` ended (or is a zombie its parent will reap) and nothing listens on ``ports`` any more: a
    connect is refused and a new socket binds there (as a restarted server would, with SO_REUSEADDR as uvicorn)."""
    deadline = time.monotonic() + timeout
    alive = list(procs)
    while alive and time.monotonic() < deadline:
        alive = [q for q in alive if q.is_running() and q.status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.1)
    assert not alive, f"orphans left running: {[(q.pid, q.name(), q.cmdline()[-3:]) for q in alive]}"
    for port in ports:
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0, f"port {port} still accepts connections"
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))


def serve(*overrides: str) -> tuple[ServeProcess, int]:
    p = ServeProcess([f"model={MODEL}", "server.port=0", "model.max_model_len=512", *overrides], "[serve]",
                     {**os.environ, "INFERHAL_API_KEY": "", "OMP_NUM_THREADS": "1"}, timeout_s=300)
    return p, p.port_after("http://")


@pytest.mark.parametrize("timeout_s", [60, 0], ids=["drain", "no_drain"])
def test_sigterm_under_load_ends_every_process_and_frees_the_port(timeout_s):
    p, port = serve(f"server.shutdown_timeout_s={timeout_s}")
    try:
        procs = family(p)
        ports = listening(q.pid for q in procs)
        assert port in ports
        streams = start(port, 3, 24 if timeout_s else 400)
        t0 = time.monotonic()
        p.p.send_signal(signal.SIGTERM)
        assert p.p.wait(90) == 0
        took = time.monotonic() - t0
        for s in streams:
            s.join(30)
            want = ["length"] if timeout_s else ["abort"]
            assert s.error is None and s.done and s.reasons == want, (s.error, s.reasons)
        if not timeout_s:
            assert took < 4.1, f"exited {took:.2f} s after SIGTERM"
        gone(procs, ports)
    finally:
        p.stop()


def test_sigkill_of_the_server_leaves_no_process_and_no_port():
    p, port = serve()
    try:
        procs = family(p)
        ports = listening(q.pid for q in procs)
        start(port, 2, 400)
        p.p.kill()
        assert p.p.wait(30) == -signal.SIGKILL
        gone(procs, ports)
    finally:
        p.stop()


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_pd_router_ending_takes_its_instances_with_it(sig):
    """``parallel.role=pd``: the prefill and decode processes (spawned, each with its model) end with their
    parent, whether it stops by SIGTERM (it stops them) or is killed (they watch their parent), mid-stream. Under
    SIGTERM the streams are short enough to end within the drain (the default 30 s ``server.shutdown_timeout_s``,
    which 400-token streams outlasted: 37 s a run), so the instances are stopped after a drain, not an abort."""
    p, port = serve("parallel.role=pd", "cache.block_size=16", "cache.num_blocks=256", "parallel.timeout_s=5")
    procs = []
    try:
        procs = family(p)
        ports = listening(q.pid for q in procs)
        instances = [q for q in procs if any(m in " ".join(q.cmdline()) for m in ("spawn", "forkserver"))]
        assert len(instances) >= 2 and len(ports) >= 3, (procs, ports)  # HTTP, and each instance's own
        assert get(port, "GET", "/health")[0] == 200
        start(port, 2, 24 if sig == signal.SIGTERM else 400)
        p.p.send_signal(sig)
        p.p.wait(60)
        gone(procs, ports, timeout=20.0)
    finally:
        p.stop()
        for q in procs:  # never leave one behind a failed assertion
            if q.is_running():
                q.kill()
