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
"""
from .config import GPTConfig


def _ffn(config: GPTConfig, size: int) -> int:
    return (3 if config.activation == "swiglu" else 2) * config.hidden_size * size


def matmul_params(config: GPTConfig, *, active: bool = True) -> int:
    """Weights of the transformer blocks that multiply every token: N of the 6·N term (`active=False`: every expert,
    the parameters a mixture of experts holds)."""
    c = config
    h, d = c.hidden_size, c.head_dim
    attention = h * (c.num_heads + 2 * c.num_kv_heads) * d + c.num_heads * d * h
    total = 0
    for layer in range(c.num_layers):
        if c.is_moe_layer(layer):
            experts = c.moe_router_topk if active else c.num_experts
            mlp = c.num_experts * h + experts * _ffn(c, c.moe_ffn_hidden_size) + _ffn(c, c.moe_shared_expert_size)
        else:
            mlp = _ffn(c, c.ffn_hidden_size)
        total += attention + mlp
    return total


def flops_per_token(config: GPTConfig, seq_len: int, *, causal_halved: bool = False) -> int:
    """Training FLOPs (forward + backward) per token of `seq_len`-token sequences."""
    attention = 12 * config.num_layers * config.num_heads * config.head_dim * seq_len
    logits = 6 * config.hidden_size * config.vocab_size
    return 6 * matmul_params(config) + (attention // 2 if causal_halved else attention) + logits
