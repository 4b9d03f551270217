"""Megatron-style tensor parallelism: hybrid mesh, conjugate mappings, parallel layers."""
import kernels as _kernels

# tp-layers installs a top-level `kernels` beside `tp`; Hugging Face's `kernels` distribution (which transformers 5.25
# requires) has the same import name, and whichever comes first on sys.path (or was installed last) hides the other.
if not all(hasattr(_kernels, name) for name in ("use_backend", "choices", "linear_wgrad")):
    raise ImportError(f"tp-layers needs its own `kernels` package but `import kernels` found {_kernels.__file__} "
                      "(Hugging Face's `kernels`, which transformers>=5.25 requires, has the same name): "
                      "pip uninstall kernels && pip install 'transformers<5.25'")
from . import (
    dropout,  # tp.dropout: counter-based dropout masks keyed by global position (CounterDropout)
    moe,  # tp.moe: the mixture-of-experts layer, router, dispatchers, experts
    optim,  # tp.optim: DataParallel, DistributedOptimizer, memory_bytes
)
from .clip import clip_grad_norm_
from .context import context_parallel_attention, cp_positions, cp_shard, cp_unshard
from .cross_entropy import vocab_parallel_cross_entropy
from .debug import is_debug, set_debug
from .embedding import VocabParallelEmbedding
from .grads import allreduce_main_grads, allreduce_sequence_parallel_grads, ddp_ignore_main_grads, sync_grads_over_tp
from .hf import default_plan
from .layers import ColumnParallelLinear, RowParallelLinear
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
from .parallelize import describe, parallelize
from .random import fork_rng, get_rng_state, get_rng_tracker, model_parallel_seed, set_rng_state
from .state_dict import ShardedOptimizerState, full_state_dict, load_full_state_dict, sharded_state_dict

__all__ = [
    "layout", "init_mesh", "get_mesh", "destroy_mesh", "Mesh",
    "copy_to_tp_region", "reduce_from_tp_region", "scatter_to_tp_region", "gather_from_tp_region",
    "scatter_to_sp_region", "gather_from_sp_region", "reduce_scatter_to_sp_region",
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
    "allreduce_sequence_parallel_grads", "sync_grads_over_tp", "allreduce_main_grads", "ddp_ignore_main_grads",
    "parallelize", "describe", "default_plan", "full_state_dict", "load_full_state_dict",
    "sharded_state_dict", "ShardedOptimizerState",
    "cp_shard", "cp_unshard", "cp_positions", "context_parallel_attention",
    "clip_grad_norm_", "optim", "moe", "dropout",
    "set_debug", "is_debug",
    "model_parallel_seed", "fork_rng", "get_rng_tracker", "get_rng_state", "set_rng_state",
]
