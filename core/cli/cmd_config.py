"""``inferhal config [overrides]``: print the composed config as YAML.

With data-parallel attention (``parallel.dp > 1``) each DP rank runs its own scheduler, so the scheduler's
limits hold per rank: the printed lines of those fields carry a YAML comment saying so and what they add up to
over the ranks (the YAML still reads back as the same config)."""

from __future__ import annotations

from omegaconf import OmegaConf

#: scheduler fields that hold per DP rank -> what they bound
PER_RANK = {"max_num_seqs": "sequences", "max_num_batched_tokens": "tokens per step"}


def per_rank_notes(text: str, dp: int) -> str:
    """``text`` (the config as YAML) with a comment on each :data:`PER_RANK` field of ``scheduler`` when
    ``dp > 1``."""
    if dp <= 1:
        return text
    out, section = [], None
    for line in text.splitlines(keepends=True):
        if line[:1] not in (" ", ""):
            section = line.split(":", 1)[0]
        elif section == "scheduler" and line.startswith("  ") and line[2:3] != " ":
            key, _, value = line.strip().partition(": ")
            if key in PER_RANK and value.isdigit():
                line = f"{line.rstrip()}  # per DP rank (parallel.dp={dp}): up to {dp * int(value)} {PER_RANK[key]} in all\n"
        out.append(line)
    return "".join(out)


def run(cfg, words) -> int:
    print(per_rank_notes(OmegaConf.to_yaml(cfg), int(cfg.parallel.dp)), end="")
    return 0
