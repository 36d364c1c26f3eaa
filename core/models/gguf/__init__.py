"""The base of the GGUF decoder families (Gemma 3, Llama): what every family reads from a GGUF file the same
way. Today: the chat template (:mod:`.chat`).
"""
