"""A first load (a cold weight cache) holds no more memory than a later one: the weights are decoded one at a
time into the cache file, each let go once written, and the model maps the file as a warm load does.

Measured in subprocesses on a synthetic Gemma 3 GGUF of F16 weights (:data:`FP32_BYTES` once decoded), as each
process's peak resident set (``ru_maxrss``): the cold load may exceed the warm one by at most
:data:`MARGIN` of the decoded weights (the weight being decoded, and the allocator's slack). Holding every
decoded weight until the model is built, as the loader did before, exceeds it by more than all of them."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

HIDDEN, FFN, LAYERS, HEADS, HEAD_DIM, VOCAB = 1024, 4096, 3, 4, 256, 8
#: the fp32 bytes of every weight of the file (the products dominate: q, o 1024², k, v 256 x 1024, gate, up, down 4096 x 1024)
FP32_BYTES = 4 * (LAYERS * (2 * HIDDEN * HEADS * HEAD_DIM + 2 * HIDDEN * HEAD_DIM + 3 * HIDDEN * FFN) + VOCAB * HIDDEN)
MARGIN = 0.25

_PEAK = """
import resource, sys
from inferhal.core.config.schema import BackendConfig, ModelConfig
from inferhal.core.models.gemma3.loader import load
from inferhal.core.registry import BackendRegistry

be = BackendRegistry.discover().select(BackendConfig(name="reference"))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
lm = load(ModelConfig(name="t", family="gemma3", format="gguf", path=sys.argv[1]), be)
print(lm.info["weight_cache"], before * 1024, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def _write(path):
    from inferhal.core.models.gemma3.config import Gemma3Config
    from inferhal.core.models.gguf.loader import expected_shapes

    cfg = Gemma3Config(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS, intermediate_size=FFN,
                       num_heads=HEADS, num_kv_heads=1, head_dim=HEAD_DIM)
    w = gguf.GGUFWriter(str(path), arch="gemma3")
    for key, value in {"embedding_length": HIDDEN, "block_count": LAYERS, "feed_forward_length": FFN,
                       "attention.head_count": HEADS, "attention.head_count_kv": 1, "attention.key_length": HEAD_DIM,
                       "attention.value_length": HEAD_DIM}.items():
        w.add_uint32(f"gemma3.{key}", value)
    w.add_tokenizer_model("llama")
    w.add_token_list(["<pad>", "<eos>", "<bos>", "<unk>", "a", "b", "ab", "\u2581"])
    w.add_token_types([3, 3, 3, 3, 1, 1, 1, 1])
    w.add_eos_token_id(1)
    shapes = expected_shapes(cfg)
    assert sum(4 * int(np.prod(s)) for s in shapes.values()) - FP32_BYTES < 1 << 20  # the norms: a few KiB
    for name, shape in shapes.items():
        w.add_tensor(name, np.full(shape, 0.01, np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _peak(path, cache) -> tuple[str, int, int]:
    env = {**os.environ, "INFERHAL_CACHE": str(cache), "INFERHAL_WEIGHT_CACHE": "1"}
    run = subprocess.run([sys.executable, "-c", _PEAK, str(path)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    state, before, peak = run.stdout.split()[-3:]
    return state, int(before), int(peak)


def test_a_cold_load_peaks_no_higher_than_a_warm_one(tmp_path):
    path = _write(tmp_path / "m.gguf")
    cold = _peak(path, tmp_path / "cache")
    warm = _peak(path, tmp_path / "cache")
    assert (cold[0], warm[0]) == ("stored", "hit")
    mib = lambda n: f"{n / 2**20:.0f} MiB"  # noqa: E731
    print(f"decoded weights {mib(FP32_BYTES)}; peak RSS cold {mib(cold[2])} (+{mib(cold[2] - cold[1])} in the load), "
          f"warm {mib(warm[2])} (+{mib(warm[2] - warm[1])})")
    assert cold[2] - warm[2] <= MARGIN * FP32_BYTES, (
        f"the cold load peaked {mib(cold[2] - warm[2])} above the warm one (decoded weights: {mib(FP32_BYTES)})")
