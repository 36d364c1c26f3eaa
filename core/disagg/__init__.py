"""Prefill/decode disaggregation: the KV connector contract (:mod:`.connector`), the hand-off of a request
from a prefill engine to a decode engine (:mod:`.handoff`), both engines in one process (:mod:`.local`), and
``inferhal serve parallel.role=pd``: a router (:mod:`.router`) over a prefill and a decode process
(:mod:`.workers`)."""
