"""Structured configs: dataclass schemas in Hydra's ConfigStore (:mod:`.schema`), composition (:mod:`.compose`)."""
