"""The named model shapes: one registry, MODELS (name -> GPTConfig fields), that `python -m models.train --model` and
`python -m bench.plan --model` both take. PRESETS are the small shapes sized to train on a CPU; PUBLISHED_MODELS the
published models' shapes, which the job trains too once shrunk by its flags (--num-layers, --hidden-size, ... override
any field)."""

DEFAULT_MODEL = "tiny"  # models.train's model when neither --model nor --from-hf is given

# Small shapes, sized to train on a CPU.
PRESETS = {
    "tiny": dict(vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, ffn_hidden_size=192,
                 max_seq_len=256),
    "small": dict(vocab_size=256, hidden_size=128, num_layers=4, num_heads=8, num_kv_heads=4, ffn_hidden_size=384,
                  max_seq_len=512),
    "medium": dict(vocab_size=256, hidden_size=256, num_layers=8, num_heads=8, num_kv_heads=8, ffn_hidden_size=768,
                   max_seq_len=1024),
    # mixtures of experts: tiny's and small's shapes, experts a quarter (tiny) / an eighth (small) of the dense FFN's
    # size active per token, small-moe with a shared expert and DeepSeek's first dense layer
    "tiny-moe": dict(vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, ffn_hidden_size=192,
                     max_seq_len=256, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=96,
                     moe_aux_loss_coeff=1e-2),
    "small-moe": dict(vocab_size=256, hidden_size=128, num_layers=4, num_heads=8, num_kv_heads=4, ffn_hidden_size=384,
                      max_seq_len=512, num_experts=16, moe_router_topk=2, moe_ffn_hidden_size=96,
                      moe_shared_expert_size=192, moe_layer_freq=[0, 1, 1, 1], moe_aux_loss_coeff=1e-2,
                      moe_z_loss_coeff=1e-3),
    # DeepSeek-V3's architecture at tiny's width (multi-head latent attention, a dense first layer, sigmoid routing
    # in groups with a shared expert and the sequence-wise loss, one MTP depth)
    "tiny-deepseek": dict(vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, ffn_hidden_size=192,
                          max_seq_len=256, norm_eps=1e-6, multi_latent_attention=True, q_lora_rank=32,
                          kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                          rope_interleave=True, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=48,
                          moe_shared_expert_size=48, moe_layer_freq=[0, 1, 1, 1], moe_router_score="sigmoid",
                          moe_router_num_groups=4, moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5,
                          moe_seq_aux_loss_coeff=1e-4, mtp_num_layers=1, mtp_loss_scaling_factor=0.3),
}
# Published models' shapes (Llama 3 paper, Dubey et al. 2024, Table 3; GPT-3 paper, Brown et al. 2020, Table 2.1): as
# published, too large to train here (bench.plan plans them; models.train trains them shrunk by its flags).
PUBLISHED_MODELS = {
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                      ffn_hidden_size=14336, max_seq_len=131072, rope_theta=500000.0),
    "llama3-70b": dict(vocab_size=128256, hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8,
                       ffn_hidden_size=28672, max_seq_len=131072, rope_theta=500000.0),
    "llama3-405b": dict(vocab_size=128256, hidden_size=16384, num_layers=126, num_heads=128, num_kv_heads=8,
                        ffn_hidden_size=53248, max_seq_len=131072, rope_theta=500000.0),
    "gpt3-175b": dict(vocab_size=50257, hidden_size=12288, num_layers=96, num_heads=96, activation="gelu",
                      norm="layernorm", bias=True, position="learned", max_seq_len=2048),
    # mixtures of experts (their Hugging Face config.json: mistralai/Mixtral-8x7B-v0.1, Mixtral-8x22B-v0.1,
    # Qwen/Qwen3-30B-A3B)
    "mixtral-8x7b": dict(vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                         ffn_hidden_size=14336, max_seq_len=32768, rope_theta=1e6, num_experts=8, moe_router_topk=2),
    "mixtral-8x22b": dict(vocab_size=32768, hidden_size=6144, num_layers=56, num_heads=48, num_kv_heads=8,
                          ffn_hidden_size=16384, max_seq_len=65536, rope_theta=1e6, num_experts=8, moe_router_topk=2),
    "qwen3-30b-a3b": dict(vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4,
                          head_dim=128, ffn_hidden_size=6144, max_seq_len=40960, rope_theta=1e6, qk_norm="head",
                          num_experts=128, moe_router_topk=8, moe_ffn_hidden_size=768, norm_eps=1e-6),
    # DeepSeek-V3 (deepseek-ai/DeepSeek-V3's config.json; α = 1e-4 and λ = 0.3 from its report, arXiv:2412.19437)
    # and Kimi K2 (moonshotai/Kimi-K2-Instruct's config.json: DeepSeek-V3's architecture, 384 experts, 64 heads)
    "deepseek-v3": dict(
        vocab_size=129280, hidden_size=7168, num_layers=61, num_heads=128, ffn_hidden_size=18432, max_seq_len=163840,
        norm_eps=1e-6, rope_theta=10000.0, rope_scaling=dict(
            rope_type="yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
            mscale=1.0, mscale_all_dim=1.0), multi_latent_attention=True, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rope_interleave=True, num_experts=256,
        moe_router_topk=8, moe_ffn_hidden_size=2048, moe_shared_expert_size=2048, moe_layer_freq=[0] * 3 + [1] * 58,
        moe_router_score="sigmoid", moe_router_num_groups=8, moe_router_group_topk=4,
        moe_router_topk_scaling_factor=2.5, moe_seq_aux_loss_coeff=1e-4, mtp_num_layers=1,
        mtp_loss_scaling_factor=0.3),
    "kimi-k2": dict(
        vocab_size=163840, hidden_size=7168, num_layers=61, num_heads=64, ffn_hidden_size=18432, max_seq_len=131072,
        norm_eps=1e-6, rope_theta=50000.0, rope_scaling=dict(
            rope_type="yarn", factor=32.0, original_max_position_embeddings=4096, beta_fast=1.0, beta_slow=1.0,
            mscale=1.0, mscale_all_dim=1.0), multi_latent_attention=True, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rope_interleave=True, num_experts=384,
        moe_router_topk=8, moe_ffn_hidden_size=2048, moe_shared_expert_size=2048, moe_layer_freq=[0] + [1] * 60,
        moe_router_score="sigmoid", moe_router_topk_scaling_factor=2.827),
}
MODELS = PRESETS | PUBLISHED_MODELS  # the registry: every named shape
