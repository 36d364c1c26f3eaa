"""One table decides what each command reads (core/config/reads.py): every command refuses, by name, each field
it does not read and accepts each field it does; the table covers every command and every schema field; what
the default composition sets never counts as the user's."""

from __future__ import annotations

import copy
import dataclasses
import re
import typing

import pytest
from omegaconf import OmegaConf

from inferhal.core.cli import main as cli
from inferhal.core.config import refusals, schema
from inferhal.core.config.errors import ConfigError
from inferhal.core.config.reads import ALWAYS, HINTS, READS, SETS, WHY, covers, leaves, reads, who

COMMANDS = sorted(READS)

#: a value each field can take at compose that is not its default (None: derive it from the field's type)
SPECIAL = {"cache.kv_dtype": "fp8", "log_level": "INFO", "eplb.policy": "greedy", "server.host": "0.0.0.0",
           "messages": [{"role": "user", "content": "hi"}], "sampling.structured": {"json_object": True},
           "model.arch": {"hidden_size": 64}, "backend.options": {"torch_device": "cpu"},
           "model.max_model_len": 2048}


@pytest.fixture(scope="module")
def defaults():
    return cli.compose([], "config")


def _annotation(path: str):
    node = schema.InferhalConfig
    *parents, name = path.split(".")
    for part in parents:
        node = typing.get_type_hints(node)[part]
    return typing.get_type_hints(node)[name]


def other_value(path: str, default):
    """A value of ``path``'s type that differs from ``default`` and that compose accepts."""
    if path in SPECIAL:
        return SPECIAL[path]
    kind = _annotation(path)
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    base = args[0] if typing.get_origin(kind) is typing.Union else kind
    if base is bool:
        return not default
    if base is int:
        return (default or 0) + 2  # parallel.ep and parallel.dp both 3: a DP x EP layout, as tbo needs
    if base is float:
        return (default or 0.0) + 0.05  # inside every range checked at compose
    if typing.get_origin(base) is list:
        item = typing.get_args(base)[0]
        return {int: [7], float: [0.7]}.get(item, ["127.0.0.1:1"])
    if typing.get_origin(base) is dict:
        item = typing.get_args(base)[1]
        return {"other": [] if typing.get_origin(item) is list else 1}
    return "something"


def set_fields(defaults, command: str, paths) -> tuple:
    """(cfg, the values set): the default composition as ``command``, with each of ``paths`` away from its default."""
    cfg = copy.deepcopy(defaults)
    cfg.command = command
    values = {}
    for p in paths:
        values[p] = other_value(p, OmegaConf.select(defaults, p))
        OmegaConf.update(cfg, p, values[p], merge=False)
        assert OmegaConf.select(cfg, p) != OmegaConf.select(defaults, p), p  # nothing here passes vacuously
    return cfg, values


