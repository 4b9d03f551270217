"""Hugging Face configs in and out: the GPTConfig of a transformers config (Llama, Mistral, Qwen2, GPT-2 and the
mixtures of experts of models.hf_moe), the family a GPTConfig is written as, whether it fits that family, and the
transformers config it is saved with. transformers is imported only when config_to_hf runs."""
from typing import TYPE_CHECKING, Any

from .config import HF_FAMILIES, ROPE_SCALING_FIELDS, GPTConfig
from .hf_moe import MOE_FAMILIES, moe_config_kwargs, moe_fields, moe_problems

if TYPE_CHECKING:
    from transformers import PretrainedConfig

LLAMA_LIKE = ("llama", "mistral", "qwen2")
FAMILIES = HF_FAMILIES


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
