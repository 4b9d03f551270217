"""Generation with multi-head latent attention (models/mla.py, models/generation.py): the cache holds the latent and
the rotated rope key per token and layer, (kv_lora_rank + qk_rope_head_dim) x layers x dtype bytes, the same on every
tp rank; greedy generation through it equals greedy generation by full recompute (the same tokens, every step's
logits within 1e-5 in fp32) for tiny-deepseek with and without the query latent, with YaRN, at tp 1 and tp 2; and
equals Hugging Face's DeepseekV3ForCausalLM.generate on the same random weights token for token."""
import pytest
import torch
import torch.distributed as dist

import models
import tp
from models.config import PRESETS
from models.generation import KVCache
from tp.testing import distributed

from .helpers import GREEDY_MARGIN, greedy_margin, rng
from .test_deepseek_hf import VOCAB, hf_deepseek

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "mscale": 1.0,
        "mscale_all_dim": 0.8, "beta_fast": 8, "beta_slow": 1}
CONFIGS = {  # name: changes to tiny-deepseek
    "q latent": {},
    "no q latent yarn": dict(q_lora_rank=None, rope_scaling=YARN),
}
PROMPT, NEW = 5, 12


def sharpened(model, factor):
    """The model with its matrices scaled by `factor`: sharper logits than the init's, so greedy paths have clear
    winners and varied tokens."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(factor)
    return model


def greedy_by_recompute(model, tokens, count):
    """(tokens [b, s + count], each step's logits [b, count, V]): every step runs the whole sequence, no cache."""
    steps = []
    with torch.no_grad():
        for _ in range(count):
            steps.append(model(tokens)[:, -1])
            tokens = torch.cat([tokens, steps[-1].argmax(-1, keepdim=True)], dim=1)
    return tokens, torch.stack(steps, dim=1)


def cached_logits(model, tokens):
    """The logits [b, s, V] of `tokens` [b, s] fed through a cache: the prompt, then one token at a time."""
    cache = KVCache(model, tokens.shape[0], tokens.shape[1])
    with torch.no_grad():
        pieces = [model(tokens[:, :PROMPT], cache=cache)]
        pieces += [model(tokens[:, i:i + 1], cache=cache) for i in range(PROMPT, tokens.shape[1])]
    return torch.cat(pieces, dim=1), cache


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("tp_size", [1, 2])
@distributed(world_size=2)
def test_cached_greedy_generation_equals_full_recompute(tp_size, name):
    mesh = tp.init_mesh(tp=tp_size, dp=2 // tp_size)
    config = models.GPTConfig(**(PRESETS["tiny-deepseek"] | CONFIGS[name]))
    torch.manual_seed(0)
    model = sharpened(models.GPT(config, group=mesh.tp_group), 4.0).eval()
    x = torch.randint(0, config.vocab_size, (2, PROMPT), generator=rng(3))
    expected, steps = greedy_by_recompute(model, x, NEW)
    assert greedy_margin(steps, expected[:, PROMPT:]) >= GREEDY_MARGIN
    assert len(set(expected[:, PROMPT:].flatten().tolist())) > 3  # (a real continuation, not one token repeated)
    assert torch.equal(model.generate(x, NEW), expected)
    logits, cache = cached_logits(model, expected)
    with torch.no_grad():
        full = model(expected)
    assert (logits - full).abs().max().item() <= 1e-5
    assert (logits[:, PROMPT - 1:-1] - steps).abs().max().item() <= 1e-5
    # the memory statement: the latent and the rope key per token and layer, whole on every tp rank
    per_token = (config.kv_lora_rank + config.qk_rope_head_dim) * config.num_layers * 4
    assert cache.bytes_per_token == per_token
    allocated = sum(t.numel() * t.element_size() for layer in cache.layers for t in layer)
    assert allocated == 2 * expected.shape[1] * per_token  # [b = 2, every position]
    if tp_size == 2:
        for layer in cache.layers:
            other = layer[0].clone()
            dist.broadcast(other, src=dist.get_global_rank(mesh.tp_group, 0), group=mesh.tp_group)
            assert torch.equal(other, layer[0])


@pytest.mark.parametrize("options", [{}, dict(q_lora=None, yarn=True)], ids=["q latent", "no q latent yarn"])
@pytest.mark.parametrize("tp_size", [1, 2])
@distributed(world_size=2)
def test_greedy_generation_equals_hugging_faces_deepseek_v3(tp_size, options):
    mesh = tp.init_mesh(tp=tp_size, dp=2 // tp_size)
    hf = sharpened(hf_deepseek("deepseek_v3", dtype=torch.float32, **options), 4.0)
    model = models.GPT.from_hf(hf, group=mesh.tp_group)
    x = torch.randint(0, VOCAB, (2, PROMPT), generator=rng(3))
    expected = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW, do_sample=False,
                           pad_token_id=0)
    with torch.no_grad():
        reference = hf(expected).logits
        assert (model(expected) - reference).abs().max().item() <= 1e-4
    assert greedy_margin(reference[:, PROMPT - 1:-1], expected[:, PROMPT:]) >= GREEDY_MARGIN
    assert len(set(expected[:, PROMPT:].flatten().tolist())) > 3
    assert torch.equal(model.generate(x, NEW), expected)

