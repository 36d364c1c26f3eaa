"""Every config file in conf/ composes and validates against its group's schema."""

from __future__ import annotations

import dataclasses
import importlib.resources as res

import pytest
from omegaconf import OmegaConf

from inferhal.core.cli.main import compose
from inferhal.core.config.errors import ConfigError
from inferhal.core.config.reads import READS, changed, reads
from inferhal.core.config.schema import GROUP_SCHEMAS, InferhalConfig


def _options():
    conf = res.files("inferhal.conf")
    for group in sorted(GROUP_SCHEMAS):
        for f in sorted((conf / group).iterdir(), key=lambda p: p.name):
            if f.name.endswith(".yaml"):
                yield group, f.name[: -len(".yaml")]


OPTIONS = list(_options())


def test_every_group_has_a_directory_and_an_option():
    groups = {g for g, _ in OPTIONS}
    assert groups == set(GROUP_SCHEMAS), set(GROUP_SCHEMAS) - groups


#: shipped options no single command honours as shipped, with a field each names: EPLB needs parallel.ep > 1 (every
#: command refuses it alone); a disaggregated node's tensor parallelism is read by `inferhal plan` only, its role by
#: `inferhal serve` only (core/config/reads.py)
UNHONOURED = {("eplb", "default"): ("generate", "eplb.enabled"),
              ("parallel", "ascend_dsv4_decode_dp8tp2"): ("serve", "parallel.tp"),
              ("parallel", "ascend_dsv4_prefill_dp4tp4"): ("plan", "parallel.role")}


@pytest.fixture(scope="module")
def defaults():
    return compose([], "config")


@pytest.mark.parametrize("group,option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_config_file_composes_and_validates(group, option, defaults):
    """Each option validates against its schema, `inferhal config` shows it, and some command reads every field it
    sets (core/config/reads.py) and composes it as shipped, unless it is listed above."""
    cfg = compose([f"{group}={option}"], check=False)
    obj = OmegaConf.to_object(cfg)  # raises on a missing mandatory value or a wrong type
    assert isinstance(obj, InferhalConfig)
    if group != "experiment":
        assert dataclasses.is_dataclass(getattr(obj, group))
    sets = changed(cfg, defaults)
    honoured_by = [c for c in READS if c != "config" and all(reads(c, p) for p in sets)]
    if (group, option) in UNHONOURED:
        command, field = UNHONOURED[group, option]
        assert field in sets and (not honoured_by or field == "eplb.enabled")
        with pytest.raises(ConfigError, match=field):
            compose([f"{group}={option}"], command)
        return
    compose([f"{group}={option}"])  # `inferhal config` shows it
    assert honoured_by, sets
    compose([f"{group}={option}"], honoured_by[0])  # honoured as shipped


def test_eplb_composes_with_expert_parallelism():
    assert compose(["eplb=default", "parallel=ep2"]).eplb.enabled


def test_default_composition_is_the_reference_backend_and_gemma():
    cfg = compose()
    assert cfg.backend.name == "reference"
    assert cfg.model.name == "gemma3_270m"


@pytest.mark.parametrize("override,needle", [
    ("backend=cuda_sm1OO", "Did you mean backend=cuda_sm100?"),
    ("backend=nope", "Valid choices: ascend950, cpu_amx, cpu_avx512, cuda_sm100, reference"),
    ("scheduler.max_num_seqs=abc", "scheduler.max_num_seqs: 'abc' is not a valid integer"),
    ("scheduler.max_num_seq=4", "Did you mean 'scheduler.max_num_seqs'?"),
    ("promt=hi", "Did you mean 'prompt'?"),
    ("prompt_ids=5", "prompt_ids: expected a list, e.g. prompt_ids=[...], got int"),
])
def test_a_typo_names_the_field_or_option_and_the_choices(override, needle):
    with pytest.raises(ConfigError) as err:
        compose([override])
    assert needle in str(err.value)


def test_target_instantiation_is_refused_outside_the_allow_list():
    from inferhal.core.config.instantiate import InstantiationRefused, instantiate

    with pytest.raises(InstantiationRefused, match="os.system"):
        instantiate({"_target_": "os.system", "command": "true"})
