"""Megatron-style tensor parallelism: hybrid mesh, conjugate mappings, parallel layers."""
from .layers import ColumnParallelLinear, RowParallelLinear, allreduce_sequence_parallel_grads
from .mappings import (
    copy_to_tp_region,
    gather_from_sp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sp_region,
    scatter_to_sp_region,
    scatter_to_tp_region,
)
from .mesh import Mesh, destroy_mesh, get_mesh, init_mesh, layout
from .random import fork_rng, get_rng_tracker, model_parallel_seed

__all__ = [
    "layout", "init_mesh", "get_mesh", "destroy_mesh", "Mesh",
    "copy_to_tp_region", "reduce_from_tp_region", "scatter_to_tp_region", "gather_from_tp_region",
    "scatter_to_sp_region", "gather_from_sp_region", "reduce_scatter_to_sp_region",
    "ColumnParallelLinear", "RowParallelLinear", "allreduce_sequence_parallel_grads",
    "model_parallel_seed", "fork_rng", "get_rng_tracker",
]
