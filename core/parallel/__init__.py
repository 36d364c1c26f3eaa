"""Multi-process execution: the EP launcher (local spawn or torchrun), rank step-sync, the EP MoE runner."""
