"""``inferhal config`` (core/cli/cmd_config.py): with ``parallel.dp > 1`` the scheduler's per-rank limits say so in
the printed YAML, which still reads back as the composed config."""

from __future__ import annotations

import yaml

from inferhal.core.cli.cmd_config import per_rank_notes
from inferhal.core.cli.main import compose, main


def printed(capsys, *over):
    assert main(["config", *over]) == 0
    return capsys.readouterr().out


def test_dp_ranks_show_the_per_rank_meaning_of_max_num_seqs(capsys):
    out = printed(capsys, "parallel=dep2", "scheduler.max_num_seqs=8")
    lines = out.splitlines()
    sched = lines.index("scheduler:")
    assert "  max_num_seqs: 8  # per DP rank (parallel.dp=2): up to 16 sequences in all" in lines[sched:]
    assert "  max_num_batched_tokens: 2048  # per DP rank (parallel.dp=2): up to 4096 tokens per step in all" \
        in lines[sched:]
    assert out.count("per DP rank") == 2
    from omegaconf import OmegaConf

    want = OmegaConf.to_container(compose(["parallel=dep2", "scheduler.max_num_seqs=8"], "config"))
    assert yaml.safe_load(out) == want  # comments only


def test_one_engine_prints_no_note(capsys):
    assert "per DP rank" not in printed(capsys, "scheduler.max_num_seqs=8")


def test_only_the_scheduler_sections_fields_get_the_note():
    text = "bench:\n  max_num_seqs: 3\nscheduler:\n  nested:\n    max_num_seqs: 5\n  max_num_seqs: 4\n"
    assert per_rank_notes(text, 4) == ("bench:\n  max_num_seqs: 3\nscheduler:\n  nested:\n    max_num_seqs: 5\n"
                                       "  max_num_seqs: 4  # per DP rank (parallel.dp=4): up to 16 sequences in all\n")
    assert per_rank_notes(text, 1) == text
