"""Prefill/decode disaggregation: the KV connector contract (:mod:`.connector`) and the hand-off of a
request from a prefill engine to a decode engine (:mod:`.handoff`)."""
