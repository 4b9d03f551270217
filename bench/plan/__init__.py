"""The parallelism planner (`python -m bench.plan`): every split of a model on a cluster, its per-GPU memory and step
time, ranked; validated on published runs.

    cli.py        the command line: flags, the model it names, the table, the JSON and the plot
    feasibility.py  why a --fix leaves no plan (the constraint that fails)
    search.py     candidate plans, evaluate (memory, then step time), search and ranking
    step_time.py  the step-time model of one plan (Plan): the step (pipeline span, dp, optimizer) and MFU
    stage_time.py   a pipeline rank's model chunks: their layers, the embedding, the output layer and loss, MTP
    layer_time.py   one layer: GEMMs, element-wise traffic, recompute, summed with the pieces below
    comm_time.py    group links, one collective, tp collectives, cp's K/V traffic
    mla_time.py     multi-head latent attention's GEMMs, collectives and element-wise traffic
    gemm.py         GEMM rate by shape (tiles and waves), its efficiency fitted to the GPU runs
    attention_time.py  the attention core, at measured rates by sequence length
    moe_time.py     an MoE layer's experts, dispatch (node-aware, DeepEP), permutation, host launches, imbalance,
                    and its router and shared expert
    pipeline.py     the simulated span of uneven stages (tp.pipeline.schedules)
    stages.py     pipeline splits: even, and Megatron's uneven ones (StageSplit)
    recompute.py  recompute granularities and Megatron's recompute modules
    software.py   whose implementation runs the plan (Software, SOFTWARE: --software)
    memory.py     the per-rank memory model of a split: the estimate (and the names of the two below)
    parameters.py   parameter shapes per stage; parameter, gradient and optimizer-state bytes per dp mode
    activations.py  what a block saves per micro-batch, the edges, the micro-batches in flight per schedule
    hardware.py   the node profiles (Cluster: a bench.roofline device plus memory and achieved efficiencies)
    validation.py published runs and bench.train's CPU runs against the model, and its calibration
    measured.py   bench.mfu's measured one-device rows against the model (--check-mfu)
"""
from .cli import main

__all__ = ["main"]
