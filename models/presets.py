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
}
MODELS = PRESETS | PUBLISHED_MODELS  # the registry: every named shape