def test_generate_refuses_a_server_port_by_name(capsys):
    assert cli.main(["generate", "server.port=9000"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("inferhal: server.port=9000 is refused by `inferhal generate`, which does not read it "
                          "(serve reads it)") and "Traceback" not in err


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_accepts_every_field_it_reads(command, defaults):
    """Each field the command declares, away from its default at once, composes (the check compose runs)."""
    paths = [p for p in leaves() if reads(command, p) and p != "command" and p not in refusals.REFUSED]
    assert paths, f"{command} reads nothing"
    cfg, _ = set_fields(defaults, command, paths)
    refusals.check(cfg, paths, defaults)


@pytest.mark.parametrize("command", [c for c in COMMANDS if c != "config"])
def test_every_command_refuses_each_field_it_does_not_read_by_name(command, defaults):
    paths = [p for p in leaves() if not reads(command, p)]
    cfg, values = set_fields(defaults, command, paths)
    with pytest.raises(ConfigError) as err:
        refusals.check(cfg, paths, defaults)
    msg = str(err.value)
    for p in paths:
        assert f"{p}=" in msg, p
    assert f"refused by {who(command)}" in msg


@pytest.mark.parametrize("command", ["generate", "serve", "plan kv", "bench e2e", "bench eplb", "LLM"])
def test_a_group_choice_that_changes_an_unread_group_is_refused(command):
    """``server=NAME`` or ``parallel=NAME`` counts by the fields it changes; the YAML defaults never count."""
    cli.compose(["server=default", "eplb=disabled", "parallel=single", "model=gemma3_270m"], command)
    unread = {"generate": "qualify=full", "serve": "qualify=full", "plan kv": "parallel=dep2",
              "bench e2e": "parallel=dep2", "bench eplb": "model=deepseek_v4_tiny", "LLM": "qualify=full"}[command]
    with pytest.raises(ConfigError, match=rf"refused by {re.escape(who(command))}"):
        cli.compose([unread], command)


def test_a_value_equal_to_the_default_is_not_the_users():
    assert cli.compose(["server.port=8000", "sampling.max_tokens=64"], "plan kv").server.port == 8000


def test_the_python_api_keyword_options_are_checked_as_llm():
    with pytest.raises(ConfigError, match=r"sampling.max_tokens=5 is refused by LLM\(\.\.\.\), which does not read it "
                                          r"\(generate reads it\)"):
        cli.compose([], "LLM", updates={"sampling.max_tokens": 5})
    assert cli.compose([], "LLM", updates={"scheduler.max_num_seqs": 5}).scheduler.max_num_seqs == 5


def test_a_field_a_command_sets_itself_says_so():
    with pytest.raises(ConfigError, match=r"scheduler.max_num_seqs=3 is refused by `inferhal bench e2e`, which sets it "
                                          r"itself \(the largest bench.concurrency level\)"):
        cli.compose(["scheduler.max_num_seqs=3"], "bench e2e")
    with pytest.raises(ConfigError, match=r"output='r.json' is refused by `inferhal qualify`.*qualify writes its report "
                                          r"under qualify.output_dir"):
        cli.compose(["output=r.json"], "qualify")


def test_unknown_words_are_left_to_the_command():
    assert cli.compose(["server.port=9000"], "bench nope").server.port == 9000


# -- the table itself --------------------------------------------------------------------------------------

def test_the_table_covers_every_command_and_subcommand():
    from inferhal.core.cli.cmd_bench import kinds
    from inferhal.core.cli.cmd_plan import SUBCOMMANDS

    heads = {c.split(" ")[0] for c in READS} - {"LLM"}
    assert heads == set(cli.commands()), "declare what each command reads in core/config/reads.py: READS"
    declared, found = {c for c in READS if c.startswith("bench ")}, {f"bench {k}" for k in kinds()}
    assert found <= declared, f"declare what {sorted(found - declared)} read in core/config/reads.py: READS"
    assert declared <= found, f"{sorted(declared - found)} are no benchmark any more: drop them from READS"
    assert {c for c in READS if c.split(" ")[0] == "plan"} == {f"plan {s}".strip() for s in SUBCOMMANDS}
    assert [c for c in READS if c.startswith("kernels")] == ["kernels compile"]  # cmd_kernels: compile only


def test_every_schema_field_is_read_by_some_command_or_refused_by_all():
    """A field only `inferhal config` shows would be read nowhere: give it a reader or list it in REFUSED."""
    for path in leaves():
        readers = [c for c in READS if c != "config" and reads(c, path)]
        assert readers or path in refusals.REFUSED, f"{path}: read by no command (core/config/reads.py: READS)"
        assert not (readers and path in refusals.REFUSED), f"{path} is read by {readers}: drop it from REFUSED"


def test_every_group_and_root_field_is_named_by_some_entry():
    names = {e.split(".")[0] for c, es in READS.items() if c != "config" for e in es} | set(ALWAYS)
    groups = {f.name for f in dataclasses.fields(schema.InferhalConfig)}
    assert set(schema.GROUP_SCHEMAS) <= groups
    assert groups - names == {"experiment"}  # refused until something records it


def test_every_entry_names_schema_fields():
    every = set(leaves())
    prefixes = {p.rsplit(".", i)[0] for p in every for i in range(p.count(".") + 1)}
    entries = {e for es in READS.values() for e in es if e != "*"}
    named = entries | {p for s in SETS.values() for p in s} | set(WHY) | {p for _, p in HINTS}
    assert named <= prefixes, named - prefixes
    for command, fields in SETS.items():  # a field a command sets is in a group it reads
        assert all(covers(READS[command], p) for p in fields), command
    assert all(c in READS for c, _ in HINTS) and all(c in READS for c in SETS)
