"""Multi-process execution: the launcher (local spawn or torchrun), rank step-sync, and two layouts.

- EP with replicated attention (``parallel=ep2``): :mod:`.ep_moe` (the EP MoE runner), :mod:`.ep_engine`
  (an engine as one EP rank: step hook with StepSync + EPLB).
- DP attention × EP MoE (``parallel=dep2``): :mod:`.dp_moe` (each rank's own tokens through
  ``moe.dispatch``/``moe.combine`` in rounds), :mod:`.dp_engine` (the rank's step hook and the
  :class:`~.dp_engine.DPEngine` front end), :mod:`.dp_frontend` (placing requests by load and prefix),
  :mod:`.dp_graphs` (with ``backend.graphs=true``: one decode graph per step on every rank).

``inferhal generate`` over either (:mod:`.ep_generate`)."""
