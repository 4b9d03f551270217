"""Autoregressive generation for a GPT (`GPT.generate`): a prefill pass over the prompt, then one token per step, with
a KV cache sharded over tp by heads.

Each tensor-parallel rank caches the keys and values of its own kv heads only ([b, kv_heads/tp, s, d] per layer:
the heads its fused QKV column produces), so the cache takes 1/tp of the memory (multi-head latent attention caches
each token's latent and rope key instead, whole on every rank: models/mla.py) and a step needs the layers' usual
all-reduces and one all-gather of the last position's logits: every tp rank then holds the same logits and picks
the same token (sampling draws from a generator seeded alike on every rank). Greedy generation equals Hugging
Face's `generate(do_sample=False)` on the exported weights token for token. `Text` turns a prompt into ids and the
chosen ids back into streamed text (a Hugging Face tokenizer, or UTF-8 bytes).
"""
import codecs
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class KVCache:
    """Per layer, what its attention caches (`attention.cache_shapes`): GQA this rank's keys and values
    [b, kv heads/tp, max_len, d], multi-head latent attention one [b, 1, max_len, kv_lora_rank + qk_rope_head_dim]
    (models/mla.py); the first `length` positions are filled."""

    def __init__(self, model: nn.Module, batch_size: int, max_len: int):
        param = next(model.parameters())
        self.layers = [tuple(param.new_zeros(shape) for shape in block.attention.cache_shapes(batch_size, max_len))
                       for block in model.layers]
        self.length, self.max_len = 0, max_len

    @property
    def bytes_per_token(self) -> int:
        """The bytes one cached position of one sequence takes on this rank, every layer's tensors together."""
        return sum(t[0, :, 0].numel() * t.element_size() for tensors in self.layers for t in tensors)

    def layer(self, index: int) -> "LayerCache":
        return LayerCache(self, index)

    def position_ids(self, tokens: torch.Tensor) -> torch.Tensor:
        """[b, s]: the positions of `tokens` [b, s], which follow the cached ones."""
        start, (batch, count) = self.length, tokens.shape
        return torch.arange(start, start + count, device=tokens.device).expand(batch, count)

    def advance(self, count: int) -> None:
        """`count` more positions are cached (every layer has written them)."""
        self.length += count


class LayerCache:
    """One layer's view of the cache, for the attention's forward: where its new tokens sit, and attention over the
    cached positions and the new ones."""

    def __init__(self, cache: KVCache, index: int):
        self.cache, self.index = cache, index

    def positions(self, count: int, device: torch.device) -> tuple[torch.Tensor, int]:
        """(positions [count] of the new tokens, the table length) for RoPE: one table for the whole cache."""
        start = self.cache.length
        return torch.arange(start, start + count, device=device), self.cache.max_len

    def store(self, *new: torch.Tensor) -> list[torch.Tensor]:
        """Writes this layer's tensors of the new tokens ([b, n, s, d] each, in `cache_shapes` order) after the
        cached positions -> each tensor's filled part, the cached positions and the new ones [b, n, length + s, d]."""
        start, count = self.cache.length, new[0].shape[2]
        filled = []
        for cached, tensor in zip(self.cache.layers[self.index], new, strict=True):
            cached[:, :, start:start + count] = tensor
            filled.append(cached[:, :, :start + count])
        return filled

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v [b, heads/tp | kv heads/tp, s, d] of the new tokens -> the attention output [b, heads/tp, s, d]
        over the cached keys and values and these."""
        return self.attention(q, *self.store(k, v))

    def attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                  scale: float | None = None) -> torch.Tensor:
        """Softmax(q keysᵀ · scale) values, q [b, heads/tp, s, d] of the new tokens, keys and values
        [b, kv heads, length + s, d | dv] (kv heads dividing the query heads): each new query sees every cached
        position and the new ones up to its own."""
        start, count = keys.shape[2] - q.shape[2], q.shape[2]
        gqa = q.shape[1] != keys.shape[1]
        if start == 0:  # the prefill: plain causal attention
            return F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale, enable_gqa=gqa)
        # query i (at position start + i) sees keys 0..start + i (SDPA's is_causal aligns to the top left instead)
        mask = torch.arange(start + count, device=q.device) <= torch.arange(start, start + count,
                                                                            device=q.device)[:, None]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """One ValueError line for sampling options that do not go together."""
    if not temperature >= 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0: greedy)")
    if temperature == 0 and (top_k is not None or top_p is not None):
        raise ValueError("top_k and top_p choose what is sampled: they need temperature > 0 (0 is greedy)")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k} must be >= 1")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} must be in (0, 1]")


def next_tokens(logits: torch.Tensor, *, temperature: float, top_k: int | None, top_p: float | None,
                generator: torch.Generator | None) -> torch.Tensor:
    """logits [b, V] -> the next token of each row [b]: the argmax at temperature 0, else a draw (Hugging Face's
    order: temperature, then top-k, then top-p)."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        ordered, order = logits.sort(dim=-1, descending=True)
        before = ordered.softmax(-1).cumsum(-1) - ordered.softmax(-1)  # the probability of the likelier tokens
        ordered = ordered.masked_fill(before >= top_p, float("-inf"))  # (the likeliest token always stays)
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, ordered)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


