"""GPT-2 (`gpt2`): transformers' Conv1D layers (weights [in, out]) with a fused c_attn, learned positions,
LayerNorm, GELU, biases everywhere, tied embeddings. HF ships no tensor-parallel plan for it: tp's is here."""
from typing import Any

from torch import nn

from .family import Family

ACTIVATIONS = {"gelu_tanh": "gelu_new", "gelu": "gelu"}  # the GPT's -> transformers' (which reads both tanh names)


class Gpt2(Family):
    plan = {"h.*.attn.c_attn": "colwise", "h.*.attn.c_proj": "rowwise", "h.*.mlp.c_fc": "colwise",
            "h.*.mlp.c_proj": "rowwise"}
    heads = {"c_attn": "qkv"}
    out = "c_proj"
    replicate_kv = False

    config_class = "GPT2Config"
    title = "GPT-2"
    root, embedding, layers, final_norm = "transformer", "wte", "h", "ln_f"
    layer_modules = {"norm1": ("ln_1",), "norm2": ("ln_2",), "attention.qkv": ("attn.c_attn",),
                     "attention.proj": ("attn.c_proj",), "mlp.fc1": ("mlp.c_fc",), "mlp.fc2": ("mlp.c_proj",)}
    conv1d = True

    def localize(self, attention: nn.Module, heads: int, kv_heads: int) -> None:
        attention.num_heads, attention.split_size = heads, heads * attention.head_dim  # c_attn's output splits by it

    def config_fields(self, hf: Any) -> dict[str, Any]:
        act = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}.get(hf.activation_function)
        if act is None:
            raise ValueError(f"GPT-2 activation_function={hf.activation_function!r} is not supported")
        return dict(vocab_size=hf.vocab_size, hidden_size=hf.n_embd, num_layers=hf.n_layer, num_heads=hf.n_head,
                    ffn_hidden_size=hf.n_inner or 4 * hf.n_embd, max_seq_len=hf.n_positions, activation=act,
                    norm="layernorm", norm_eps=hf.layer_norm_epsilon, position="learned", bias=True,
                    tie_embeddings=True)

    def dense_checks(self, config: Any) -> list[tuple[bool, str, str]]:
        c = config
        return [(c.activation in ACTIVATIONS, "activation", "'gelu_tanh' or 'gelu'"),
                (c.norm == "layernorm", "norm", "'layernorm'"), (c.position == "learned", "position", "'learned'"),
                (c.bias, "bias", "a bias on every linear and norm"),
                (c.num_kv_heads == c.num_heads, "num_kv_heads", f"no GQA/MQA: num_heads={c.num_heads}"),
                (c.head_dim * c.num_heads == c.hidden_size, "head_dim",
                 f"hidden_size / num_heads = {c.hidden_size}/{c.num_heads}"),
                (c.tie_embeddings, "tie_embeddings", "the output layer tied to the embedding"),
                (c.sliding_window is None, "sliding_window", "no sliding window")]

    def config_kwargs(self, config: Any) -> dict[str, Any]:
        c = config
        return dict(vocab_size=c.vocab_size, n_embd=c.hidden_size, n_layer=c.num_layers, n_head=c.num_heads,
                    n_inner=c.ffn_hidden_size, n_positions=c.max_seq_len, activation_function=ACTIVATIONS[c.activation],
                    layer_norm_epsilon=c.norm_eps, tie_word_embeddings=True)


GPT2 = Gpt2("gpt2")
