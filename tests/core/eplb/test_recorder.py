import pytest
import torch

from inferhal.core.eplb import EplbController, EplbLayout, LoadRecorder, RebalanceTrigger, logical_load
from inferhal.core.eplb.metrics import balancedness
from inferhal.core.eplb.policy import rebalance_experts


def test_counts_over_a_sliding_window():
    rec = LoadRecorder(num_layers=2, num_physical=4, window=2)
    rec.record(0, torch.tensor([[0, 1], [1, -1]]))
    rec.record(1, torch.tensor([[3, 3]]))
    rec.step()
    assert rec.local_load().tolist() == [[1, 2, 0, 0], [0, 0, 0, 2]]
    rec.record(0, torch.tensor([[2]]))
    rec.step()
    rec.record(0, torch.tensor([[2, 2]]))
    rec.step()  # the first step leaves the window
    assert rec.local_load().tolist() == [[0, 0, 3, 0], [0, 0, 0, 0]]
    rec.record(0, torch.tensor([[0]]))  # not counted until step()
    assert rec.local_load()[0, 0] == 0


def test_bad_ids_and_layers_are_rejected():
    rec = LoadRecorder(1, 4, 3)
    with pytest.raises(ValueError, match="physical id 4 outside"):
        rec.record(0, torch.tensor([[4]]))
    with pytest.raises(ValueError, match="layer 1 outside"):
        rec.record(1, torch.tensor([[0]]))
    with pytest.raises(ValueError, match="window must be >= 1"):
        LoadRecorder(1, 4, 0)


class SumComm:
    """Stand-in for an all-reduce over two ranks (the real one is tested in tests/core/parallel)."""

    class layout:
        world_size = 2

    def __init__(self, other):
        self.other = other

    def all_reduce(self, x):
        return x + self.other.local_load()


def test_window_load_sums_ranks_through_the_communicator():
    a, b = LoadRecorder(1, 3, 4), LoadRecorder(1, 3, 4)
    a.record(0, torch.tensor([[0, 1]]))
    b.record(0, torch.tensor([[1, 2]]))
    a.step(), b.step()
    assert a.window_load(SumComm(b)).tolist() == [[1, 2, 1]]


def test_logical_load_folds_replicas():
    phys = torch.tensor([[5, 1, 2, 3]])
    assert logical_load(phys, torch.tensor([[0, 1, 0, 2]]), 3).tolist() == [[7, 1, 3]]


def test_trigger_every_n_and_on_demand():
    t = RebalanceTrigger(step_interval=3)
    fired = []
    for step in range(1, 10):
        if step == 5:
            t.request()
        if t.due(step):
            t.fired(step)
            fired.append(step)
    assert fired == [3, 5, 8]
    never = RebalanceTrigger(step_interval=0)
    assert not any(never.due(s) for s in range(1, 50))
    never.request()
    assert never.due(50)


def test_controller_rebalances_a_skewed_load():
    lay = EplbLayout(num_layers=2, num_logical=8, num_physical=12, num_groups=1, num_nodes=1, num_gpus=4)
    ctl = EplbController(lay, window=4, step_interval=4, policy=rebalance_experts)
    g = torch.Generator().manual_seed(0)
    probs = torch.tensor([20.0, 1, 1, 1, 1, 1, 1, 10])
    results = []
    for _ in range(4):
        for layer in range(2):
            logical = torch.multinomial(probs, 64 * 2, replacement=True, generator=g).view(64, 2)
            ctl.recorder.record(layer, ctl.placement.log2phy[layer, logical, 0])
        results.append(ctl.step())
    assert results[:3] == [None, None, None]
    old, new = results[3]
    assert new is ctl.placement and ctl.recorder.steps == 0
    load = probs.expand(2, 8)
    assert balancedness(load, new.phy2log, new.logcnt, 4) < balancedness(load, old.phy2log, old.logcnt, 4)
    assert int(new.logcnt[0, 0]) >= 2
