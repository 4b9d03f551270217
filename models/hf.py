"""Hugging Face weights in and out: Llama, Mistral, Qwen2 (q/k/v bias), GPT-2 (Conv1D, learned positions) and the
mixtures of experts Mixtral, Qwen2-MoE (shared expert), Qwen3-MoE (q/k norms) and OLMoE (models.hf_moe).

Loading maps each of our parameters to the HF tensors it is made of (q|k|v fused into our QKV, gate|up into fc1,
GPT-2's Conv1D [in, out] transposed) and reads only the rows/columns this rank holds: from a live model's
state_dict, or lazily from a `save_pretrained` directory with safetensors' `get_slice`. Saving gathers the shards
over tp and writes config.json + safetensors on tp rank 0 (one file per pipeline stage, with an index).
transformers is imported only here, and only when these functions run.
"""
import json
import os
import re
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

import tp
from tp.embedding import VocabParallelEmbedding
from tp.layers import ColumnParallelLinear, RowParallelLinear
from tp.moe import GroupedExperts
from tp.pipeline import model_chunks

from .block import FullQKNorm
from .config import HF_FAMILIES, ROPE_SCALING_FIELDS, GPTConfig
from .hf_moe import (
    MOE_FAMILIES,
    disk_name,
    moe_config_kwargs,
    moe_fields,
    moe_problems,
    moe_sources,
    read_experts,
    to_disk,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

LLAMA_LIKE = ("llama", "mistral", "qwen2")
FAMILIES = HF_FAMILIES


# ---- config ------------------------------------------------------------------------------------------------------


def _rope(hf):
    """(rope_theta, rope_scaling or None) of a Llama-like HF config: plain, "linear" or "llama3" RoPE."""
    params = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    theta = float(params.pop("rope_theta", None) or getattr(hf, "rope_theta", None) or 10000.0)
    kind = params.get("rope_type", params.get("type", "default"))  # ("type": transformers 4's key)
    if kind == "default":
        return theta, None
    if kind not in ROPE_SCALING_FIELDS:
        raise ValueError(f"rope_type={kind!r} (rope scaling) is not supported; only plain RoPE and "
                         f"{', '.join(ROPE_SCALING_FIELDS)} scaling")
    return theta, {"rope_type": kind} | {f: params[f] for f in ROPE_SCALING_FIELDS[kind] if f in params}


def config_from_hf(hf: "PretrainedConfig", **overrides: Any) -> GPTConfig:
    """GPTConfig of a transformers config (LlamaConfig, MistralConfig, Qwen2Config, GPT2Config)."""
    family = hf.model_type
    if family not in FAMILIES:
        raise ValueError(f"model_type={family!r} is not supported; expected one of {FAMILIES}")
    if family == "gpt2":
        act = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}.get(hf.activation_function)
        if act is None:
            raise ValueError(f"GPT-2 activation_function={hf.activation_function!r} is not supported")
        fields = dict(vocab_size=hf.vocab_size, hidden_size=hf.n_embd, num_layers=hf.n_layer, num_heads=hf.n_head,
                      ffn_hidden_size=hf.n_inner or 4 * hf.n_embd, max_seq_len=hf.n_positions, activation=act,
                      norm="layernorm", norm_eps=hf.layer_norm_epsilon, position="learned", bias=True,
                      tie_embeddings=True)
    else:
        if hf.hidden_act != "silu":
            raise ValueError(f"hidden_act={hf.hidden_act!r} is not supported (SwiGLU needs 'silu')")
        attention_bias = bool(getattr(hf, "attention_bias", False)) if family not in ("qwen2", "qwen2_moe") else False
        mlp_bias = bool(getattr(hf, "mlp_bias", False))
        if attention_bias != mlp_bias:
            raise ValueError(f"attention_bias={attention_bias} with mlp_bias={mlp_bias}: GPTConfig's `bias` covers "
                             "every linear")
        rope_theta, rope_scaling = _rope(hf)
        window = getattr(hf, "sliding_window", None) if getattr(hf, "use_sliding_window", True) is not False else None
        fields = dict(vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, num_layers=hf.num_hidden_layers,
                      num_heads=hf.num_attention_heads, num_kv_heads=hf.num_key_value_heads,
                      head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
                      ffn_hidden_size=hf.intermediate_size, max_seq_len=hf.max_position_embeddings,
                      activation="swiglu", norm="rmsnorm", norm_eps=hf.rms_norm_eps, position="rope",
                      rope_theta=rope_theta, rope_scaling=rope_scaling, bias=attention_bias,
                      qkv_bias=family == "qwen2" or (family == "qwen2_moe" and bool(getattr(hf, "qkv_bias", True))),
                      tie_embeddings=bool(hf.tie_word_embeddings), sliding_window=window or None)
        if family in MOE_FAMILIES:
            fields |= moe_fields(hf)
    return GPTConfig(**(fields | {"hf_model_type": family} | overrides))


