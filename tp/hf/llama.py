"""Llama (`llama`), and the Llama-style decoder the other RoPE families here build on: RMSNorm, SwiGLU, RoPE, q/k/v
and gate/up projections that the GPT fuses, transformers' `model.layers.<i>` names."""
from typing import Any

from .family import Family


def no_biases(config: Any) -> list[tuple[bool, str, str]]:
    """The checks of a family without biases."""
    return [(not config.bias, "bias", "no biases"), (not config.qkv_bias, "qkv_bias", "no biases")]


class Llama(Family):
    config_class = "LlamaConfig"
    title = "Llama"
    layer_modules = {"norm1": ("input_layernorm",), "norm2": ("post_attention_layernorm",),
                     "attention.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                     "attention.proj": ("self_attn.o_proj",), "mlp.fc1": ("mlp.gate_proj", "mlp.up_proj"),
                     "mlp.fc2": ("mlp.down_proj",)}

    def attention_bias(self, hf: Any) -> bool:
        """Whether the config's q/k/v/o projections have biases (GPTConfig's `bias`, with the MLP's)."""
        return bool(getattr(hf, "attention_bias", False))

    def qkv_bias(self, hf: Any) -> bool:
        """Whether the config's q/k/v projections alone have biases (GPTConfig's `qkv_bias`)."""
        return False

    def config_fields(self, hf: Any) -> dict[str, Any]:
        if hf.hidden_act != "silu":
            raise ValueError(f"hidden_act={hf.hidden_act!r} is not supported (SwiGLU needs 'silu')")
        attention_bias, mlp_bias = self.attention_bias(hf), bool(getattr(hf, "mlp_bias", False))
        if attention_bias != mlp_bias:
            raise ValueError(f"attention_bias={attention_bias} with mlp_bias={mlp_bias}: GPTConfig's `bias` covers "
                             "every linear")
        window = getattr(hf, "sliding_window", None) if getattr(hf, "use_sliding_window", True) is not False else None
        return dict(vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, num_layers=hf.num_hidden_layers,
                    num_heads=hf.num_attention_heads, num_kv_heads=hf.num_key_value_heads,
                    head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
                    ffn_hidden_size=hf.intermediate_size, max_seq_len=hf.max_position_embeddings,
                    activation="swiglu", norm="rmsnorm", norm_eps=hf.rms_norm_eps, position="rope",
                    bias=attention_bias, qkv_bias=self.qkv_bias(hf), tie_embeddings=bool(hf.tie_word_embeddings),
                    sliding_window=window or None)

    def dense_checks(self, config: Any) -> list[tuple[bool, str, str]]:
        c = config
        return [(c.activation == "swiglu", "activation", "'swiglu'"), (c.norm == "rmsnorm", "norm", "'rmsnorm'"),
                (c.position == "rope", "position", "'rope'"), *self.bias_window_checks(c)]

    def bias_window_checks(self, config: Any) -> list[tuple[bool, str, str]]:
        """The checks of the biases and the sliding window: Llama's attention_bias = mlp_bias = bias, so q/k/v
        biases only together with all the others; no sliding window."""
        c = config
        return [(c.bias or not c.qkv_bias, "qkv_bias", "q/k/v biases only with bias=True (every linear); q/k/v "
                 "biases alone are Qwen2's"),
                (c.sliding_window is None, "sliding_window", "no sliding window; Mistral and Qwen2 have one")]

    def config_kwargs(self, config: Any) -> dict[str, Any]:
        c = config
        return dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=self.intermediate_size(c),
                    num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                    num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, max_position_embeddings=c.max_seq_len,
                    rms_norm_eps=c.norm_eps, rope_theta=c.rope_theta, tie_word_embeddings=c.tie_embeddings,
                    hidden_act="silu", **self.bias_window_kwargs(c))

    def intermediate_size(self, config: Any) -> int:
        """The config's intermediate_size: the dense MLP's."""
        return config.ffn_hidden_size

    def bias_window_kwargs(self, config: Any) -> dict[str, Any]:
        """The config's biases and sliding window."""
        return {"attention_bias": config.bias, "mlp_bias": config.bias}


LLAMA = Llama("llama")
