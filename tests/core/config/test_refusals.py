"""Every config field is honoured or refused: a schema field that no source file reads must be listed in
``core/config/refusals.py``, and a listed field set away from its default is refused, by the CLI and by
``LLM(...)``, with the field named. (Which command reads which field: test_reads.py.)"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import re
import typing

import pytest

import inferhal
from inferhal.core.cli.main import compose, main
from inferhal.core.config import schema
from inferhal.core.config.errors import ConfigError
from inferhal.core.config.refusals import REFUSED, default_of

ROOT = pathlib.Path(inferhal.__file__).resolve().parent
SOURCES = ("core", "backends", "kernels")
SCHEMA_FILE = ROOT / "core" / "config" / "schema.py"


def read_names() -> set[str]:
    """Every name the package's source reads as a field: ``x.name``, ``x["name"]``, ``x.get("name")``,
    ``getattr(x, "name")``, ``hasattr(x, "name")``. The schema itself and the tests do not count."""
    names: set[str] = set()
    for top in SOURCES:
        for path in (ROOT / top).rglob("*.py"):
            if path.resolve() == SCHEMA_FILE:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Attribute):
                    names.add(node.attr)
                elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
                    names.add(str(node.slice.value))
                elif isinstance(node, ast.Call) and node.args:
                    fn = node.func
                    fname = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
                    key = {"get": 0, "pop": 0, "setdefault": 0, "select": 1, "getattr": 1, "hasattr": 1}.get(fname)
                    if key is not None and len(node.args) > key and isinstance(node.args[key], ast.Constant):
                        names.add(str(node.args[key].value).rsplit(".", 1)[-1])
    return names


def schema_fields(root=schema.InferhalConfig, prefix: str = "") -> list[str]:
    """Dotted paths of every leaf field of ``root`` and of the dataclasses (config groups) nested in it."""
    hints = typing.get_type_hints(root)
    out = []
    for f in dataclasses.fields(root):
        path = prefix + f.name
        out += schema_fields(hints[f.name], path + ".") if dataclasses.is_dataclass(hints[f.name]) else [path]
    return out


def unread(fields: list[str], names: set[str]) -> list[str]:
    return [p for p in fields if p.rsplit(".", 1)[-1] not in names and p not in REFUSED]


@pytest.fixture(scope="module")
def names():
    return read_names()


def test_every_schema_field_is_read_somewhere_or_refused(names):
    """A field nothing reads is a lie: give it code that reads it, or list it in REFUSED until then."""
    assert unread(schema_fields(), names) == []


def test_a_new_unread_field_is_found(names):
    @dataclasses.dataclass
    class WithAnUnreadField:
        block_size: int = 16
        frobnication_level: int = 0

    assert unread(schema_fields(WithAnUnreadField), names) == ["frobnication_level"]


def test_refused_entries_are_schema_fields():
    fields = set(schema_fields())
    assert set(REFUSED) <= fields
    assert default_of("cache.kv_dtype") == "auto" and default_of("server.served_model_name") is None


def _other_value(path: str):
    default = default_of(path)
    if isinstance(default, bool):
        return str(not default).lower()
    if isinstance(default, int):
        return str(default + 3)
    return "fp8" if path == "cache.kv_dtype" else "something"


@pytest.mark.parametrize("path", sorted(REFUSED))
def test_a_refused_field_away_from_its_default_names_the_field(path):
    with pytest.raises(ConfigError, match=rf"{path}=.* is refused \(not honoured yet"):
        compose([f"{path}={_other_value(path)}"])
    compose([f"{path}={default_of(path) if default_of(path) is not None else 'null'}"])  # its default is fine


def test_the_shipped_defaults_are_all_honoured():
    compose([])


def test_several_refused_fields_are_listed_together_with_where_they_come_from():
    with pytest.raises(ConfigError) as err:
        compose(["parallel=ascend_dsv4_prefill_dp4tp4", "server.port=1"], "generate")
    msg = str(err.value)
    assert "3 config fields are refused" in msg
    assert "parallel.tp=4 is refused by `inferhal generate`" in msg and "parallel.role='prefill'" in msg
    assert "server.port=1" in msg
    assert "a config option such as parallel=NAME" in msg


def test_eplb_needs_expert_parallelism():
    with pytest.raises(ConfigError, match=r"eplb.enabled=True is refused with parallel.ep=1"):
        compose(["eplb=default"])
    assert compose(["eplb=default", "parallel=ep2"]).eplb.enabled


@pytest.mark.parametrize("override,key,where", [("+sampling.bogus=3", "bogus", "in sampling"),
                                                ("++cache.foo=2", "foo", "in cache"),
                                                ("+bogus=1", "bogus", "in the root config"),
                                                ("+model.quant.x=1", "quant", "in model")])
def test_a_field_added_with_plus_is_refused_naming_it(override, key, where):
    """Hydra's '+key=value' adds a key that 'key=value' refuses as a typo: nothing would read it."""
    with pytest.raises(ConfigError, match=rf"unknown config field '{key}' {where} \(added with '\+'\): nothing reads it"):
        compose([override])


