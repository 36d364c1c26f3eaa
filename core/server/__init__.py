"""``inferhal serve``: an OpenAI-compatible HTTP server over an async engine.

:mod:`.async_engine` runs the engine loop on its own thread; :mod:`.protocol` validates OpenAI request
bodies; :mod:`.app` is the FastAPI app (routes, streaming, errors, API key, body limit); :mod:`.metrics`
the Prometheus metrics; :mod:`.serve` starts uvicorn and handles SIGTERM.
"""
