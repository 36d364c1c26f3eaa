"""The e2e workload and inferhal's closed-loop client (the peers' clients need transformers or llama.cpp and
run in the benchmark itself)."""

from __future__ import annotations

from inferhal.core.bench.clients import PEERS, PROMPTS, peer_loaders, prompt_ids, run_inferhal


def test_prompt_ids_mark_later_rounds():
    class Tok:  # one id per character
        def encode(self, text):
            return [ord(ch) for ch in text]

    texts = ["".join(map(chr, p)) for p in prompt_ids(Tok(), len(PROMPTS) + 2)]
    assert texts[: len(PROMPTS)] == list(PROMPTS)
    assert texts[len(PROMPTS):] == [PROMPTS[0] + " (take 2)", PROMPTS[1] + " (take 2)"]


def test_inferhal_client_keeps_c_in_flight_and_counts_steps_and_tokens():
    from inferhal import LLM
    from inferhal.core.engine.llm import compose_config

    llm = LLM.from_config(compose_config("deepseek_v4_tiny", "reference", overrides=["cache.num_blocks=64"]))
    prompts = [[1, 2, 3], [7, 150, 33, 9], [42], [5, 6]]
    steps: list[int] = []
    wall, per = run_inferhal(llm, prompts, 2, 3, steps)
    assert wall > 0 and len(per) == 4 and all(n == 3 for _, _, n in per)
    assert all(ttft > 0 and tpot > 0 for ttft, tpot, _ in per)
    assert steps == [6]  # two waves of two requests, three tokens each: one step a token
    wall, per = run_inferhal(llm, prompts, 4, 1)
    assert len(per) == 4 and all(n == 1 for _, _, n in per)


def test_every_peer_has_a_loader():
    assert set(peer_loaders("/x/model.gguf", 2, "float32")) == set(PEERS)
