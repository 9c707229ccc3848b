"""Global batch packing: spread sequences over data-parallel ranks so every rank finishes together.

A sequence of length L costs roughly a*L (everything per token) + b*L^2 (attention), so token
counts alone misjudge long sequences. Greedy longest-processing-time scheduling (most expensive
first, each to the currently cheapest rank with room) is within 4/3 of optimal and, with many
sequences, essentially balanced. `balanced_row_order` orders the rows of every pretraining batch
(`train.loop`) and RL batch (`actor.samples.balance_rows`) before they are sharded.
"""

from __future__ import annotations

import dataclasses
import heapq

import numpy as np

# Attention's share per token relative to the per-token work, at the tiny preset's shape; large
# models have a smaller quadratic share, long contexts a larger one.
DEFAULT_ATTENTION_WEIGHT = 1.0 / 2048


def sequence_costs(
    lengths, token_weight: float = 1.0, attention_weight: float = DEFAULT_ATTENTION_WEIGHT
) -> np.ndarray:
    lengths = np.asarray(lengths, np.float64)
    return token_weight * lengths + attention_weight * lengths**2


@dataclasses.dataclass(frozen=True)
class PackingPlan:
    """`ranks[r][m]` lists the sequence indices in rank r's micro-batch m."""

    ranks: list[list[list[int]]]
    rank_costs: np.ndarray

    @property
    def imbalance(self) -> float:
        """Slowest rank over the mean rank: 1.0 is perfect."""
        return float(self.rank_costs.max() / self.rank_costs.mean())


def _greedy(costs: np.ndarray, bins: int, capacity: int | None) -> list[list[int]]:
    """Most expensive item first into the cheapest bin that still has room."""
    heap = [(0.0, b) for b in range(bins)]
    members: list[list[int]] = [[] for _ in range(bins)]
    for i in np.argsort(-costs, kind="stable"):
        skipped = []
        while True:
            load, b = heapq.heappop(heap)
            if capacity is None or len(members[b]) < capacity:
                break
            skipped.append((load, b))
        members[b].append(int(i))
        heapq.heappush(heap, (load + float(costs[i]), b))
        for item in skipped:
            heapq.heappush(heap, item)
    return members


def balance_sequences(
    lengths,
    num_ranks: int,
    num_microbatches: int = 1,
    equal_counts: bool = False,
    token_weight: float = 1.0,
    attention_weight: float = DEFAULT_ATTENTION_WEIGHT,
) -> PackingPlan:
    """Assigns sequences to ranks, then each rank's to micro-batches, balancing cost.

    `equal_counts` gives every rank the same number of sequences (fixed-shape batches); it needs
    a count divisible by `num_ranks`.
    """
    costs = sequence_costs(lengths, token_weight, attention_weight)
    if equal_counts and len(costs) % num_ranks:
        raise ValueError(f"{len(costs)} sequences do not split evenly over {num_ranks} ranks")
    capacity = len(costs) // num_ranks if equal_counts else None
    per_rank = _greedy(costs, num_ranks, capacity)
    plan = []
    for members in per_rank:
        sub = _greedy(costs[members], num_microbatches, None)
        plan.append([[members[j] for j in mb] for mb in sub])
    return PackingPlan(plan, np.array([costs[m].sum() for m in per_rank]))


def round_robin(
    lengths,
    num_ranks: int,
    token_weight: float = 1.0,
    attention_weight: float = DEFAULT_ATTENTION_WEIGHT,
) -> PackingPlan:
    """The naive baseline: sequence i goes to rank i mod num_ranks."""
    costs = sequence_costs(lengths, token_weight, attention_weight)
    ranks = [[list(range(r, len(costs), num_ranks))] for r in range(num_ranks)]
    return PackingPlan(ranks, np.array([costs[r[0]].sum() for r in ranks]))


def row_attention_lengths(segment_ids_BT: np.ndarray) -> np.ndarray:
    """Per packed row, the length whose square equals the row's attention work (sum of squares of
    its documents' lengths), so rows can be balanced like sequences."""
    rows = []
    for row in np.asarray(segment_ids_BT):
        _, counts = np.unique(row[row > 0], return_counts=True)
        rows.append(np.sqrt(np.sum(counts.astype(np.float64) ** 2)))
    return np.array(rows)


def balanced_row_order(segment_ids_BT: np.ndarray, num_ranks: int) -> np.ndarray:
    """Row permutation giving each data-parallel rank (a contiguous block of rows) equal
    attention work; every row holds the same number of tokens."""
    seq_len = segment_ids_BT.shape[1]
    lengths = row_attention_lengths(segment_ids_BT)
    # Rows all hold seq_len tokens; only their attention term differs.
    plan = balance_sequences(
        lengths, num_ranks, equal_counts=True, token_weight=0.0, attention_weight=1.0 / seq_len
    )
    return np.array([i for rank in plan.ranks for i in rank[0]])
