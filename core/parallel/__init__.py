"""Multi-process execution: the EP launcher (local spawn or torchrun), rank step-sync, the EP MoE runner,
an engine as one EP rank (:mod:`.ep_engine`: step hook with StepSync + EPLB) and ``inferhal generate``
over EP ranks (:mod:`.ep_generate`)."""
