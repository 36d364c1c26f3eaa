"""Drift-aware choice of packing: of several packings of the same replicas, keep per row the one whose
heaviest GPU is expected to be lightest in the *next* window.

A plan is made from one window of loads and used for the next, whose loads differ. Packings with the same
(or nearly the same) heaviest GPU now can differ a lot then: a tight packing that leaves many GPUs at the
maximum, or puts two heavy replicas (or two replicas of one expert, which move together) on one GPU,
fares worse than the greedy LPT packing, which hands the heaviest replicas out one per GPU. Measured on
``inferhal bench eplb``'s drifted windows, the tightest packing lost to DeepSeek's greedy packing by up to
3 % of balancedness in the multi-node layouts while winning the current window in every case.

Model of the next window: each logical expert's load is multiplied by ``exp(drift * Z)``, ``Z ~ N(0, 1)``
independent per expert (replicas of one expert move together). :func:`expected_heaviest` scores a
candidate by the mean over ``scenarios`` draws of its heaviest pack's load -- a sample estimate of
E[max GPU load] that keeps the correlations a closed form would drop. All candidates and all rows share the
same draws (common random numbers: the comparison between candidates is much less noisy than either
estimate), drawn from a fixed seed so that every EP rank computes the same plan. The cost is one batched
matmul ``[K, experts] @ [X, experts, C * m]``. ``SCENARIOS = 128``: at 64 the choice was visibly noisier on
the 64-GPU single-node layouts (there the candidates differ least); antithetic pairs did not help.

The default ``drift`` is the bench's own drift model, so the bench measures the policy under the drift it
assumes; the gain does not hinge on the exact value (the candidates are few and all balance the current
window), but a deployment whose windows move more or less can set ``eplb.drift``.
"""

from __future__ import annotations

import torch

DRIFT = 0.35
"""Default relative drift per expert between windows (log-normal sigma): the drift model of
``inferhal bench eplb``; :func:`~inferhal.core.eplb.rebalance_experts` plans for the current window alone
with ``drift=0``."""
SCENARIOS = 128
SEED = 0x5EED


def scenario_factors(num_experts: int, drift: float, scenarios: int = SCENARIOS,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[scenarios, num_experts]`` load multipliers ``exp(drift * Z)`` from the fixed seed."""
    g = torch.Generator().manual_seed(SEED)
    return torch.randn(scenarios, num_experts, generator=g, dtype=dtype).mul_(drift).exp_()


def expected_heaviest(weight: torch.Tensor, expert: torch.Tensor, packs: torch.Tensor, num_packs: int,
                      factors: torch.Tensor) -> torch.Tensor:
    """``[X, C]``: for each row and candidate, the mean over the scenarios of the heaviest pack's load.

    ``weight[X, n]`` item loads (replica loads), ``expert[X, n]`` the expert of each item (``<`` the
    width of ``factors``), ``packs[X, C, n]`` the pack of each item under each of ``C`` candidates,
    ``factors[K, experts]`` the scenarios' multipliers (:func:`scenario_factors`).
    """
    x, c, n = packs.shape
    k, ne = factors.shape
    # cells[x, e, c*m + p]: load of expert e's replicas in pack p under candidate c
    cell = expert[:, None, :] * (c * num_packs) + torch.arange(c)[None, :, None] * num_packs + packs
    cells = torch.zeros(x, ne * c * num_packs, dtype=weight.dtype)
    cells.scatter_add_(1, cell.reshape(x, c * n), weight.repeat(1, c))
    loads = torch.matmul(factors.to(weight.dtype), cells.view(x, ne, c * num_packs))  # [X, K, C*m]
    return loads.view(x, k, c, num_packs).amax(-1).mean(1)


def pick(weight: torch.Tensor, expert: torch.Tensor, packs: torch.Tensor, num_packs: int, num_experts: int,
         drift: float, scenarios: int = SCENARIOS) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pack[X, n], choice[X])``: per row the candidate of ``packs[X, C, n]`` with the lightest expected
    heaviest pack under ``drift`` (ties: the first candidate)."""
    score = expected_heaviest(weight, expert, packs, num_packs,
                              scenario_factors(num_experts, drift, scenarios, weight.dtype))
    choice = score.argmin(dim=1)
    return packs[torch.arange(packs.shape[0]), choice], choice
