"""Pipeline stage splits: which layers each virtual stage holds, evenly as models.stages places them or unevenly as
Megatron-Core does with its flags, for the memory and step-time models.

    --decoder-first-pipeline-num-layers N  (first)      the first pipeline rank holds N layers
    --decoder-last-pipeline-num-layers N   (last)       the last pipeline rank holds N layers
    --account-for-embedding-in-pipeline-split (embedding)  the embedding counts as one layer of the split
    --account-for-loss-in-pipeline-split   (loss)       the output layer and loss count as one layer of the split

The rule is the job's (models.stages.layers_per_stage, Megatron-Core's get_num_layers_to_build): the planner prices
the stages the job would build. A split here is a StageSplit in the planner's --fix words (first_layers, last_layers,
account=embedding+loss), `job()` the same split in the job's.
"""
import functools
from dataclasses import dataclass

from models import stages as job_stages
from models.stages import layers_per_stage


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

    def job(self):
        """The same split as the job's models.stages.StageSplit (Megatron's field names)."""
        return job_stages.StageSplit(self.first, self.last, self.embedding, self.loss)

    def label(self):
        """'even', 'first7,last7', 'embedding+loss', ...: as the table prints it."""
        if self.even:
            return "even"
        given = [f"{name}{n}" for name, n in (("first", self.first), ("last", self.last)) if n is not None]
        return ",".join(given) or "+".join(name for name in ("embedding", "loss") if getattr(self, name))


EVEN = StageSplit()
ACCOUNTED = StageSplit(embedding=True, loss=True)  # the search's uneven candidate (Llama 3's layout)


@functools.lru_cache(maxsize=4096)
def layer_counts(num_layers, pp, virtual_stages=1, split=EVEN):
    """Transformer layers of each virtual stage s = c·pp + r (pp·V of them) under `split`, as the job places them
    (models.stages.layers_per_stage); ValueError (one line naming the failing constraint) when they do not divide."""
    return layers_per_stage(num_layers, pp, virtual_stages, split=split.job())


def stage_chunks(num_layers, pp, stage, virtual_stages=1, split=EVEN):
    """[(first layer, stop, pre_process, post_process)] of the model chunks pipeline rank `stage` holds."""
    return list(_chunks(num_layers, pp, stage, virtual_stages, split))


@functools.lru_cache(maxsize=4096)
def _chunks(num_layers, pp, stage, virtual_stages, split):
    counts = layer_counts(num_layers, pp, virtual_stages, split)
    starts = [sum(counts[:s]) for s in range(len(counts))]
    stages = [c * pp + stage for c in range(virtual_stages)]
    return tuple((starts[s], starts[s] + counts[s], s == 0, s == len(counts) - 1) for s in stages)
