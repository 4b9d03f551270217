"""DeepSeek-V3 (`deepseek_v3`; Kimi K2 ships the same config class): multi-head latent attention (the GPT's
multi_latent_attention), and `DeepseekMoE`, the mixture of experts GLM-4.5 shares with it: sigmoid scores with the
selection bias (`mlp.gate.e_score_correction_bias`, models.hf reads and writes it beside the router's weight),
group-limited top-k (n_group, topk_group), the weights times
routed_scaling_factor, shared experts (`mlp.shared_experts`, no gate), the first first_k_dense_replace layers dense.

Multi-token prediction: DeepSeek's published checkpoints hold num_nextn_predict_layers MTP layers after the last
(`model.layers.<num_hidden_layers + k>.`: enorm, hnorm, eh_proj, shared_head.norm and a decoder layer's tensors;
tp.hf.family.MTP_MODULES), which transformers' model does not have and leaves out on load. models.GPT.from_hf reads
them as its MTP depths when the source holds them (mtp_num_layers = num_nextn_predict_layers; none when it does not,
as in a model transformers saved), and save_hf writes them there, with num_nextn_predict_layers, for DeepSeek's
own code and for the GPT to read back (transformers lists them as unexpected keys and ignores them)."""
from typing import Any

from .family import MOE_TENSORS
from .moe import MoE

# our MLA attention's modules -> transformers' (models/mla.py)
MLA_MODULES = {"attention.q": ("self_attn.q_proj",), "attention.q_down": ("self_attn.q_a_proj",),
               "attention.q_latent_norm": ("self_attn.q_a_layernorm",), "attention.q_up": ("self_attn.q_b_proj",),
               "attention.kv_down": ("self_attn.kv_a_proj_with_mqa",),
               "attention.kv_latent_norm": ("self_attn.kv_a_layernorm",), "attention.kv_up": ("self_attn.kv_b_proj",),
               "attention.proj": ("self_attn.o_proj",)}
DENSE_MODULES = {"norm1": ("input_layernorm",), "norm2": ("post_attention_layernorm",),
                 "mlp.fc1": ("mlp.gate_proj", "mlp.up_proj"), "mlp.fc2": ("mlp.down_proj",)}


def first_dense(config: Any) -> int | None:
    """How many first layers are dense when the rest are all MoE (first_k_dense_replace), else None."""
    pattern = [int(config.is_moe_layer(i)) for i in range(config.num_layers)]
    dense = pattern.index(1) if 1 in pattern else config.num_layers
    return dense if pattern == [0] * dense + [1] * (config.num_layers - dense) else None


class DeepseekMoE(MoE):
    """The mixture of experts of DeepSeek-V3 and GLM-4.5 (the module docstring)."""

    experts_field = "n_routed_experts"
    score = "sigmoid"
    layer_tensors = {**{k: v for k, v in MOE_TENSORS.items() if ".shared." not in k},
                     "mlp.shared.fc1.weight": ("mlp.shared_experts.gate_proj.weight",
                                               "mlp.shared_experts.up_proj.weight"),
                     "mlp.shared.fc2.weight": ("mlp.shared_experts.down_proj.weight",)}

    def config_fields(self, hf: Any) -> dict[str, Any]:
        return super().config_fields(hf) | dict(mtp_num_layers=getattr(hf, "num_nextn_predict_layers", 0) or 0)

    def expert_fields(self, hf: Any) -> dict[str, Any]:
        layers, dense = hf.num_hidden_layers, hf.first_k_dense_replace or 0
        return dict(moe_ffn_hidden_size=hf.moe_intermediate_size,
                    moe_layer_freq=[int(i >= dense) for i in range(layers)] if dense else 1,
                    moe_shared_expert_size=(hf.n_shared_experts or 0) * hf.moe_intermediate_size,
                    moe_router_score=self.score, moe_router_num_groups=hf.n_group or 1,
                    moe_router_group_topk=hf.topk_group if (hf.n_group or 1) > 1 else None,
                    moe_router_topk_scaling_factor=float(hf.routed_scaling_factor))

    def moe_checks(self, config: Any) -> list[tuple[bool, str, str]]:
        c = config
        if not c.num_experts:
            return [(False, "num_experts", "a mixture of experts")]
        shared = c.moe_shared_expert_size
        return [(c.moe_router_score == self.score, "moe_router_score", f"{self.score} routing"),
                (first_dense(c) is not None, "moe_layer_freq", "dense first layers, then experts in every layer"),
                (shared % c.moe_ffn_hidden_size == 0, "moe_shared_expert_size",
                 f"shared experts of moe_ffn_hidden_size={c.moe_ffn_hidden_size} each"),
                (not c.moe_shared_expert_gate, "moe_shared_expert_gate", "no shared-expert gate")]

    def config_kwargs(self, config: Any) -> dict[str, Any]:
        c = config
        return dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.ffn_hidden_size,
                    num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                    max_position_embeddings=c.max_seq_len, rms_norm_eps=c.norm_eps,
                    tie_word_embeddings=c.tie_embeddings, hidden_act="silu", n_routed_experts=c.num_experts,
                    num_experts_per_tok=c.moe_router_topk, moe_intermediate_size=c.moe_ffn_hidden_size,
                    n_shared_experts=c.moe_shared_expert_size // c.moe_ffn_hidden_size,
                    first_k_dense_replace=first_dense(c), norm_topk_prob=c.moe_router_norm_topk,
                    n_group=c.moe_router_num_groups, topk_group=c.moe_router_group_topk or 1,
                    routed_scaling_factor=c.moe_router_topk_scaling_factor,
                    num_nextn_predict_layers=c.mtp_num_layers,
                    rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta})


