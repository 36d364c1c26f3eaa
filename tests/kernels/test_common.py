"""kernels.common.launch: a launch that needs more shared memory than the device has is retried with
fewer pipeline stages (what an H200 showed for the FP8-block expert GEMMs), and only then."""

import pytest
from triton.runtime.errors import OutOfResources

from inferhal.kernels import common


class FakeKernel:
    """kernel[grid](*args, num_stages=...) that fails above ``fits`` stages with the device's error."""

    def __init__(self, fits: int, resource: str = "shared memory") -> None:
        self.fits, self.resource, self.calls = fits, resource, []

    def __getitem__(self, grid):
        def run(*args, num_stages, **kwargs):
            self.calls.append(num_stages)
            if num_stages > self.fits:
                raise OutOfResources(num_stages * 81920, 232448, self.resource)
            return ("ran", grid, args, num_stages)

        return run


def test_launch_retries_with_fewer_stages_and_remembers():
    k = FakeKernel(fits=2)
    assert common.launch(k, (4, 2), 1, num_stages=3, num_warps=8) == ("ran", (4, 2), (1,), 2)
    assert k.calls == [3, 2]
    assert common.launch(k, (9, 2), 1, num_stages=3, num_warps=8)[3] == 2  # remembered: no second failure
    assert k.calls == [3, 2, 2]


def test_launch_keeps_stages_that_fit():
    k = FakeKernel(fits=4)
    assert common.launch(k, (1,), num_stages=3)[3] == 3
    assert k.calls == [3]


@pytest.mark.parametrize("fits,resource", [(0, "shared memory"), (1, "registers")])
def test_launch_raises_what_fewer_stages_cannot_fix(fits, resource):
    k = FakeKernel(fits=fits, resource=resource)
    with pytest.raises(OutOfResources, match=resource):
        common.launch(k, (1,), num_stages=2)


def test_host_round_rounds_as_torch_does():
    """embed's scale is rounded to the table's dtype on the host (no tensor, no host read in a step): the same
    value as torch's conversion of a Python float, ties and overflow included."""
    import random

    import torch

    rng = random.Random(0)
    values = [0.0, -0.0, 1.0, 25.298221281347036, 2.0 ** -140, 65504.0, 65520.0, 1e39, -1e39, 3.4e38,
              1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, 1.0 + 2 ** -11, 1.0 + 3 * 2 ** -11]  # ties: bf16 and fp16
    values += [rng.uniform(-1, 1) * 10 ** rng.randint(-8, 8) for _ in range(2000)]
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        for v in values:
            want = float(torch.tensor(v, dtype=dtype).float() if dtype != torch.float64 else torch.tensor(v, dtype=dtype))
            assert common.host_round(v, dtype) == want, (v, dtype)