def hf_family(config: GPTConfig) -> str:
    """The Hugging Face family `config` is written as (config_to_hf, save_hf) and whose tensor names it uses
    (hf_sources: hf_state_dict, checkpoints): its hf_model_type, else GPT-2 for learned positions (the only family
    with them), else Mixtral with experts, else Llama. Whether the config fits that family is check_hf's question."""
    if config.hf_model_type:
        return config.hf_model_type
    return "gpt2" if config.position == "learned" else "mixtral" if config.num_experts else "llama"


_NAMES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "gpt2": "GPT-2", "mixtral": "Mixtral",
          "qwen2_moe": "Qwen2-MoE", "qwen3_moe": "Qwen3-MoE", "olmoe": "OLMoE"}


def hf_problems(config: GPTConfig, family: str | None = None) -> list[str]:
    """'field=value (what the family has)' for every field of `config` that `family` (default: hf_family) cannot
    represent; empty when a checkpoint of that family holds exactly this model."""
    c, family = config, family or hf_family(config)
    name, problems = _NAMES[family], []

    def need(ok, field, has):
        if not ok:
            problems.append(f"{field}={getattr(c, field)!r} ({name}: {has})")

    if family == "gpt2":
        need(c.activation in ("gelu_tanh", "gelu"), "activation", "'gelu_tanh' or 'gelu'")
        need(c.norm == "layernorm", "norm", "'layernorm'")
        need(c.position == "learned", "position", "'learned'")
        need(c.bias, "bias", "a bias on every linear and norm")
        need(c.num_kv_heads == c.num_heads, "num_kv_heads", f"no GQA/MQA: num_heads={c.num_heads}")
        need(c.head_dim * c.num_heads == c.hidden_size, "head_dim",
             f"hidden_size / num_heads = {c.hidden_size}/{c.num_heads}")
        need(c.tie_embeddings, "tie_embeddings", "the output layer tied to the embedding")
        need(c.sliding_window is None, "sliding_window", "no sliding window")
        return problems + moe_problems(c, family)
    need(c.activation == "swiglu", "activation", "'swiglu'")
    need(c.norm == "rmsnorm", "norm", "'rmsnorm'")
    need(c.position == "rope", "position", "'rope'")
    if family == "llama":  # attention_bias = mlp_bias = bias: q/k/v biases only together with all the others
        need(c.bias or not c.qkv_bias, "qkv_bias", "q/k/v biases only with bias=True (every linear); q/k/v "
             "biases alone are Qwen2's")
        need(c.sliding_window is None, "sliding_window", "no sliding window; Mistral and Qwen2 have one")
    elif family in ("mistral", "mixtral", "qwen3_moe", "olmoe"):
        need(not c.bias, "bias", "no biases")
        need(not c.qkv_bias, "qkv_bias", "no biases")
        need(c.sliding_window is None or family != "olmoe", "sliding_window", "no sliding window")
    elif family == "qwen2_moe":
        need(not c.bias, "bias", "biases on q/k/v only (qkv_bias)")
    else:  # qwen2
        need(not c.bias, "bias", "biases on q/k/v only")
        need(c.qkv_bias, "qkv_bias", "always q/k/v biases")
    return problems + moe_problems(c, family)


def check_hf(config: GPTConfig) -> str:
    """Raise a ValueError naming every field the Hugging Face family of `config` (hf_family) cannot represent.
    Collective-free: save_hf calls it on every rank before it gathers or writes anything."""
    family = hf_family(config)
    problems = hf_problems(config, family)
    if problems:
        why = ""
        if config.hf_model_type is None:
            fits = [f for f in FAMILIES if f != family and not hf_problems(config, f)]
            why = (f" (hf_model_type=None: {family} inferred from position={config.position!r}; "
                   + (f"hf_model_type={fits[0]!r} fits)" if fits else "no other family fits either)"))
        raise ValueError(f"this GPTConfig has no Hugging Face {family} equivalent{why}: " + "; ".join(problems))
    return family