def generate(model: nn.Module, tokens: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, eos_token_id: int | None = None,
             generator: torch.Generator | None = None,
             on_token: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
    """GPT.generate; `on_token(ids [b])` is called with each new token as it is chosen (streaming)."""
    check_sampling(temperature, top_k, top_p)
    if not (model.pre_process and model.post_process):
        raise ValueError("generate needs the whole model on this rank: not a pipeline stage")
    if model.cp_size > 1 or model.config.sequence_parallel:
        raise ValueError("generate runs without context or sequence parallelism: build the model with cp 1 and "
                         "sequence_parallel=False")
    if tokens.dim() != 2 or tokens.shape[1] == 0:
        raise ValueError(f"tokens must be [batch, seq] with seq >= 1, got shape {tuple(tokens.shape)}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
    total = tokens.shape[1] + max_new_tokens
    if total > model.config.max_seq_len:
        raise ValueError(f"the prompt ({tokens.shape[1]} tokens) and max_new_tokens={max_new_tokens} exceed the "
                         f"model's context, max_seq_len={model.config.max_seq_len}")
    was_training = model.training
    model.eval()
    try:
        cache = KVCache(model, tokens.shape[0], total)
        out, done = [tokens], torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
        logits = model(tokens, cache=cache)[:, -1] if max_new_tokens else None  # the prefill: [b, V]
        for i in range(max_new_tokens):
            chosen = next_tokens(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
            if eos_token_id is not None:
                chosen = chosen.masked_fill(done, eos_token_id)
                done |= chosen == eos_token_id
            out.append(chosen[:, None])
            if on_token is not None:
                on_token(chosen)
            if i + 1 == max_new_tokens or bool(done.all()):
                break
            logits = model(chosen[:, None], cache=cache)[:, -1]  # one token through every layer
        return torch.cat(out, dim=1)
    finally:
        model.train(was_training)


class Text:
    """The prompt's ids and the continuation's text: a Hugging Face tokenizer, or UTF-8 bytes (a token past 255, from
    a model with a larger vocabulary and no tokenizer, shown as <|id|>)."""

    def __init__(self, tokenizer: Any | None):
        self.tokenizer = tokenizer
        self.eos = tokenizer.eos_token_id if tokenizer is not None else None
        self.ids, self.shown = [], ""
        self.bytes = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text) if self.tokenizer is not None else list(text.encode("utf-8"))

    def more(self, token: int) -> str:
        """The text `token` adds to the continuation (streaming: a multi-byte character once it is whole)."""
        if self.tokenizer is None:
            if token > 255:  # (an unfinished character before it ends as U+FFFD)
                return self.bytes.decode(b"", final=True) + f"<|{token}|>"
            return self.bytes.decode(bytes([token]))
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an unfinished character: wait for its next bytes
            return ""
        new, self.shown = text[len(self.shown):], text
        return new
