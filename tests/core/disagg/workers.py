"""Rank bodies of the two-process disaggregation test (loaded by file in each spawned process): rank 0 is
the prefill instance, rank 1 the decode instance, KV through the backend's connector (gloo point-to-point)."""

import os

import torch

PROMPTS = [[1, 2, 3, 4, 5], [(7 * i + 3) % 190 + 1 for i in range(70)], [42, 43], [5] * 33]
MAX_TOKENS = 8


def params():
    from inferhal.core.sampling.params import SamplingParams

    return [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0 if i % 2 == 0 else 0.8, seed=i, ignore_eos=True)
            for i in range(len(PROMPTS))]


def tiny():
    from inferhal.core.engine.llm import LLM, compose_config

    return LLM.from_config(compose_config("deepseek_v4_tiny", "reference", overrides=["cache.num_blocks=64"]))


def pd_pair(layout, out_dir):
    torch.set_num_threads(1)
    from inferhal.core.disagg.connector import KVPayload, connect
    from inferhal.core.disagg.handoff import check_compatible, describe, side
    from inferhal.core.engine.engine import Engine

    base = tiny()
    be = base.engine.backend
    be.communicator(layout)  # the process group (gloo)
    me = layout.rank
    eng = Engine(base.engine.loaded, be, transfer=side("prefill" if me == 0 else "decode"))
    conn = connect(be, 1 - me)
    peer = conn.handshake(describe(eng))
    check_compatible(describe(eng), peer, *(("prefill", "decode") if me == 0 else ("decode", "prefill")))
    done, sent = {}, {}
    if me == 0:
        for i, (p, sp) in enumerate(zip(PROMPTS, params())):
            eng.add_request(p, sp, request_id=f"r{i}")
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished and o.outputs[0].finish_reason != "transferred":
                    done[o.request_id] = list(o.outputs[0].token_ids)
            for payload in eng.transfer.take():
                sent[payload.state["request_id"]] = payload.nbytes
                conn.send(payload)
        conn.send(KVPayload({"done": True}))
    else:
        while True:
            payload = conn.recv()
            if payload.state.get("done"):
                break
            sent[payload.state["request_id"]] = payload.nbytes
            eng.transfer.add(payload)
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = list(o.outputs[0].token_ids)
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = list(o.outputs[0].token_ids)
        eng.kv_manager.check()
    torch.save({"done": done, "bytes": sent, "left": len(eng.kv_manager.reqs)}, os.path.join(out_dir, f"rank{me}.pt"))
