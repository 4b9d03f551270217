"""Pipeline stage splits: which layers each virtual stage holds, evenly as models.stages places them or unevenly as
Megatron-Core does with its flags, for the memory and step-time models.

    --decoder-first-pipeline-num-layers N  (first)      the first pipeline rank holds N layers
    --decoder-last-pipeline-num-layers N   (last)       the last pipeline rank holds N layers
    --account-for-embedding-in-pipeline-split (embedding)  the embedding counts as one layer of the split
    --account-for-loss-in-pipeline-split   (loss)       the output layer and loss count as one layer of the split

Megatron-Core's get_num_layers_to_build (megatron/core/transformer/transformer_block.py): with first and/or last
given, the other layers split evenly over the remaining ranks (they must divide); with the embedding and/or loss
accounted, (L + 1 + 1) layers split evenly over the pp ranks and the first (last) virtual stage builds one fewer;
the two kinds do not combine. With V virtual stages each rank's share splits evenly into its V chunks (it must
divide), chunk c of rank r being virtual stage c·pp + r. Without any of them, models.stages' even split (the job's:
the first num_layers % pp ranks one more at V = 1; equal chunks at V > 1).

A split is a StageSplit (the four flags, Megatron's names); the job's own implementation of these flags (models.stages)
is the one to read once it exists — `layer_counts` is where it plugs in.
"""
import functools
from dataclasses import dataclass

from models.stages import stage_layers


@dataclass(frozen=True)
class StageSplit:
    """Megatron-Core's uneven pipeline split (module docstring); all None/False: the even split."""
    first: int | None = None  # decoder_first_pipeline_num_layers
    last: int | None = None  # decoder_last_pipeline_num_layers
    embedding: bool = False  # account_for_embedding_in_pipeline_split
    loss: bool = False  # account_for_loss_in_pipeline_split

    @property
    def even(self):
        return self == EVEN

    def label(self):
        """'even', 'first7,last7', 'embedding+loss', ...: as the table prints it."""
        if self.even:
            return "even"
        given = [f"{name}{n}" for name, n in (("first", self.first), ("last", self.last)) if n is not None]
        return ",".join(given) or "+".join(name for name in ("embedding", "loss") if getattr(self, name))


EVEN = StageSplit()
ACCOUNTED = StageSplit(embedding=True, loss=True)  # the search's uneven candidate (Llama 3's layout)


def _rank_counts(num_layers, pp, split):
    """Layers (embedding and loss slots included) per pipeline rank under `split`; ValueError naming what fails."""
    if split.first is not None or split.last is not None:
        if split.embedding or split.loss:
            raise ValueError("first/last pipeline layers do not combine with accounting for the embedding or loss "
                             "(Megatron-Core asserts the same)")
        if pp < 2:
            raise ValueError(f"first/last pipeline layers need pp >= 2, got pp={pp}")
        given = {0: split.first, pp - 1: split.last}
        rest = num_layers - sum(n for n in given.values() if n is not None)
        left = pp - sum(n is not None for n in given.values())
        if rest < 0 or any(n is not None and n < 0 for n in given.values()):
            raise ValueError(f"first={split.first} and last={split.last} layers exceed num_layers={num_layers}")
        if left and rest % left:
            raise ValueError(f"the {rest} layers left by first={split.first}, last={split.last} do not divide over "
                             f"the {left} middle stages of pp={pp}")
        if not left and rest:
            raise ValueError(f"first={split.first} + last={split.last} != num_layers={num_layers} at pp={pp}")
        return [given.get(r) if given.get(r) is not None else rest // left for r in range(pp)]
    total = num_layers + split.embedding + split.loss
    if total % pp:
        raise ValueError(f"num_layers={num_layers} + embedding {int(split.embedding)} + loss {int(split.loss)} = "
                         f"{total} is not divisible by pp={pp}")
    return [total // pp] * pp


@functools.lru_cache(maxsize=4096)
def layer_counts(num_layers, pp, virtual_stages=1, split=EVEN):
    """Transformer layers of each virtual stage s = c·pp + r (pp·V of them) under `split`; ValueError (one line
    naming the failing constraint) when the sizes do not divide."""
    if split.even:
        return tuple(stop - start for start, stop in (stage_layers(num_layers, pp, s, virtual_stages)
                                                      for s in range(pp * virtual_stages)))
    per_rank = _rank_counts(num_layers, pp, split)
    for r, n in enumerate(per_rank):
        if n % virtual_stages:
            raise ValueError(f"pipeline rank {r}'s {n} layers" + (" (with the embedding/loss slots)" if
                                                                   split.embedding or split.loss else "") +
                             f" do not split into vp={virtual_stages} equal chunks")
    counts = [per_rank[s % pp] // virtual_stages for s in range(pp * virtual_stages)]
    counts[0] -= split.embedding
    counts[-1] -= split.loss
    if min(counts) < 0:
        raise ValueError(f"a virtual stage would hold {min(counts)} layers (pp={pp}, vp={virtual_stages})")
    return tuple(counts)


def stage_chunks(num_layers, pp, stage, virtual_stages=1, split=EVEN):
    """[(first layer, stop, pre_process, post_process)] of the model chunks pipeline rank `stage` holds."""
    return list(_chunks(num_layers, pp, stage, virtual_stages, split))


@functools.lru_cache(maxsize=4096)
def _chunks(num_layers, pp, stage, virtual_stages, split):
    counts = layer_counts(num_layers, pp, virtual_stages, split)
    starts = [sum(counts[:s]) for s in range(len(counts))]
    stages = [c * pp + stage for c in range(virtual_stages)]
    return tuple((starts[s], starts[s] + counts[s], s == 0, s == len(counts) - 1) for s in stages)
