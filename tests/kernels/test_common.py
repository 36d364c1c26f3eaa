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
