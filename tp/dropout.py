"""Dropout that is the same at every split: counter-based masks keyed by global position.

A mask bit is a pure function of (seed, the module's global index, the sample's global index in the run, the
element's global coordinates: token position and hidden index on the residual stream; head, query and key position on
attention probabilities), computed by Philox-4x32-10 from those counters (kernels.dropout: Triton on the GPU, the same
bits in torch elsewhere). A rank draws exactly the elements it holds, whatever the split (tp, SP, cp in any mode, pp,
dp, recompute), so every split trains on the masks of the serial run, no rank materialises more than its own share,
and recomputation and backward regenerate masks instead of saving them or an RNG state.

`CounterDropout(p, seed, module, samples)` is one dropout site of one forward: `.add(x, residual, positions=...)`
is residual + dropout(x) on [rows, b, h] (one fused kernel), `.keep(rows, cols, heads=...)` the keep mask of
attention tiles. The sample counter holds the low 32 bits of each sample's index (masks repeat after 2³² samples).
"""
from typing import NamedTuple

import torch

from kernels.dropout import dropout_add, keep_mask

from .random import derive_seed


class CounterDropout(NamedTuple):
    """One dropout site's masks in one forward: drop probability `p`; keyed by `seed` and the site's global `module`
    index; `samples` [b] int64 the global index of each row of the batch in the run; `first_head` the global index of
    this rank's first attention head (tp rank · local heads, plus the a2a share)."""

    p: float
    seed: int
    module: int
    samples: torch.Tensor
    first_head: int = 0

    @property
    def key(self) -> int:
        return derive_seed(self.seed, self.module)

    def add(self, x: torch.Tensor, residual: torch.Tensor | None = None, bias: torch.Tensor | None = None, *,
            positions: torch.Tensor) -> torch.Tensor:
        """residual + dropout(x + bias) on x [rows, b, h] whose rows sit at global token `positions` [rows]."""
        return dropout_add(x, residual, bias, p=self.p, key=self.key, samples=self.samples, positions=positions)

    def keep(self, rows: torch.Tensor, cols: torch.Tensor, *, heads: int) -> torch.Tensor:
        """Bool [b, heads, m, n]: kept attention probabilities of this rank's heads first_head.. for queries at global
        positions `rows` [m] and keys at `cols` [n]."""
        return keep_mask(self.key, self.p, self.samples, rows, cols, heads=heads, first_head=self.first_head)

    def heads_from(self, offset: int) -> "CounterDropout":
        """The same site for a rank holding the heads from `offset` on, among this one's."""
        return self._replace(first_head=self.first_head + offset)
