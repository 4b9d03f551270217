"""Hugging Face weights in and out, for every family of tp.hf.FAMILIES with a config class (Llama, Mistral, Qwen2,
GPT-2 and the mixtures of experts Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3, DeepSeek-V2, GLM-4.5): generic
code, each family's specifics (its config, tensor names, experts on disk) in its own module in tp/hf/ (whose
docstring says why there, and how to add a family).

Loading maps each of our parameters to the HF tensors it is made of (q|k|v fused into our QKV, gate|up into fc1,
GPT-2's Conv1D [in, out] transposed) and reads only the rows/columns this rank holds: from a live model's
state_dict, or lazily from a `save_pretrained` directory with safetensors' `get_slice`. Saving gathers the shards
over tp and writes config.json + safetensors on tp rank 0 (one file per pipeline stage, with an index).
transformers is imported only when these functions run.

The parts: convert.py (the configs, each way), names.py (our parameters' HF tensors, this rank's rows of them),
experts.py (the experts fused in memory and per expert on disk), load.py and save.py.
"""
from .convert import check_hf, config_from_hf, config_to_hf, hf_family, hf_problems
from .experts import disk_name, expert_names
from .load import check_safetensors, load_hf, load_hf_weights
from .names import fused_part_size, hf_sources, parameter_owners, tp_sharding
from .save import hf_state_dict, save_hf

__all__ = ["check_hf", "check_safetensors", "config_from_hf", "config_to_hf", "disk_name", "expert_names",
           "fused_part_size", "hf_family", "hf_problems", "hf_sources", "hf_state_dict", "load_hf",
           "load_hf_weights", "parameter_owners", "save_hf", "tp_sharding"]