def config_to_hf(config: GPTConfig) -> "PretrainedConfig":
    """The transformers config a saved model is loaded with; a ValueError (check_hf) if there is none."""
    import transformers

    c, family = config, check_hf(config)
    if family == "gpt2":
        act = {"gelu_tanh": "gelu_new", "gelu": "gelu"}[c.activation]
        hf = transformers.GPT2Config(vocab_size=c.vocab_size, n_embd=c.hidden_size, n_layer=c.num_layers,
                                     n_head=c.num_heads, n_inner=c.ffn_hidden_size, n_positions=c.max_seq_len,
                                     activation_function=act, layer_norm_epsilon=c.norm_eps, tie_word_embeddings=True)
    else:
        cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
               "qwen2": transformers.Qwen2Config, "mixtral": transformers.MixtralConfig,
               "qwen2_moe": transformers.Qwen2MoeConfig, "qwen3_moe": transformers.Qwen3MoeConfig,
               "olmoe": transformers.OlmoeConfig}[family]
        extra = {"attention_bias": c.bias, "mlp_bias": c.bias} if family == "llama" else {}
        if family in ("mistral", "mixtral"):
            extra["sliding_window"] = c.sliding_window
        if family in ("qwen2", "qwen2_moe", "qwen3_moe"):  # every layer slides (max_window_layers=0), as ours
            extra.update(use_sliding_window=c.sliding_window is not None, sliding_window=c.sliding_window,
                         max_window_layers=0)  # refuse longer sequences in all
        if family in MOE_FAMILIES:
            extra |= moe_config_kwargs(c, family) | ({"qkv_bias": c.qkv_bias} if family == "qwen2_moe" else {})
        ffn = c.moe_ffn_hidden_size if family in ("mixtral", "olmoe") else c.ffn_hidden_size  # (their experts')
        hf = cls(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=ffn,
                 num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                 num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, max_position_embeddings=c.max_seq_len,
                 rms_norm_eps=c.norm_eps, rope_theta=c.rope_theta, tie_word_embeddings=c.tie_embeddings,
                 hidden_act="silu", **extra)
        if c.rope_scaling:  # transformers 5: rope_parameters holds theta and the scaling together
            hf.rope_parameters = {"rope_theta": c.rope_theta, **c.rope_scaling}
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):  # the family's defaults (GPT-2's 50256) may not
        token = getattr(hf, name, None)  # exist in this vocabulary: no such token then
        if token is not None and not 0 <= token < c.vocab_size:
            setattr(hf, name, None)
    return hf


# ---- names: our parameter -> the HF tensors it concatenates ------------------------------------------------------


def hf_sources(config: GPTConfig, name: str, layer_offset: int = 0) -> list[tuple[str, bool]]:
    """([(hf name, transposed)], ...) concatenated along our shard dim make our parameter `name` (dense)."""
    gpt2 = hf_family(config) == "gpt2"
    root = "transformer" if gpt2 else "model"
    embed = f"{root}.wte.weight" if gpt2 else f"{root}.embed_tokens.weight"
    if name == "embedding.weight" or (name == "output.weight" and config.tie_embeddings):
        return [(embed, False)]
    if name == "output.weight":
        return [("lm_head.weight", False)]
    if name == "position_embedding.weight":
        return [(f"{root}.wpe.weight", False)]
    if name.startswith("final_norm."):
        return [(f"{root}.{'ln_f' if gpt2 else 'norm'}.{name.split('.')[-1]}", False)]
    _, index, module, *rest = name.split(".")  # layers.<i>.<module>...
    block = f"{root}.{'h' if gpt2 else 'layers'}.{int(index) + layer_offset}"
    moe = moe_sources(".".join([module, *rest]), block)
    if moe is not None:
        return moe
    kind = rest[-1]  # weight / bias
    if gpt2:
        local = {"norm1": "ln_1", "norm2": "ln_2", "attention.qkv": "attn.c_attn", "attention.proj": "attn.c_proj",
                 "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj"}[".".join([module, *rest[:-1]])]
        return [(f"{block}.{local}.{kind}", kind == "weight" and "norm" not in module)]
    local = {"norm1": ["input_layernorm"], "norm2": ["post_attention_layernorm"],
             "attention.qkv": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
             "attention.proj": ["self_attn.o_proj"], "mlp.fc1": ["mlp.gate_proj", "mlp.up_proj"],
             "mlp.fc2": ["mlp.down_proj"]}[".".join([module, *rest[:-1]])]
    return [(f"{block}.{part}.{kind}", False) for part in local]


