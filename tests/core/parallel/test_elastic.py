"""Elastic EP (core/parallel/elastic.py) over gloo on 127.0.0.1: three DP attention × EP MoE ranks of the tiny
DeepSeek-V4 with ``eplb.survive_rank_loss`` (18 expert slots, every expert on two ranks); rank 2 exits inside a
forward, ranks 0 and 1 see the step fail, drop its requests (no KV left), re-form a group of two at a new port
with the placement minus rank 2's slots, and then give the single process's greedy tokens (logprobs within
1e-5) for the same requests placed again, and for a later batch. A second loss, which the 12 slots left cannot
cover, is refused before anything changes. With two ranks and 16 slots, the one left goes on alone (a group of
one) with the single process's tokens."""

import sys

import pytest
import torch

from inferhal.core.parallel.launch import free_port, spawn_from_file

import by_file  # tests/core/parallel (conftest puts it on the path)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("elastic")
    sys.path.insert(0, by_file.HERE)
    spawn_from_file(by_file.path_of("elastic_workers"), "survivors", 3, str(out), free_port())
    assert not (out / "rank2.pt").exists()
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def want():
    from inferhal.core.engine.llm import LLM

    wk = by_file.load("dp_workers")
    llm = LLM.from_config(wk.tiny_cfg())
    return wk.run(llm, [wk.PROMPTS], "greedy"), wk.run(llm, [wk.SECOND], "greedy")


def test_survivors_of_a_covered_loss_give_the_single_process_tokens(ranks, want):
    for rank in ranks:
        assert rank["covered"] == [True, True, True]
        assert "did not answer" in rank["failed"]  # the step failed where rank 2 was missing
        for got, ref in ((rank["res"], want[0]), (rank["after"], want[1])):
            assert [g["tokens"] for g in got] == [w["tokens"] for w in ref]
            for g, w in zip(got, ref):
                assert g["logprobs"] == pytest.approx(w["logprobs"], abs=1e-5)


def test_the_survivors_drop_every_request_and_re_form_with_their_own_slots(ranks):
    for me, rank in enumerate(ranks):
        held, blocks = rank["held"]
        assert held > 0 and blocks > 0 and rank["shrink"]["dropped"] == held  # the torn step's requests
        assert rank["shrink"]["rank"] == me and rank["shrink"]["world_size"] == 2
        assert rank["kv_after"] == (0, 0)  # no block, no request held after the drop
        before, after, ep = rank["placement"]
        assert ep == 2 and torch.equal(after, before[:, :12])  # rank 2's slots 12..17 gone, 0..11 kept in order
    assert ranks[0]["shrink"]["placement"] == ranks[1]["shrink"]["placement"]
    assert [s for s, _ in ranks[0]["log"]][:1] == [1]  # the step counters started again


def test_a_loss_the_placement_left_cannot_cover_is_refused_before_anything_changes(ranks):
    for me, rank in enumerate(ranks):
        assert f"losing EP rank(s) [{1 - me}] of 2 leaves layer" in rank["second"]


def test_the_last_survivor_goes_on_alone(tmp_path, want):
    spawn_from_file(by_file.path_of("elastic_workers"), "last_survivor", 2, str(tmp_path), free_port())
    got = torch.load(tmp_path / "alone.pt", weights_only=False)
    assert "did not answer" in got["failed"]
    assert got["shrink"]["world_size"] == 1 and got["shrink"]["rank"] == 0 and got["shrink"]["dropped"] > 0
    assert [g["tokens"] for g in got["res"]] == [w["tokens"] for w in want[0]]
    for g, w in zip(got["res"], want[0]):
        assert g["logprobs"] == pytest.approx(w["logprobs"], abs=1e-5)
