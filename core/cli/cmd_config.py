"""``inferhal config [overrides]``: print the composed config as YAML."""

from __future__ import annotations

from omegaconf import OmegaConf


def run(cfg, words) -> int:
    print(OmegaConf.to_yaml(cfg), end="")
    return 0
