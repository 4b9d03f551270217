"""[parallelism]: the tp x cp x pp x dp split, the pipeline schedule, data parallelism's mode, the experts' layout."""
import dataclasses

from tp.pipeline.schedules import SCHEDULES

from ...config import CP_MODES, RECOMPUTE, RECOMPUTE_METHODS, RECOMPUTE_MODULES
from ...stages import StageSplit
from .. import data_parallel
from .fields import at_least, one_of, option

PIPELINE_SCHEDULES = tuple(SCHEDULES)
DP_MODES = tuple(data_parallel.MODES)


@dataclasses.dataclass
class ParallelismConfig:
    """[parallelism]: the tp x cp x pp x dp split, the pipeline schedule, data parallelism's mode."""

    tp: int = option(2, "tensor-parallel size", aliases=("--tensor-model-parallel-size",))
    cp: int = option(1, "context-parallel size: each sequence split over cp ranks (ring attention)",
                     aliases=("--context-parallel-size",))
    cp_mode: str = option(
        "ring", "context-parallel attention: K/V ringed with p2p (overlapped), all-gathered once (Llama 3's), a2a "
                "(DeepSpeed-Ulysses: all-to-alls trade the sequence split for a head split; heads divisible by "
                "tp*cp), or a2a+ring (a2a inside sub-groups of --cp-a2a-size ranks, a ring across them)",
        choices=CP_MODES)
    cp_a2a_size: int | None = option(
        None, "--cp-mode a2a+ring: ranks per all-to-all sub-group (consecutive cp ranks, e.g. one node), a divisor of "
              "--cp", metavar="A")
    pp: int = option(2, "pipeline-parallel size (stages)", aliases=("--pipeline-model-parallel-size",))
    dp: int | None = option(
        None, "data-parallel size (default: WORLD_SIZE / (tp*cp*pp) under torchrun, as Megatron; else the GPUs over "
              "tp*cp*pp, or 2 on the CPU)")
    dp_mode: str = option(
        "ddp", "data parallelism: torch DDP on the dp group, FSDP2 (fully_shard) on the dp mesh dim, or zero1: the "
               "distributed optimizer (fp32 grads reduce-scattered in buckets during backward, each rank stepping "
               "1/dp of the fp32 masters and AdamW state, parameters all-gathered)",
        choices=DP_MODES, consts={"--use-distributed-optimizer": "zero1"})
    schedule: str = option(
        "1f1b", "pipeline schedule (tp/pipeline/schedules.py): interleaved is Megatron's, with --virtual-stages "
                "model chunks per rank; zb is ZB-H1, the backward split into input and weight gradients",
        choices=PIPELINE_SCHEDULES)
    virtual_stages: int = option(
        1, "model chunks per pipeline rank (--schedule interleaved; Megatron's virtual pipeline size)", metavar="V")
    first_stage_layers: int | None = option(
        None, "layers of the first pipeline stage, the rest split evenly over the middle stages (default: an even "
              "split)", aliases=("--decoder-first-pipeline-num-layers",), metavar="N")
    last_stage_layers: int | None = option(
        None, "layers of the last pipeline stage, the rest split evenly over the middle stages",
        aliases=("--decoder-last-pipeline-num-layers",), metavar="N")
    embedding_as_layer: bool = option(
        False, "count the embedding as one layer when splitting the layers over the pipeline stages",
        aliases=("--account-for-embedding-in-pipeline-split",))
    loss_as_layer: bool = option(
        False, "count the output layer and loss as one layer when splitting the layers over the pipeline stages",
        aliases=("--account-for-loss-in-pipeline-split",))
    sequence_parallel: bool = option(False, "Megatron sequence parallelism inside each tp group")
    recompute: str = option(
        "none", "activation recomputation: the modules of --recompute-modules (selective) or whole blocks (full)",
        choices=RECOMPUTE, aliases=("--recompute-granularity",))
    recompute_modules: list[str] | None = option(
        None, f"--recompute selective: what each block recomputes, of {', '.join(RECOMPUTE_MODULES)} (Megatron-Core's "
              "names; default: core_attn; layernorm and moe_act keep not even their output, recomputed in backward)",
        choices=RECOMPUTE_MODULES, metavar="MODULE")
    recompute_method: str | None = option(
        None, "--recompute full: uniform (every block, the input of each --recompute-num-layers consecutive ones "
              "kept) or block (only the first --recompute-num-layers blocks of each model chunk) (default: uniform)",
        choices=RECOMPUTE_METHODS)
    recompute_num_layers: int | None = option(
        None, "--recompute full: the layers per recomputed group (uniform) or recomputed per model chunk (block) "
              "(default: 1)", metavar="N")
    ep: int = option(
        1, "expert-parallel size: the experts of each MoE layer split over ep ranks of a stage's tp*cp*dp (which "
           "exchange tokens by all-to-all); ep*etp must divide tp*cp*dp", aliases=("--expert-model-parallel-size",))
    etp: int | None = option(None, "expert-tensor-parallel size: each expert's FFN split over etp ranks (default: "
                                   "--tp)", aliases=("--expert-tensor-parallel-size",))

    def validate(self) -> None:
        at_least(self, ("tp", "cp", "pp", "dp", "virtual_stages", "cp_a2a_size", "ep", "etp", "first_stage_layers",
                        "last_stage_layers", "recompute_num_layers"), 1)
        for flag, value, allowed in (("--cp-mode", self.cp_mode, CP_MODES), ("--dp-mode", self.dp_mode, DP_MODES),
                                     ("--schedule", self.schedule, PIPELINE_SCHEDULES),
                                     ("--recompute", self.recompute, RECOMPUTE),
                                     *(("--recompute-modules", m, RECOMPUTE_MODULES) for m in self.recompute_modules
                                       or ()),
                                     *(("--recompute-method", m, RECOMPUTE_METHODS) for m in [self.recompute_method]
                                       if m is not None)):
            one_of(flag, value, allowed)
        self._validate_recompute()
        if (self.first_stage_layers or self.last_stage_layers) and (self.embedding_as_layer or self.loss_as_layer):
            raise ValueError("--first-stage-layers / --last-stage-layers do not combine with --embedding-as-layer / "
                             "--loss-as-layer (as in Megatron-LM)")
        if (self.first_stage_layers or self.last_stage_layers) and self.pp < 2:
            raise ValueError(f"--first-stage-layers / --last-stage-layers split a pipeline: give --pp >= 2 "
                             f"(--pp={self.pp})")
        if self.cp_a2a_size is not None and self.cp_mode != "a2a+ring":
            raise ValueError(f"--cp-a2a-size={self.cp_a2a_size} is for --cp-mode a2a+ring, not {self.cp_mode}")
        if self.cp_mode == "a2a+ring" and self.cp > 1 and (self.cp_a2a_size is None or self.cp % self.cp_a2a_size):
            raise ValueError(f"--cp-mode a2a+ring needs --cp-a2a-size, a divisor of --cp={self.cp} (the all-to-all "
                             f"sub-groups' size); got {self.cp_a2a_size}")

    def _validate_recompute(self) -> None:
        """The selective and the full options each with their granularity (as Megatron-Core checks)."""
        if self.recompute_modules is not None and self.recompute != "selective":
            raise ValueError(f"--recompute-modules {' '.join(self.recompute_modules)} chooses what --recompute "
                             f"selective recomputes (--recompute={self.recompute})")
        for flag, value in (("--recompute-method", self.recompute_method),
                            ("--recompute-num-layers", self.recompute_num_layers)):
            if value is not None and self.recompute != "full":
                raise ValueError(f"{flag}={value} groups the blocks --recompute full recomputes "
                                 f"(--recompute={self.recompute})")

    @property
    def stage_split(self) -> StageSplit:
        """How the layers split over the pipeline stages (models.stages.layers_per_stage)."""
        return StageSplit(*(getattr(self, name) for name in StageSplit._fields))

    @property
    def recompute_options(self) -> dict:
        """GPTConfig's recompute fields the flags give (its defaults for the others)."""
        given = dict(recompute_modules=None if self.recompute_modules is None else tuple(self.recompute_modules),
                     recompute_method=self.recompute_method, recompute_num_layers=self.recompute_num_layers)
        return {"recompute": self.recompute} | {name: value for name, value in given.items() if value is not None}

    def resolve_dp(self, world_size: int | None, *, gpus: int | None = None) -> int:
        """--dp when given; else WORLD_SIZE / (tp·cp·pp) under torchrun (as Megatron); on our own launcher, the GPUs
        over tp·cp·pp (one rank per GPU; at least 1), 2 on the CPU."""
        if self.dp is not None:
            return self.dp
        if world_size is None:
            return 2 if gpus is None else max(1, gpus // (self.tp * self.cp * self.pp))
        model_parallel = self.tp * self.cp * self.pp
        if model_parallel < 1 or world_size % model_parallel:
            raise ValueError(f"WORLD_SIZE={world_size} is not divisible by --tp*--cp*--pp = {self.tp}*{self.cp}*"
                             f"{self.pp} = {model_parallel}: no data-parallel size fits")
        return world_size // model_parallel

    @property
    def experts_apart(self) -> bool:
        """Whether the experts are laid out otherwise than the dense weights (ep > 1 or etp != tp): their gradients
        are then reduced over the expert-data-parallel group, not dp."""
        return self.ep > 1 or self.etp not in (None, self.tp)

    def check_experts(self) -> None:
        """ep·etp must divide a stage's tp·cp·dp ranks (the expert layout re-groups them; Megatron-Core's rule)."""
        etp = self.tp if self.etp is None else self.etp
        stage = self.tp * self.cp * self.dp
        if stage % (self.ep * etp):
            raise ValueError(f"--ep={self.ep} * --etp={etp} = {self.ep * etp} does not divide --tp*--cp*--dp = "
                             f"{self.tp}*{self.cp}*{self.dp} = {stage} (a pipeline stage's ranks, which the experts "
                             "are laid over)")

    @property
    def sizes(self) -> dict[str, int]:
        """tp, cp, pp, dp, and ep, etp (the expert layout, for tp.init_mesh / tp.layout)."""
        return dict(tp=self.tp, cp=self.cp, pp=self.pp, dp=self.dp, ep=self.ep,
                    etp=self.tp if self.etp is None else self.etp)

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp
