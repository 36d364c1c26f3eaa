"""Fit a tiny DeepSeek-V4's MTP layer to the model's own greedy continuations, so that drafting has
something to accept (a random MTP head accepts almost nothing).

    python -m inferhal.core.bench.fit_mtp OUT.safetensors [--model deepseek_v4_tiny]
        [--seqs 768] [--len 64] [--steps 500] [--lr 5e-3] [--seed 0]

Random prompts are continued greedily by the main model (weights frozen); the MTP layer learns, at every
position ``p``, the token at ``p + 2`` from the main model's final streams at ``p`` and the token at
``p + 1`` (cross-entropy against the main model's greedy token, AdamW), plus the same one position on from its own output streams (how a
chained draft uses it, k > 1). Products run through ``F.linear`` (``INFERHAL_PORTABLE_CPU=1``: oneDNN's
packed products have no autograd). Writes the ``mtp.*`` tensors with the held-out top-1 accuracy of the
first and chained draft in the file's metadata; ``model.mtp_weights`` lays them over the model
(``conf/model/deepseek_v4_tiny_mtp.yaml``). A few minutes on two CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("INFERHAL_PORTABLE_CPU", "1")

import torch  # noqa: E402


def _slices(eng, seqs, rid0):
    kvm = eng.kv_manager
    out = []
    for i, ids in enumerate(seqs):
        rid = f"{rid0}{i}"
        if not kvm.allocate(rid, 0, len(ids)):
            raise RuntimeError("fit_mtp: the KV pool is too small for the batch")
        out.append((rid, kvm.block_ids(rid)))
    return out


def hidden_of(eng, seqs, chunk: int = 32):
    """The main model's final streams of every position and its greedy token after each, per sequence
    (no grad): ``[(streams [L, N, D], greedy [L])]``."""
    if len(seqs) > chunk:
        return [h for i in range(0, len(seqs), chunk) for h in hidden_of(eng, seqs[i:i + chunk], chunk)]
    from inferhal.core.models.base import ForwardBatch
    from inferhal.core.paging.batch import SeqSlice, build_attn_batches

    tabs = _slices(eng, seqs, "h")
    try:
        sl = [SeqSlice(0, len(ids), b) for ids, (_, b) in zip(seqs, tabs)]
        pos, qsl, attn = build_attn_batches(eng.specs, eng.kv_manager.block_size, sl)
        ids = torch.tensor([t for s in seqs for t in s])
        with torch.no_grad():
            every = torch.arange(len(ids))
            top, hid = eng.model.forward_and_hidden(ForwardBatch(ids, pos, qsl, attn, every), eng.kv_storage, greedy=True)
        lens = [len(s) for s in seqs]
        return list(zip(hid.split(lens), top.split(lens)))
    finally:
        for rid, _ in tabs:
            eng.kv_manager.free(rid)


def mtp_losses(eng, seqs, hidden):
    """(loss of the first draft, loss of a chained draft, their top-1 hits and counts) over ``seqs``. The
    target at position ``p`` is the main model's greedy token after ``p + 1`` (what verification keeps),
    also inside the prompt, where the next prompt token is noise to a drafter."""
    from inferhal.core.paging.batch import SeqSlice

    from inferhal.core.paging import planning

    prop, model = eng.proposer, eng.model
    # a fresh drafter cache per call: written with values that carry gradients, it joins the graph
    kv = eng.backend.kv_storage(planning.storage_request([prop.group], eng.kv_manager.block_size,
                                                         {"mtp": eng.kv_manager.num_blocks["mtp"]}))
    tabs = _slices(eng, seqs, "m")
    try:
        n = [len(s) - 2 for s in seqs]  # positions p with a token at p + 2
        sl = [SeqSlice(0, k, {"mtp": b["mtp"]}) for k, (_, b) in zip(n, tabs)]
        nxt = [t for s in seqs for t in s[1:-1]]
        tgt = torch.cat([g[1:-1] for _, g in hidden])
        streams = prop._run(sl, nxt, torch.cat([h[:k] for (h, _), k in zip(hidden, n)]), 0, kv)
        logits = model.mtp_head(streams, 0, greedy=False)
        first = torch.nn.functional.cross_entropy(logits, tgt)
        # chained: position p + 1 from the MTP's own streams at p and the (true) token at p + 2 -> p + 3
        m = [k - 1 for k in n]
        own = torch.cat([x[:k] for x, k in zip(streams.split(n), m)])
        sl2 = [SeqSlice(1, k, {"mtp": b["mtp"]}) for k, (_, b) in zip(m, tabs)]
        nxt2 = [t for s in seqs for t in s[2:-1]]
        tgt2 = torch.cat([g[2:-1] for _, g in hidden])
        layer = min(1, prop.num_mtp_layers - 1)
        logits2 = model.mtp_head(prop._run(sl2, nxt2, own, layer, kv), layer, greedy=False)
        chained = torch.nn.functional.cross_entropy(logits2, tgt2)
        hits = (int((logits.argmax(-1) == tgt).sum()), len(tgt), int((logits2.argmax(-1) == tgt2).sum()), len(tgt2))
        return first, chained, hits
    finally:
        for rid, _ in tabs:
            eng.kv_manager.free(rid)


def _say(*a) -> None:
    print(*a, flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--model", default="deepseek_v4_tiny")
    ap.add_argument("--seqs", type=int, default=768)
    ap.add_argument("--len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-every", type=int, default=0, help="also write the tensors every N steps")
    a = ap.parse_args(argv)
    from safetensors.torch import save_file

    from inferhal import LLM, SamplingParams
    from inferhal.core.engine.llm import compose_config

    torch.manual_seed(a.seed)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    t0 = time.time()
    plain = LLM.from_config(compose_config(a.model, "reference", overrides=[
        f"cache.num_blocks={8 * a.seqs}", f"scheduler.max_num_seqs={a.seqs}",
        f"scheduler.max_num_batched_tokens={8 * a.seqs}"]))  # the continuations, in one batch, without drafting
    vocab = plain.engine.model.vocab_size
    prompts = [torch.randint(3, vocab, (8,)).tolist() for _ in range(a.seqs)]
    outs = plain.generate(prompts, SamplingParams(max_tokens=a.len - 8, temperature=0.0, ignore_eos=True))
    del plain
    llm = LLM.from_config(compose_config(a.model, "reference", overrides=[
        "spec=mtp", "spec.num_speculative_tokens=1", "cache.num_blocks=1024", "scheduler.max_num_seqs=64"]))
    eng = llm.engine
    model = eng.model
    seqs = [o.prompt_token_ids + o.token_ids for o in outs]
    held, train = seqs[: a.seqs // 8], seqs[a.seqs // 8:]
    hid_train = hidden_of(eng, train)
    hid_held = hidden_of(eng, held)
    _say(f"fit_mtp: {len(train)} + {len(held)} greedy sequences of {a.len} tokens in {time.time() - t0:.0f} s")
    params = {k: v.detach().clone().requires_grad_(v.is_floating_point())
              for k, v in model.weights.items() if k.startswith("mtp.")}
    model.load_mtp_weights(params)
    opt = torch.optim.AdamW([p for p in params.values() if p.requires_grad], lr=a.lr, weight_decay=0.01)

    def evaluate(chunk=128):
        tot = [0, 0, 0, 0]
        with torch.no_grad():
            for i in range(0, len(held), chunk):
                _, _, hits = mtp_losses(eng, held[i:i + chunk], hid_held[i:i + chunk])
                tot = [a + b for a, b in zip(tot, hits)]
        return tot[0] / tot[1], tot[2] / tot[3]

    before = evaluate()
    for step in range(a.steps):
        idx = torch.randint(0, len(train), (a.batch,)).tolist()
        first, chained, _ = mtp_losses(eng, [train[i] for i in idx], [hid_train[i] for i in idx])
        loss = first + 0.5 * chained
        opt.zero_grad()
        loss.backward()
        opt.step()
        model.load_mtp_weights(params)  # the derived per-layer weights follow the updated ones
        if a.save_every and step and step % a.save_every == 0:
            save_file({k: v.detach().contiguous() for k, v in params.items()}, a.out)  # progress, no metadata
        if step % 50 == 0 or step == a.steps - 1:
            _say(f"fit_mtp: step {step}: loss {first.item():.3f} (first) {chained.item():.3f} (chained), "
                  f"{time.time() - t0:.0f} s")
    after = evaluate()
    meta = {"model": a.model, "seed": str(a.seed), "steps": str(a.steps), "seqs": str(a.seqs), "len": str(a.len),
            "held_out_top1": json.dumps({"first": round(after[0], 4), "chained": round(after[1], 4),
                                         "first_before": round(before[0], 4), "chained_before": round(before[1], 4)})}
    save_file({k: v.detach().contiguous() for k, v in params.items()}, a.out, metadata=meta)
    _say(f"fit_mtp: held-out top-1: first draft {before[0]:.1%} -> {after[0]:.1%}, chained {before[1]:.1%} -> "
          f"{after[1]:.1%}; wrote {a.out} ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