class DeepseekV3(DeepseekMoE):
    config_class = "DeepseekV3Config"
    title = "DeepSeek-V3"
    layer_modules = {**DENSE_MODULES, **MLA_MODULES}
    # tp.parallelize: multi-head latent attention's projections per head (every head its own k and v), of
    # qk_nope + qk_rope (queries) and qk_nope + v (kv_b_proj) features; the attention reshapes with -1 heads
    heads = {"q_proj": "q", "q_b_proj": "q", "kv_b_proj": "q"}

    def head_width(self, attention: Any, leaf: str) -> int | None:
        if leaf == "kv_b_proj":
            return attention.qk_nope_head_dim + attention.v_head_dim
        return attention.qk_head_dim

    def config_fields(self, hf: Any) -> dict[str, Any]:
        fields = super().config_fields(hf)  # (Llama's: num_key_value_heads and head_dim do not apply)
        del fields["num_kv_heads"], fields["head_dim"]
        return fields | self.attention_fields(hf)

    def attention_fields(self, hf: Any) -> dict[str, Any]:
        """The GPT's multi-head latent attention of the config."""
        return dict(multi_latent_attention=True, q_lora_rank=hf.q_lora_rank, kv_lora_rank=hf.kv_lora_rank,
                    qk_nope_head_dim=hf.qk_nope_head_dim, qk_rope_head_dim=hf.qk_rope_head_dim,
                    v_head_dim=hf.v_head_dim, rope_interleave=self.interleaved(hf))

    def interleaved(self, hf: Any) -> bool:
        """Whether the rotated features are interleaved pairs (rope_interleave)."""
        return bool(hf.rope_interleave)

    def dense_checks(self, config: Any) -> list[tuple[bool, str, str]]:
        c = config
        return [(c.activation == "swiglu", "activation", "'swiglu'"), (c.norm == "rmsnorm", "norm", "'rmsnorm'"),
                (c.multi_latent_attention, "multi_latent_attention", "multi-head latent attention"),
                (not c.bias, "bias", "no biases"), (c.rotary_percent == 1, "rotary_percent", "RoPE on every "
                                                    "qk_rope_head_dim feature"),
                (c.sliding_window is None, "sliding_window", "no sliding window")]

    def config_kwargs(self, config: Any) -> dict[str, Any]:
        c = config
        return super().config_kwargs(c) | dict(
            num_key_value_heads=c.num_heads, q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank,
            qk_nope_head_dim=c.qk_nope_head_dim, qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim,
            rope_interleave=c.rope_interleave, attention_bias=False)


DEEPSEEK_V3 = DeepseekV3("deepseek_v3")