def parameter_owners(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """Our parameter name -> (module, attribute) for every parameter (tied ones under each name)."""
    owners = {}
    for module_name, module in model.named_modules():
        for attr, _ in module.named_parameters(recurse=False):
            owners[f"{module_name}.{attr}" if module_name else attr] = (module, attr)
    return owners


def tp_sharding(module: nn.Module, attr: str) -> tuple[int, int, torch.Tensor] | None:
    """(dim, dense size along it, dense indices this rank holds) for a sharded parameter; None if replicated."""
    if isinstance(module, VocabParallelEmbedding):
        return 0, module.num_embeddings, torch.arange(module.vocab_start, module.vocab_end)
    if isinstance(module, ColumnParallelLinear) or (isinstance(module, RowParallelLinear) and attr == "weight"):
        dim = module.shard_dim if attr == "weight" else 0
        return dim, (module.out_features, module.in_features)[module.shard_dim], module.shard_indices()
    if isinstance(module, FullQKNorm):
        return 0, module.width, module.shard_indices()
    return None  # (GroupedExperts' 3-D weights are read and gathered by expert: load_hf_weights, _gather_dense)


# ---- reading -----------------------------------------------------------------------------------------------------


class _StateDictReader:
    def __init__(self, state):
        self.state = state

    def has(self, name):
        return name in self.state

    def shape(self, name):
        return tuple(self.state[name].shape)

    def read(self, name, dim=None, start=None, stop=None):
        t = self.state[name].detach()
        return t if dim is None else t.narrow(dim, start, stop - start)


class _SafetensorsReader:
    """Lazy reads from a save_pretrained directory: only the requested rows/columns leave the file."""

    def __init__(self, path):
        from safetensors import safe_open

        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                files = json.load(f)["weight_map"]
        else:
            single = os.path.join(path, "model.safetensors")
            if not os.path.exists(single):
                raise ValueError(f"{path} holds no model.safetensors (or index): save it with safetensors")
            with safe_open(single, "pt") as f:
                files = dict.fromkeys(f.keys(), "model.safetensors")
        self.files = {k: safe_open(os.path.join(path, v), "pt") for k, v in files.items()}

    def has(self, name):
        return name in self.files

    def shape(self, name):
        return tuple(self.files[name].get_slice(name).get_shape())

    def read(self, name, dim=None, start=None, stop=None):
        piece = self.files[name].get_slice(name)
        if dim is None:
            return piece[:]
        return piece[start:stop] if dim == 0 else piece[:, start:stop]


def index_runs(indices: torch.Tensor) -> list[list[int]]:
    """Consecutive runs [(start, stop)] of a 1-D index tensor, in order."""
    runs = []
    for i in indices.tolist():
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    return runs


def _read_dense_slice(reader, sources, dim, indices):
    """The rows/columns `indices` (along our `dim`) of the concatenation of `sources`; indices past its end (a
    padded vocabulary) give zeros."""
    pieces, offset_of = [], []
    offset = 0
    for name, transposed in sources:
        shape = reader.shape(name)
        size = shape[(1 - dim) if transposed else dim]
        offset_of.append((name, transposed, offset, size, shape))
        offset += size
    for start, stop in index_runs(indices):
        for name, transposed, base, size, _shape in offset_of:
            a, b = max(start, base), min(stop, base + size)
            if a < b:
                src_dim = (1 - dim) if transposed else dim
                t = reader.read(name, src_dim, a - base, b - base)
                pieces.append(t.t() if transposed else t)
        if stop > offset:  # padding rows
            ref = pieces[-1] if pieces else reader.read(sources[0][0])
            width = ref.shape[1 - dim]
            missing = stop - max(start, offset)
            zeros = ref.new_zeros((missing, width) if dim == 0 else (width, missing))
            pieces.append(zeros)
    return torch.cat(pieces, dim)


@torch.no_grad()
def load_hf_weights(model: nn.Module, reader: Any) -> None:
    """Copy this rank's shard of every parameter (of this stage's layers) from the HF tensors behind `reader`."""
    family = hf_family(model.config)
    for name, (module, attr) in parameter_owners(model).items():
        param = getattr(module, attr)
        sources = [(n if reader.has(n) else disk_name(n, family), t)
                   for n, t in hf_sources(model.config, name, model.layer_range[0])]
        sharding = tp_sharding(module, attr)
        if isinstance(module, GroupedExperts):  # this rank's experts, then its etp slice
            dense = read_experts(reader, sources[0][0], module.expert_range, family)
            dense = module.shard_fc1(dense) if attr == module.names[0] else module.shard_fc2(dense)
        elif sharding is None:
            dense = torch.cat([reader.read(n).t() if t else reader.read(n) for n, t in sources])
        else:
            dim, _, indices = sharding
            dense = _read_dense_slice(reader, sources, dim, indices)
        if tuple(dense.shape) != tuple(param.shape):
            raise ValueError(f"{name}: HF tensors {[n for n, _ in sources]} give shape {tuple(dense.shape)}, "
                             f"expected {tuple(param.shape)}")
        param.copy_(dense)


def load_hf(cls: type[nn.Module], hf_model_or_path: "PreTrainedModel | str | os.PathLike", *,
            group: dist.ProcessGroup | None = None, dtype: torch.dtype | None = None,
            stage: dict[str, Any] | None = None, **overrides: Any) -> nn.Module:
    """`stage`: GPT options of one pipeline stage (layers, pre_process, post_process); `overrides`: GPTConfig fields."""
    if isinstance(hf_model_or_path, (str, os.PathLike)):
        import transformers

        config = config_from_hf(transformers.AutoConfig.from_pretrained(hf_model_or_path), **overrides)
        reader = _SafetensorsReader(hf_model_or_path)
    else:
        config = config_from_hf(hf_model_or_path.config, **overrides)
        reader = _StateDictReader(hf_model_or_path.state_dict())
    model = cls(config, group=group, _init=False, **(stage or {}))
    load_hf_weights(model, reader)
    return model if dtype is None else model.to(dtype)


# ---- saving ------------------------------------------------------------------------------------------------------


def _gather_dense(module, attr, group, grads=False):
    """The full dense parameter (or its grad) on every rank of the tp group (all-gather of the shards, back in
    dense order; replicated chunks carry equal values)."""
    param, sharding = getattr(module, attr), tp_sharding(module, attr)
    param = param.grad if grads else param.detach()
    if hasattr(param, "full_tensor"):  # FSDP2: this rank's dp shard of the tp-local tensor
        param = param.full_tensor()
    if isinstance(module, GroupedExperts):  # over etp and ep, the module's own groups
        return module.gather_dense(param, attr)
    size = dist.get_world_size(group)
    if sharding is None or size == 1:
        return param
    dim, total, indices = sharding
    shards = [torch.empty_like(param) for _ in range(size)]
    dist.all_gather(shards, param.contiguous(), group=group)
    every_index = [torch.empty_like(indices) for _ in range(size)]
    dist.all_gather(every_index, indices, group=group)
    dense = param.new_zeros([total if d == dim else n for d, n in enumerate(param.shape)])
    return dense.index_copy_(dim, torch.cat(every_index).to(param.device), torch.cat(shards, dim))


def hf_state_dict(model: nn.Module, group: dist.ProcessGroup | None = None, *,
                  grads: bool = False) -> dict[str, torch.Tensor]:
    """This model's (or stage's) parameters (or, `grads`, their gradients) as HF tensors, dense (gathered over
    tp): {hf name: tensor}."""
    group = tp.mesh.resolve_group(group)
    config, out = model.config, {}
    if hf_family(config) != "gpt2" and config.activation != "swiglu":  # no gate|up to split fc1 into
        check_hf(config)  # raises, naming the activation (before any gather)
    offset = model.layer_range[0]
    for name, (module, attr) in parameter_owners(model).items():
        if name == "output.weight" and config.tie_embeddings:
            continue  # HF ties lm_head to the input embedding and stores it once
        dense = _gather_dense(module, attr, group, grads)
        if name in ("embedding.weight", "output.weight"):
            dense = dense[:config.vocab_size]  # drop the padding rows
        sources = hf_sources(config, name, offset)
        sizes = [fused_part_size(config, n) for n, _ in sources]
        dim = 1 if name.endswith("proj.weight") or name.endswith("fc2.weight") else 0
        for (hf_name, transposed), piece in zip(sources, dense.split(sizes, dim) if len(sources) > 1 else [dense]):
            out[hf_name] = (piece.t() if transposed else piece).contiguous().cpu()
    return out


def fused_part_size(config: GPTConfig, hf_name: str) -> int:
    """Along our fused dim, the size of one HF tensor that is part of a fused parameter."""
    c = config
    part = hf_name.split(".")[-2]
    ffn = c.moe_shared_expert_size if ".shared_expert." in hf_name else c.ffn_hidden_size
    return {"q_proj": c.num_heads * c.head_dim, "k_proj": c.num_kv_heads * c.head_dim,
            "v_proj": c.num_kv_heads * c.head_dim, "gate_proj": ffn, "up_proj": ffn}.get(part, 0)


def save_hf(model: nn.Module | list[nn.Module], path: str | os.PathLike, *, group: dist.ProcessGroup | None = None,
            pp_group: dist.ProcessGroup | None = None, dp_group: dist.ProcessGroup | None = None,
            tokenizer: Any = None) -> None:
    """Write `path` (config.json + safetensors) for transformers.AutoModelForCausalLM.from_pretrained.

    Called on every rank with its stage, or its list of model chunks (interleaved pipelines: chunk c of pipeline
    rank r is virtual stage c·p + r); tp rank 0 of each pipeline rank writes one file per stage it holds (`pp_group`:
    the mesh's pipeline group, when the model is split over several ranks), numbered in virtual-stage (layer) order;
    global pipeline stage 0 writes the config and the index; with `dp_group`, only data-parallel replica 0 writes
    (the others hold the same weights). `tokenizer` (the one the model was trained with, a transformers tokenizer):
    its files are written too, and the config's bos/eos/pad token ids are its own (not the family's defaults), so
    `generate` on the export stops where the training data's documents end. Files get the umask's usual mode.
    """
    from safetensors.torch import save_file

    chunks = model_chunks(model)
    hf_config = config_to_hf(chunks[0].config)  # every rank, before any collective or write: the same error on all
    if tokenizer is not None:
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            setattr(hf_config, name, getattr(tokenizer, name, None))
    group = tp.mesh.resolve_group(group)
    family = hf_family(chunks[0].config)
    tensors = [to_disk(hf_state_dict(chunk, group), family) for chunk in chunks]  # (experts: per expert)
    ranks = dist.get_world_size(pp_group) if pp_group is not None else 1
    rank = dist.get_rank(pp_group) if pp_group is not None else 0
    names = [[sorted(t) for t in tensors]]  # per pipeline rank, per chunk
    if pp_group is not None:
        names = [None] * ranks
        dist.all_gather_object(names, [sorted(t) for t in tensors], group=pp_group)
    if dist.get_rank(group) != 0 or (dp_group is not None and dist.get_rank(dp_group) != 0):
        return
    stages = ranks * len(chunks)
    files = ["model.safetensors"] if stages == 1 else \
        [f"model-{s + 1:05d}-of-{stages:05d}.safetensors" for s in range(stages)] + ["model.safetensors.index.json"]
    os.makedirs(path, exist_ok=True)
    if rank == 0:  # an earlier export's weight files that this one does not write: transformers could load them
        for stale in set(os.listdir(path)) - set(files):
            if re.fullmatch(r"model(-\d+-of-\d+)?\.safetensors(\.index\.json)?", stale):
                os.remove(os.path.join(path, stale))
    mode = 0o666 & ~_umask()  # (safetensors writes 0600: the same mode as the config's instead)
    for c, chunk_tensors in enumerate(tensors):
        save_file(chunk_tensors, os.path.join(path, files[c * ranks + rank]), metadata={"format": "pt"})
        os.chmod(os.path.join(path, files[c * ranks + rank]), mode)
    if rank == 0:
        hf_config.save_pretrained(path)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)
        if stages > 1:
            weight_map = {n: files[c * ranks + r] for r, per_chunk in enumerate(names)
                          for c, ns in enumerate(per_chunk) for n in ns}
            with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask
