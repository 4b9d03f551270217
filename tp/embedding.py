"""Vocabulary-parallel embedding (Megatron's VocabParallelEmbedding), drop-in for nn.Embedding.

Each rank holds a contiguous block of V/tp rows. Token ids outside this rank's block look up row 0 and are zeroed,
so the sum over the group (an all-reduce; with sequence parallelism a reduce-scatter along the sequence) is the
dense lookup.
"""
from collections.abc import Callable
from typing import Any, Self

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import debug
from .collectives import gather_first
from .mappings import reduce_from_tp_region, reduce_scatter_to_sp_region
from .mesh import SharedGroup, resolve_group


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocabulary split across the tp group: weight [V/tp, H], rows [vocab_start, vocab_end).

    forward: token ids [s, b] (any [...] without sequence parallelism) -> [s, b, h], all-reduced; with
    `sequence_parallel` reduce-scattered along dim 0 -> [s/tp, b, h] · backward: local (SP: all-gather).
    `num_embeddings` must be divisible by tp: the model pads its vocabulary, not the layer.
    `padding_idx` behaves as nn.Embedding's (row initialised to zero, never receives a gradient).
    """

    group = SharedGroup()

    def __init__(
        self, num_embeddings: int, embedding_dim: int, *, padding_idx: int | None = None,
        sequence_parallel: bool = False, group: dist.ProcessGroup | None = None,
        init_method: Callable[[torch.Tensor], object] | None = None, dtype: torch.dtype | None = None,
        device: torch.device | str | None = None, _init: bool = True,
    ) -> None:
        super().__init__()
        self.group = resolve_group(group)
        self.tp_size, self.tp_rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        if num_embeddings % self.tp_size:
            raise ValueError(
                f"num_embeddings = {num_embeddings} is not divisible across {self.tp_size} ranks "
                f"(pad the vocabulary to a multiple of the tp size)"
            )
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"padding_idx = {padding_idx} is outside [-{num_embeddings}, {num_embeddings})")
            padding_idx %= num_embeddings
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        self.sequence_parallel, self.init_method = sequence_parallel, init_method
        per_rank = num_embeddings // self.tp_size
        self.vocab_start, self.vocab_end = self.tp_rank * per_rank, (self.tp_rank + 1) * per_rank
        owned = padding_idx is not None and self.vocab_start <= padding_idx < self.vocab_end
        self._local_padding_idx = padding_idx - self.vocab_start if owned else None
        self.weight = nn.Parameter(torch.empty(per_rank, embedding_dim, dtype=dtype, device=device))
        self.weight.tensor_parallel, self.weight.partition_dim = True, 0  # Megatron's tags: rows sharded over tp
        if _init and self.weight.device.type != "meta":
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draw the full [V, H] master on CPU with the serial init (nn.Embedding's normal(0, 1) by default), slice.

        With the same seed on every rank the shards are exact slices of `nn.Embedding(V, H, dtype=...)`'s weight.
        """
        master = torch.empty(self.num_embeddings, self.embedding_dim, dtype=self.weight.dtype, device="cpu")
        (self.init_method or nn.init.normal_)(master)
        if self.padding_idx is not None:
            master[self.padding_idx].zero_()
        self.load_master(master)

    @torch.no_grad()
    def gather_dense(self, tensor: torch.Tensor) -> torch.Tensor:
        """The dense [V, H] tensor from every rank's rows of it (a collective over the group)."""
        if self.tp_size == 1:
            return tensor
        return gather_first(tensor, self.group)

    @torch.no_grad()
    def load_master(self, weight: torch.Tensor) -> None:
        """Copy this rank's rows of the dense [V, H] weight into the local parameter."""
        expected = (self.num_embeddings, self.embedding_dim)
        if tuple(weight.shape) != expected:
            raise ValueError(f"master weight shape {tuple(weight.shape)} != {expected}")
        self.weight.copy_(weight[self.vocab_start:self.vocab_end])

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, **options: Any) -> Self:
        """Shard a dense nn.Embedding onto this rank (dtype and device follow the embedding unless given)."""
        unsupported = {"max_norm": None, "scale_grad_by_freq": False, "sparse": False}
        for name, default in unsupported.items():
            if getattr(embedding, name) != default:
                raise ValueError(f"VocabParallelEmbedding does not support nn.Embedding's {name}="
                                 f"{getattr(embedding, name)!r}")
        weight = embedding.weight
        options = {"dtype": weight.dtype, "device": weight.device, "padding_idx": embedding.padding_idx} | options
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, _init=False, **options)
        layer.load_master(weight.detach())
        return layer

    def _check_input(self, ids):
        if debug.is_debug():
            debug.check(ids, self.group, "the token ids of VocabParallelEmbedding", replicated=True)
        if ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"token ids must be int64 or int32, got {ids.dtype}")
        if self.sequence_parallel and (ids.dim() == 0 or ids.shape[0] % self.tp_size):
            raise ValueError(f"sequence_parallel VocabParallelEmbedding needs [s, b] ids with s divisible by "
                             f"tp = {self.tp_size}, got shape {tuple(ids.shape)}")
        # every rank holds the same ids, so every rank raises here, before the collective (on a GPU: a device assert)
        debug.check_range(ids, self.num_embeddings,
                          lambda bad: f"token id {bad} is outside the vocabulary [0, {self.num_embeddings})")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [s, b]
        self._check_input(ids)
        if self.tp_size == 1:
            return F.embedding(ids, self.weight, self.padding_idx)  # [s, b, h]
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill_(outside, 0)
        partial = F.embedding(local_ids, self.weight, self._local_padding_idx)  # [s, b, h], rows of this rank only
        partial.masked_fill_(outside.unsqueeze(-1), 0)  # in place: the lookup's backward needs only the ids
        if self.sequence_parallel:
            return reduce_scatter_to_sp_region(partial, self.group, check=False)  # [s/tp, b, h] (ids were checked)
        return reduce_from_tp_region(partial, self.group, in_place=True, check=False)  # a fresh tensor: its storage

    def extra_repr(self) -> str:
        padding = f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""
        local = "x".join(map(str, self.weight.shape))
        return (
            f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}{padding}, tp={self.tp_size}, "
            f"vocab=[{self.vocab_start}, {self.vocab_end}) (local weight {local}), "
            f"sequence_parallel={self.sequence_parallel}"
        )
