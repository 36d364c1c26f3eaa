"""MTP draft logits (transformers has no MTP: checked against this model's own paths) and the
expert-load recorder hook."""

from __future__ import annotations

import torch

from inferhal.core.config.schema import ModelConfig
from inferhal.core.models.base import ForwardBatch
from inferhal.core.models.deepseek_v4.loader import load
from inferhal.core.models.deepseek_v4.make_checkpoint import _arch_of

ARCH = _arch_of("tiny")
IDS = list(range(3, 43))


def _model(backend):
    return load(ModelConfig(name="t", family="deepseek_v4", format="random", arch=ARCH, seed=5), backend).model


def _mtp(model, drv, seq_ids, next_ids):
    """One main step then the MTP step over the same positions; all rows' draft logits."""
    b = drv.batch({0: seq_ids})
    hidden = model.forward_hidden(b, drv.kv)
    mb = ForwardBatch(torch.tensor(next_ids), b.positions, b.query_start_loc, b.attn, torch.arange(len(next_ids)))
    out = model.forward_mtp(mb, drv.kv, hidden)
    drv.computed[0] = drv.computed.get(0, 0) + len(seq_ids)
    return out, hidden


def test_mtp_incremental_matches_full_and_uses_its_inputs(reference_backend, v4):
    model = _model(reference_backend)
    assert model.num_mtp_layers == 1
    seq, nxt = IDS[:-1], IDS[1:]
    full, hidden = _mtp(model, v4.PagedDriver(model), seq, nxt)
    assert full.shape == (len(seq), ARCH["vocab_size"]) and torch.isfinite(full).all()
    # decode one position at a time through the paged cache: same draft logits
    drv = v4.PagedDriver(model)
    first, _ = _mtp(model, drv, seq[:20], nxt[:20])
    rows = [first]
    for i in range(20, len(seq)):
        r, _ = _mtp(model, drv, [seq[i]], [nxt[i]])
        rows.append(r)
    assert (torch.cat(rows) - full).abs().max().item() < 1e-4
    # the draft depends on the next token (embedding path) and on the main hidden state (h path)
    other, _ = _mtp(model, v4.PagedDriver(model), seq, [(t + 1) % ARCH["vocab_size"] for t in nxt])
    assert (other - full).abs().max().item() > 1e-3
    # the main logits are unchanged by running MTP in the same cache
    main = v4.PagedDriver(model).step({0: seq}, all_logits=True)
    assert (model.head("", hidden) - main).abs().max().item() < 1e-5


class Counter:
    def __init__(self, num_experts):
        self.counts: dict[int, torch.Tensor] = {}
        self.e = num_experts

    def record(self, layer, ids):
        c = self.counts.setdefault(layer, torch.zeros(self.e, dtype=torch.long))
        c += torch.bincount(ids.flatten(), minlength=self.e)


def test_expert_load_recorder_counts_tokens_per_layer_and_expert(reference_backend, v4):
    from inferhal.core.models.deepseek_v4.model import ExpertLoadRecorder

    model = _model(reference_backend)
    rec = Counter(ARCH["n_routed_experts"])
    assert isinstance(rec, ExpertLoadRecorder)
    model.recorder = rec
    v4.PagedDriver(model).step({0: IDS})
    k = ARCH["num_experts_per_tok"]
    assert sorted(rec.counts) == list(range(ARCH["num_hidden_layers"]))
    for layer, c in rec.counts.items():
        assert int(c.sum()) == len(IDS) * k
    # layer 0 is hash-routed: its counts are exactly the tid2eid table's rows of the prompt
    tid2eid = model.weights["layers.0.mlp.gate.tid2eid"]
    want = torch.bincount(tid2eid[torch.tensor(IDS)].flatten(), minlength=ARCH["n_routed_experts"])
    assert torch.equal(rec.counts[0], want)
