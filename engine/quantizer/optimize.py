"""Bit allocation: one measured candidate per (layer, module) under an exact bit budget.

    choice = allocate(slots, budget_bits)

`slots[s]` lists the options of slot s as (storage bits, measured error). The result picks
one option per slot minimizing Σ err^norm subject to Σ bits ≤ budget_bits. The default
norm 2 is the total noise power (errors are relative noise put into the residual stream;
independent noise adds in power). A larger norm weighs the largest errors more and so
spreads the bits more evenly: a hedge against a measurement made on one kind of text,
whose small per-module differences the exact optimum would otherwise follow to the bit
(exllamav2's optimizer searches norms 1.5-3.5 for the least maximum error; issue 29).

Method: a dynamic program over the budget in `resolution` units (costs rounded *up*, so
the exact sum never exceeds the budget; the rounding gives away at most one unit per
slot), then greedy upgrades with the best error reduction per bit while bits remain. The
DP is exact on the rounded costs, which simulated annealing (exllamav2) is not.

`feasible_range(slots)` gives the cheapest and dearest totals, so an impossible target
is refused before any measurement.
"""

from __future__ import annotations

import math

import numpy as np

Option = tuple[int, float]  # (bits, err)
DEFAULT_NORM = 2.0


class BudgetError(ValueError):
    """The target cannot be met with the candidate table."""


def feasible_range(slots: list[list[Option]]) -> tuple[int, int]:
    return sum(min(b for b, _ in s) for s in slots), sum(max(b for b, _ in s) for s in slots)


def allocate(
    slots: list[list[Option]],
    budget_bits: int,
    *,
    resolution: int = 50_000,
    norm: float = DEFAULT_NORM,
) -> list[int]:
    if not (math.isfinite(norm) and norm > 0):
        raise ValueError(f"the error norm must be a positive number, got {norm}")
    low, _ = feasible_range(slots)
    if low > budget_bits:
        raise BudgetError(f"the cheapest choice needs {low} bits, the budget is {budget_bits}")
    unit = budget_bits / resolution
    size = resolution + 1
    # best[c]: least Σ err^norm of the slots so far with rounded cost ≤ c. It stays monotone
    # in c, being a minimum of shifted monotone tables, so the walk back is exact.
    best = np.zeros(size)
    picks: list[np.ndarray] = []
    costs: list[list[int]] = []
    for options in slots:
        new = np.full(size, np.inf)
        pick = np.full(size, -1, dtype=np.int32)
        slot_costs = [math.ceil(bits / unit - 1e-9) for bits, _ in options]
        for j, ((_, err), cost) in enumerate(zip(options, slot_costs, strict=True)):
            if cost >= size:
                continue
            value = best[: size - cost] + err**norm
            better = value < new[cost:]
            new[cost:][better] = value[better]
            pick[cost:][better] = j
        picks.append(pick)
        costs.append(slot_costs)
        best = new
    if not np.isfinite(best[-1]):
        raise BudgetError("no combination of candidates fits the budget")
    choice = [0] * len(slots)
    capacity = size - 1
    for s in range(len(slots) - 1, -1, -1):
        j = int(picks[s][capacity])
        choice[s] = j
        capacity -= costs[s][j]
    return _greedy_fill(slots, choice, budget_bits, norm)


def _greedy_fill(
    slots: list[list[Option]], choice: list[int], budget_bits: int, norm: float
) -> list[int]:
    used = sum(slots[s][j][0] for s, j in enumerate(choice))
    while True:
        best_gain, best_move = 0.0, None
        for s, options in enumerate(slots):
            bits0, err0 = options[choice[s]]
            for j, (bits, err) in enumerate(options):
                extra = bits - bits0
                if extra <= 0 or used + extra > budget_bits or err >= err0:
                    continue
                gain = (err0**norm - err**norm) / extra
                if gain > best_gain:
                    best_gain, best_move = gain, (s, j, extra)
        if best_move is None:
            return choice
        s, j, extra = best_move
        choice[s] = j
        used += extra