@pytest.mark.parametrize("override,needle", [
    ("model.max_model_len=1", "model.max_model_len must be >= 2"),
    ("cache.memory_fraction=2", "cache.memory_fraction must be in (0, 1]"),
    ("cache.memory_fraction=0", "cache.memory_fraction must be in (0, 1]"),
    ("cache.kv_cache_bytes=-1", "cache.kv_cache_bytes must be >= 0"),
    ("cache.num_blocks=-4", "cache.num_blocks must be >= 0"),
    ("cache.auto_kv_cap_bytes=-1", "cache.auto_kv_cap_bytes must be >= 0"),
    ("scheduler.long_prefill_token_threshold=-3", "scheduler.long_prefill_token_threshold must be >= 0"),
    ("parallel.timeout_s=0", "parallel.timeout_s=0 must be > 0"),
    ("log_level=LOUD", "log_level must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL, got 'LOUD'"),
    ("eplb.window_size=0", "eplb.window_size must be >= 1"),  # was a traceback in each EP rank
    ("eplb.policy=magic", "eplb.policy='magic' is unknown; choose one of greedy, inferhal"),
    ("eplb.drift=-1", "eplb.drift=-1.0: drift must be a number in [0, 10)"),
    ("server.host=", "server.host must be an address to listen on"),  # printed http://:PORT and listened anyway
])
def test_a_value_out_of_its_range_is_refused_for_every_command(override, needle):
    for command in ("generate", "plan kv", "config"):
        with pytest.raises(ConfigError, match=re.escape(needle)):
            compose([override], command)


def test_every_range_is_a_schema_field_and_its_default_is_in_range():
    from inferhal.core.config.refusals import RANGES

    for path, (ok, _) in RANGES.items():
        assert ok(default_of(path)), path


def test_free_form_mappings_and_root_fields_may_still_be_set_with_plus():
    cfg = compose(["+backend.options.torch_device=cpu", "+model.arch.vocab_size=7", "+output=x.json"])
    assert cfg.backend.options.torch_device == "cpu" and cfg.model.arch.vocab_size == 7 and cfg.output == "x.json"


def test_the_cli_refuses_cleanly_before_anything_runs(capsys):
    assert main(["generate", "parallel.tp=2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("inferhal: parallel.tp=2 is refused") and "Traceback" not in err
    assert "a config option" not in err  # the user set it on the command line


def test_the_python_api_refuses_keyword_options_before_loading(monkeypatch):
    from inferhal import LLM
    from inferhal.core.models import registry

    monkeypatch.setattr(registry, "load_model", lambda *a: pytest.fail("loaded a model for a refused config"))
    with pytest.raises(ConfigError, match="parallel.tp=2 is refused"):
        LLM("deepseek_v4_tiny", overrides=["parallel.tp=2"])
    with pytest.raises(ConfigError, match="cache.kv_dtype='fp6' is not a KV format: use one of auto, fp8, fp4"):
        LLM("deepseek_v4_tiny", kv_dtype="fp6")
    with pytest.raises(ConfigError, match="experiment.name='x' is refused"):
        LLM("deepseek_v4_tiny", overrides=["experiment.name=x"])
