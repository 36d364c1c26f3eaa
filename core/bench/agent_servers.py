"""The servers ``inferhal bench agent`` measures: ``inferhal serve`` children (one per variant), llama.cpp's
OpenAI server (llama-cpp-python) on the same GGUF, or a server already running at ``bench.url``.

A variant is a list of overrides (``["spec=suffix"]``, ``["backend=cpu_avx512"]``): what they change against
the default composition is applied to the bench's own config, so a variant is "this run's config, and these
changes", and its child serves that (:func:`variant_config`). The child is started as ``bench serve`` starts its
server (:func:`inferhal.core.bench.serve._serve_child`).

llama-cpp-python is built from source (~16 min on 2 cores), so it is built once into a wheel cached under
``~/.cache/inferhal/wheels`` (:data:`WHEELS`, the build command in :data:`BUILD`) and installed from there with
its ``server`` extra when the peer is asked for and the package is missing.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf

from inferhal.core import procs
from inferhal.core.bench.serve import _free_port, _get, _serve_child

WHEELS = Path(os.path.expanduser("~/.cache/inferhal/wheels"))
#: how the cached wheel is built (native flags: AVX-512 on this project's Zen 4 hosts; on an AMX host see
#: docs/performance.md "Building llama-cpp-python on an AMX host")
BUILD = (f'CMAKE_ARGS="-DGGML_NATIVE=ON" nice -n 19 .venv/bin/pip wheel --no-deps -w {WHEELS} '
         f'"llama-cpp-python==0.3.36"')
START_TIMEOUT_S = 600.0


@dataclass
class Server:
    label: str
    url: str  # http://host:port (no /v1)
    kind: str  # inferhal | llama_cpp | url
    proc: Any = None  # the child (a multiprocessing.Process or a subprocess.Popen), None for bench.url
    model: str = ""  # the name clients send
    metrics: bool = False  # /metrics carries inferhal's counters (set once the server answers: has_metrics)

    @property
    def has_metrics(self) -> bool:
        """Whether ``/metrics`` carries inferhal's counters (prefix cache, drafts)."""
        return self.kind != "llama_cpp" and _get(self.url + "/metrics")[1].find("inferhal_prefix_cache") >= 0


def variant_config(cfg: Any, overrides: list[str]) -> Any:
    """``cfg`` (the bench's config) with what ``overrides`` change against the default composition, as a serve
    config."""
    from inferhal.core.config.compose import compose

    base = OmegaConf.to_container(compose([], command="serve", check=False), resolve=True)
    var = OmegaConf.to_container(compose(list(overrides), command="serve"), resolve=True)
    out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    for path, value in _diff(base, var):
        OmegaConf.update(out, path, value, merge=False)
    OmegaConf.update(out, "command", "serve", merge=False)
    return out


def _diff(a: Any, b: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in b:
            out += _diff(a.get(k), b[k], f"{prefix}{k}.")
        return out
    return [] if a == b else [(prefix[:-1], b)]


def _wait(server: Server, path: str, alive) -> Optional[str]:
    """None once ``GET path`` answers 200, else why not (the child died, or the wait timed out)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while _get(server.url + path)[0] != 200:
        if not alive():
            return f"{server.label}: the server exited before it answered {path}"
        if time.monotonic() > deadline:
            return f"{server.label}: no answer on {path} after {START_TIMEOUT_S:.0f} s"
        time.sleep(0.3)
    return None


def start_inferhal(cfg: Any, label: str) -> tuple[Optional[Server], str]:
    """``inferhal serve`` on ``cfg`` in a child process on a free loopback port → (server, '') or (None, why)."""
    port = _free_port()
    proc = procs.context().Process(target=_serve_child, args=(cfg, port), daemon=False)
    proc.start()
    srv = Server(label, f"http://127.0.0.1:{port}", "inferhal", proc,
                 str(cfg.server.served_model_name or cfg.model.name))
    why = _wait(srv, "/health", proc.is_alive)
    if why:
        stop(srv)
        return None, why
    return srv, ""


def running(url: str, model: str) -> tuple[Optional[Server], str]:
    """A server already running at ``url`` (``bench.url``) → (server, '') once ``/v1/models`` answers, else
    (None, why)."""
    srv = Server("url", url.rstrip("/"), "url", None, model)
    code, text = _get(srv.url + "/v1/models")
    return (srv, "") if code == 200 else (None, f"{url}/v1/models answered {code or text}")


def llama_cpp_ready() -> str:
    """'' when llama-cpp-python's server can be imported (installing the cached wheel with its ``server`` extra
    if the package is missing), else why not."""
    if importlib.util.find_spec("llama_cpp") is None:
        wheels = sorted(glob.glob(str(WHEELS / "llama_cpp_python-*.whl")))
        if not wheels:
            return f"llama-cpp-python is not installed and no wheel is cached in {WHEELS}; build one with: {BUILD}"
        got = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", f"{wheels[-1]}[server]"],
                             capture_output=True, text=True)
        if got.returncode != 0:
            return f"installing {wheels[-1]}[server] failed: {got.stderr.strip()[-400:]}"
        importlib.invalidate_caches()
    probe = subprocess.run([sys.executable, "-c", "import llama_cpp.server.app"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"llama_cpp.server does not import: {probe.stderr.strip().splitlines()[-1:]}"
    return ""


def start_llama_cpp(gguf: str, threads: int, n_ctx: int, label: str = "llama_cpp") -> tuple[Optional[Server], str]:
    """llama-cpp-python's OpenAI server on ``gguf`` (its chat template from the file), one request at a time, the
    others queued → (server, '') or (None, why)."""
    why = llama_cpp_ready()
    if why:
        return None, why
    port = _free_port()
    log = open(os.devnull, "w")
    proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--host", "127.0.0.1",
                             "--port", str(port), "--n_threads", str(threads), "--n_threads_batch", str(threads),
                             "--n_ctx", str(n_ctx), "--model_alias", Path(gguf).stem,
                             # its default lets a new request cut the one streaming off: at c > 1 they would
                             # end each other's turns; queued, they are served one at a time
                             "--interrupt_requests", "False"],
                            stdout=log, stderr=subprocess.STDOUT)
    srv = Server(label, f"http://127.0.0.1:{port}", "llama_cpp", proc, Path(gguf).stem)
    why = _wait(srv, "/v1/models", lambda: proc.poll() is None)
    if why:
        stop(srv)
        return None, why
    return srv, ""


def gguf_path(cfg: Any) -> str:
    """The GGUF file ``cfg.model`` names (its family's loader resolves ``model.path`` / ``model.package``)."""
    from inferhal.core.config.schema import ModelConfig
    from inferhal.core.engine.llm import _to

    if str(cfg.model.format) != "gguf":
        raise ValueError(f"model {cfg.model.name} is not a GGUF model (model.format={cfg.model.format})")
    loader = importlib.import_module(f"inferhal.core.models.{cfg.model.family}.loader")
    return str(loader.resolve_path(_to(ModelConfig, cfg.model)))


def stop(server: Optional[Server]) -> Optional[int]:
    """Stop a child server (SIGTERM, then kill after 60 s) → its exit status (None for bench.url)."""
    if server is None or server.proc is None:
        return None
    p = server.proc
    p.terminate()
    if isinstance(p, subprocess.Popen):
        try:
            return p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
            return p.wait()
    p.join(60)
    if p.is_alive():
        p.kill()
        p.join()
    return p.exitcode
