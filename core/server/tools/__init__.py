"""Tool calling and reasoning output for the server: each model family's tool-call format as data
(:mod:`.hermes` for the Llama/SmolLM2 and Gemma families, :mod:`.dsml` for DeepSeek-V4) with its incremental
parser, and the ``<think>`` splitter (:mod:`.reasoning`).

Every parser is incremental and cut-invariant: feeding a text in any split into deltas yields the same
content, calls and reasoning as feeding it whole (tests/core/server/tools: hypothesis over random cuts).
"""
