"""Tool calling and reasoning output for the server: each model family's tool-call format as data
(:mod:`.formats`: :mod:`.hermes` for the Llama/SmolLM2 and Gemma families, :mod:`.dsml` for DeepSeek-V4)
with its incremental parser, the ``<think>`` splitter (:mod:`.reasoning`) and the two composed per choice
(:mod:`.choice`), a request's tools checked (:mod:`.spec`), the prompt rendering of tools, calls and tool
results (:mod:`.prompt`), and the xgrammar constraint behind ``tool_choice=required`` or a named function
(:mod:`.constrain`).

Every parser is incremental and cut-invariant: feeding a text in any split into deltas yields the same
content, calls and reasoning as feeding it whole (tests/core/server/tools: hypothesis over random cuts).
"""
