"""Model FLOPs of a GPTConfig (Narayanan et al. 2021, arXiv:2104.04473, §5.1): what the training log's tflops_per_rank
and the planner count.

Per token of a training step (forward 1x, backward 2x the matmuls):
    6 · N                       N: the blocks' matmul weights (q, k, v, output projection, MLP; GQA's smaller k/v)
  + 12 · L · heads·head_dim · s attention scores QKᵀ and the weighted sum AV (halved with causal_halved=True)
  + 6 · h · V                   the output layer (logits), V the real vocabulary (not the tp padding)
Embedding lookups, norms, biases, softmax and the loss are not counted; recomputation is not counted (model FLOPs,
not hardware FLOPs). With ffn = 4h, MHA and GELU this is Narayanan et al. (2021)'s 72·L·h²·(1 + s/(6h) + V/(12·L·h))
per token, their eq. 3 without the recomputed forward; full (not halved) causal attention is how they, PaLM and
torchtitan count it. A mixture-of-experts layer counts its active weights (as MoE papers report MFU): the router,
the k experts each token goes through and the shared expert, not the E experts it holds.

Multi-head latent attention (models/mla.py) counts its down- and up-projections and output projection in N, and its
scores and weighted sum at their own widths: 6 · L · heads · (qk_nope + qk_rope + v_head_dim) · s (the first line
above with head_dim = qk head = v head). Multi-token prediction's D depths count like D more layers (each depth's
block, its [2h, h] projection in N) and D more output layers (6 · D · h · V).
"""
from .config import GPTConfig


def _ffn(config: GPTConfig, size: int) -> int:
    return (3 if config.activation == "swiglu" else 2) * config.hidden_size * size


def attention_params(config: GPTConfig) -> int:
    """One layer's attention weights: GQA's q, k, v and output projections, or MLA's down-, up- and output
    projections."""
    c, h = config, config.hidden_size
    if not c.multi_latent_attention:
        return h * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim + c.num_heads * c.head_dim * h
    queries = c.num_heads * c.qk_head_dim
    q = h * queries if c.q_lora_rank is None else (h + queries) * c.q_lora_rank
    kv = h * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank * c.num_heads * (c.qk_nope_head_dim + c.v_head_dim)
    return q + kv + c.num_heads * c.v_head_dim * h


def _mlp(config, moe, active):
    c, h = config, config.hidden_size
    if not moe:
        return _ffn(c, c.ffn_hidden_size)
    experts = c.moe_router_topk if active else c.num_experts
    return c.num_experts * h + experts * _ffn(c, c.moe_ffn_hidden_size) + _ffn(c, c.moe_shared_expert_size)


def matmul_params(config: GPTConfig, *, active: bool = True) -> int:
    """Weights of the transformer blocks (and MTP depths) that multiply every token: N of the 6·N term
    (`active=False`: every expert, the parameters a mixture of experts holds)."""
    c = config
    moe_layers = sum(c.is_moe_layer(layer) for layer in range(c.num_layers))
    # (each layer's count depends only on whether it is a mixture of experts: two products, not L sums, as the
    # planner asks this for every plan it prices)
    total = c.num_layers * attention_params(c) + (c.num_layers - moe_layers) * _mlp(c, False, active) \
        + (moe_layers and moe_layers * _mlp(c, True, active))
    mtp = 2 * c.hidden_size ** 2 + attention_params(c) + _mlp(c, c.is_moe_layer(c.num_layers - 1), active)
    return total + c.mtp_num_layers * mtp


def attention_widths(config: GPTConfig) -> tuple[int, int]:
    """(q·k width, v width) of each head: (head_dim, head_dim), or MLA's (qk_nope + qk_rope, v_head_dim)."""
    return config.qk_head_dim, config.v_head_dim if config.multi_latent_attention else config.head_dim


def flops_per_token(config: GPTConfig, seq_len: int, *, causal_halved: bool = False) -> int:
    """Training FLOPs (forward + backward) per token of `seq_len`-token sequences."""
    c = config
    widths = sum(attention_widths(c))  # q·k and the v sum
    attention = 6 * (c.num_layers + c.mtp_num_layers) * c.num_heads * widths * seq_len
    logits = 6 * (1 + c.mtp_num_layers) * c.hidden_size * c.vocab_size
    return 6 * matmul_params(c) + (attention // 2 if causal_halved else attention) + logits
