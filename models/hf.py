"""Hugging Face weights in and out: Llama, Mistral, Qwen2 (q/k/v bias), GPT-2 (Conv1D, learned positions) and the
mixtures of experts Mixtral, Qwen2-MoE (shared expert), Qwen3-MoE (q/k norms) and OLMoE (models.hf_moe).

Loading maps each of our parameters to the HF tensors it is made of (q|k|v fused into our QKV, gate|up into fc1,
GPT-2's Conv1D [in, out] transposed) and reads only the rows/columns this rank holds: from a live model's
state_dict, or lazily from a `save_pretrained` directory with safetensors' `get_slice`. Saving gathers the shards
over tp and writes config.json + safetensors on tp rank 0 (one file per pipeline stage, with an index).
transformers is imported only when these functions run.

This module gathers the public names of its parts: models/hf_config.py (the configs, each way), hf_names.py (our
parameters' HF tensors, this rank's rows of them), hf_load.py and hf_save.py.
"""
from .hf_config import FAMILIES, LLAMA_LIKE, check_hf, config_from_hf, config_to_hf, hf_family, hf_problems
from .hf_load import index_runs, load_hf, load_hf_weights
from .hf_names import fused_part_size, hf_sources, parameter_owners, tp_sharding
from .hf_save import hf_state_dict, save_hf

__all__ = ["FAMILIES", "LLAMA_LIKE", "check_hf", "config_from_hf", "config_to_hf", "fused_part_size", "hf_family",
           "hf_problems", "hf_sources", "hf_state_dict", "index_runs", "load_hf", "load_hf_weights",
           "parameter_owners", "save_hf", "tp_sharding"]
