"""Blends, Megatron's syntax: `--data 0.3 PREFIX_A 0.7 PREFIX_B` (weights normalised).

Each dataset keeps its own held-out windows (the last ~1% of its windows); the blend draws the others in proportion
to the weights, deterministically: a period of PERIOD draws holds round(PERIOD·w) of each dataset, spread evenly
through it (as Megatron's BlendedDataset keeps each dataset's share close to its weight at every sample), and the
k-th draw of a dataset is its window perm_p[k mod n] of pass p = k div n over its n windows, perm_p a permutation
seeded by (seed, dataset, p): every window once before any repeats. Draw i depends on i and the seed alone, so the
global batch of a step is the same for any tp x cp x pp x dp split. The held-out blend takes each dataset's held-out
windows in order (no seed), in the same proportions.
"""
from collections.abc import Sequence

import numpy as np
from torch.utils.data import Dataset

PERIOD = 1 << 16


def period_counts(weights: Sequence[float], period: int = PERIOD) -> np.ndarray:
    """Draws of each dataset per period: round(period·w) by largest remainder, at least 1 each."""
    share = np.asarray(weights, dtype=np.float64) / sum(weights) * period
    counts = np.maximum(np.floor(share).astype(np.int64), 1)
    order = np.argsort(-(share - np.floor(share)), kind="stable")
    for d in order[:max(0, period - int(counts.sum()))]:
        counts[d] += 1
    return counts


def interleave(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(dataset of each draw of a period, its draw number within the period): dataset d's k-th draw placed at time
    (k + 1/2) / counts[d], the draws ordered by time (ties by dataset)."""
    dataset = np.repeat(np.arange(len(counts)), counts)
    rank = np.concatenate([np.arange(c) for c in counts])
    order = np.lexsort((dataset, (rank + 0.5) / counts[dataset]))
    return dataset[order], rank[order]


class Blend(Dataset):
    """Windows of several datasets (each a Dataset of windows) drawn in proportion to `weights`; `seed` None draws
    each dataset's windows in order. Any draw number i >= 0 is valid; len() is the datasets' windows together."""

    def __init__(self, datasets: Sequence[Dataset], weights: Sequence[float], *, seed: int | None):
        self.datasets, self.seed = list(datasets), seed
        self.counts = period_counts(weights)
        self.period = int(self.counts.sum())
        self.dataset_of, self.rank_of = interleave(self.counts)
        self.permutations: dict[tuple[int, int], np.ndarray] = {}

    def __len__(self):
        return sum(len(d) for d in self.datasets)

    def source(self, i: int) -> tuple[int, int]:
        """(dataset, window) of draw i."""
        cycle, r = divmod(i, self.period)
        d = int(self.dataset_of[r])
        k = cycle * int(self.counts[d]) + int(self.rank_of[r])  # the dataset's k-th draw
        passes, q = divmod(k, len(self.datasets[d]))
        return d, q if self.seed is None else int(self.permutation(d, passes)[q])

    def permutation(self, d: int, passes: int) -> np.ndarray:
        key = (d, passes)
        if key not in self.permutations:
            for old in [k for k in self.permutations if k[0] == d and k[1] < passes - 1]:
                del self.permutations[old]  # (a batch straddles at most two passes of a dataset)
            rng = np.random.default_rng([self.seed % (1 << 64), d, passes])
            self.permutations[key] = rng.permutation(len(self.datasets[d]))
        return self.permutations[key]

    def __getitem__(self, i):
        d, j = self.source(i)
        return self.datasets[d][j]
