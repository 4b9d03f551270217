"""save_hf refuses what the target Hugging Face family cannot represent (on every rank, before any collective or file
write); one function picks the family for both the config and the tensor names; GPT's input errors name what the
caller passed."""
import os

import pytest
import torch

import models
import tp
from models import hf as hf_io
from tp.testing import distributed

from .helpers import rng

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=100, hidden_size=32, num_layers=1, num_heads=4, ffn_hidden_size=64, max_seq_len=16)
GPT2_LIKE = dict(position="learned", activation="gelu_tanh", norm="layernorm", bias=True, tie_embeddings=True)


def cfg(**changes):
    return models.GPTConfig(**TINY | changes)


# (config fields, the family written) for configs that have a Hugging Face equivalent.
WRITABLE = [
    (dict(), "llama"),
    (dict(bias=True), "llama"),
    (dict(bias=True, qkv_bias=True), "llama"),  # qkv_bias adds nothing when every linear has a bias
    (dict(num_kv_heads=2, tie_embeddings=True), "llama"),
    (dict(hf_model_type="mistral", sliding_window=8), "mistral"),
    (dict(hf_model_type="qwen2", qkv_bias=True, sliding_window=8), "qwen2"),
    (GPT2_LIKE, "gpt2"),  # no hf_model_type: learned positions are GPT-2's
    (GPT2_LIKE | dict(activation="gelu", hf_model_type="gpt2"), "gpt2"),
]


@pytest.mark.parametrize("fields,family", WRITABLE)
def test_family_is_decided_once_and_the_config_converts(fields, family):
    config = cfg(**fields)
    assert hf_io.hf_family(config) == family
    hf = hf_io.config_to_hf(config)
    assert hf.model_type == family
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        token = getattr(hf, name, None)
        assert token is None or 0 <= token < config.vocab_size, (name, token)
    back = hf_io.config_from_hf(hf)
    for name in ("vocab_size", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "ffn_hidden_size",
                 "activation", "norm", "position", "bias", "tie_embeddings", "sliding_window"):
        assert getattr(back, name) == getattr(config, name), name
    # and the tensor names follow the same family
    names = [n for n, _ in hf_io.hf_sources(config, "embedding.weight")]
    assert names == (["transformer.wte.weight"] if family == "gpt2" else ["model.embed_tokens.weight"])


# (config fields, what the message must name): every field the family cannot represent is refused up front.
REFUSED = [
    (dict(qkv_bias=True), r"qkv_bias=True"),  # llama: q/k/v bias only with o_proj and MLP biases (Qwen2's)
    (dict(activation="gelu"), r"activation='gelu'"),  # rope + gelu: no family
    (dict(norm="layernorm"), r"norm='layernorm'"),
    (dict(sliding_window=8), r"sliding_window=8"),  # llama has none
    (dict(hf_model_type="mistral", bias=True), r"bias=True"),
    (dict(hf_model_type="mistral", qkv_bias=True), r"qkv_bias=True"),
    (dict(hf_model_type="qwen2"), r"qkv_bias=False"),
    (dict(hf_model_type="qwen2", qkv_bias=True, bias=True), r"bias=True"),
    (dict(hf_model_type="gpt2"), r"activation='swiglu'.*norm='rmsnorm'.*position='rope'.*bias=False"),
    (GPT2_LIKE | dict(tie_embeddings=False, num_kv_heads=2), r"num_kv_heads=2.*tie_embeddings=False"),
    (GPT2_LIKE | dict(norm="rmsnorm", bias=False), r"norm='rmsnorm'.*bias=False"),
    (GPT2_LIKE | dict(head_dim=4), r"head_dim=4"),
    (GPT2_LIKE | dict(sliding_window=8), r"sliding_window=8"),
    (dict(position="learned"), r"activation='swiglu'"),  # learned positions: GPT-2's, which has no SwiGLU
]


@pytest.mark.parametrize("fields,message", REFUSED)
def test_configs_without_an_equivalent_are_refused_by_name(fields, message):
    config = cfg(**fields)
    with pytest.raises(ValueError, match=r"no Hugging Face .*equivalent.*" + message):
        hf_io.config_to_hf(config)
    with pytest.raises(ValueError, match=message):
        hf_io.check_hf(config)


def test_an_inferred_family_that_does_not_fit_names_one_that_does():
    with pytest.raises(ValueError, match=r"hf_model_type='qwen2' fits"):
        hf_io.check_hf(cfg(qkv_bias=True))
    with pytest.raises(ValueError, match=r"no other family fits either"):
        hf_io.check_hf(cfg(activation="gelu"))


def test_unknown_hf_model_type_is_refused():
    with pytest.raises(ValueError, match=r"hf_model_type='bert' must be one of"):
        cfg(hf_model_type="bert")


def test_a_family_is_its_registry_entry(monkeypatch):
    """GPTConfig's check, config_from_hf / config_to_hf, the tensor names and tp.parallelize's lookup all read the
    family from tp.hf.FAMILIES: one entry adds a family everywhere, and only families with a config class convert."""
    from tp.hf.mistral import Mistral

    class Renamed(Mistral):
        layers = "blocks"

    assert models.config.hf_families() == models.config.HF_FAMILIES
    assert "phi3" in tp.hf.FAMILIES and "phi3" not in models.config.HF_FAMILIES  # tp.parallelize only
    with pytest.raises(ValueError, match=r"hf_model_type='phi3' must be one of"):
        cfg(hf_model_type="phi3")
    monkeypatch.setitem(tp.hf.FAMILIES, "renamed", Renamed("renamed"))
    config = cfg(hf_model_type="renamed", sliding_window=8)
    assert hf_io.check_hf(config) == "renamed" and hf_io.config_to_hf(config).model_type == "mistral"
    sources = hf_io.hf_sources(config, "layers.0.attention.proj.weight", 2)
    assert sources == [("model.blocks.2.self_attn.o_proj.weight", False)]
    hf = transformers.MistralConfig(**hf_io.config_to_hf(config).to_dict())
    hf.model_type = "renamed"
    assert hf_io.config_from_hf(hf) == config
    model = transformers.MistralForCausalLM(hf)
    assert tp.hf.family_of(model).name == "renamed" and tp.hf.family_of(model).checked


@distributed(world_size=2)
def test_save_hf_refuses_on_every_rank_before_writing():
    import tempfile

    tp.init_mesh(tp=2)
    root = [tempfile.mkdtemp(prefix="tp-hf-refused-") if torch.distributed.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(root)
    for fields, message in ((dict(qkv_bias=True), r"qkv_bias=True"), (dict(activation="gelu"), r"activation='gelu'"),
                            (GPT2_LIKE | dict(norm="rmsnorm", bias=False), r"norm='rmsnorm'")):
        model = models.GPT(cfg(**fields))
        path = os.path.join(root[0], "out")
        with pytest.raises(ValueError, match=message):  # every rank, so no rank waits in a collective
            model.save_hf(path)
        torch.distributed.barrier()
        assert not os.path.exists(path), os.listdir(path)
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        os.rmdir(root[0])


@distributed(world_size=2)
def test_inferred_gpt2_saves_and_loads_with_valid_token_ids():
    """A GPT-2-shaped config without hf_model_type: written as GPT-2 (names and config agree), loads in transformers
    with the same logits and no missing weights."""
    import shutil
    import tempfile
    import warnings

    tp.init_mesh(tp=2)
    root = [tempfile.mkdtemp(prefix="tp-hf-gpt2-") if torch.distributed.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(root)
    torch.manual_seed(0)
    model = models.GPT(cfg(**GPT2_LIKE)).eval()
    model.save_hf(root[0])
    x = torch.randint(0, 100, (2, 8), generator=rng(1))
    ours = model(x)
    torch.distributed.barrier()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. a bos/eos id outside the vocabulary
        reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(root[0], output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert reloaded.config.model_type == "gpt2"
    for name in ("bos_token_id", "eos_token_id"):
        token = getattr(reloaded.config, name)
        assert token is None or 0 <= token < 100, (name, token)
    assert torch.allclose(reloaded.eval()(x).logits, ours, atol=1e-5)
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        shutil.rmtree(root[0])


@distributed(world_size=2)
def test_save_hf_replaces_an_earlier_export_in_the_same_directory():
    """Weight files an earlier export left that this one does not write are removed: transformers would load them
    (one file beside a sharded index, or the index beside one file)."""
    import shutil
    import tempfile

    from models.stages import build_stage

    mesh = tp.init_mesh(tp=1, pp=2)
    root = [tempfile.mkdtemp(prefix="tp-hf-reexport-") if torch.distributed.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(root)
    config = cfg(num_layers=2)
    x = torch.randint(0, 100, (2, 8), generator=rng(1))
    weight_files = lambda: sorted(f for f in os.listdir(root[0]) if f.startswith("model"))  # noqa: E731
    if mesh.pp_rank == 0:  # an earlier export: the one-file model of another seed
        torch.manual_seed(0)
        models.GPT(config, group=mesh.tp_group).save_hf(root[0])
    torch.distributed.barrier()
    torch.manual_seed(1)
    build_stage(config, mesh).save_hf(root[0], pp_group=mesh.pp_group)  # two stage files and an index
    torch.distributed.barrier()
    if mesh.pp_rank == 0:
        assert weight_files() == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                                  "model.safetensors.index.json"], weight_files()
        torch.manual_seed(1)
        model = models.GPT(config, group=mesh.tp_group).eval()  # PP-invariant init: the stages' weights
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(root[0]).eval()
        assert torch.allclose(reloaded(x).logits, model(x), atol=1e-5)
        model.save_hf(root[0])  # and back to one file
        assert weight_files() == ["model.safetensors"], weight_files()
        shutil.rmtree(root[0])


@distributed(world_size=2)
def test_input_errors_name_what_the_caller_passed():
    tp.init_mesh(tp=2)
    torch.manual_seed(0)
    model = models.GPT(cfg())
    assert model.padded_vocab_size == 256
    for bad in (-1, 100):
        with pytest.raises(ValueError, match=rf"token id {bad} is outside the vocabulary \[0, 100\)"):
            model(torch.full((1, 4), bad))
    tokens = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match=r"targets shape \(2, 4\) != tokens shape \(2, 8\)"):
        model(tokens, torch.zeros(2, 4, dtype=torch.long))  # every rank, before the embedding's collective
    with pytest.raises(ValueError, match=r"targets shape \(8, 2\) != tokens shape \(2, 8\)"):
        model(tokens, torch.zeros(8, 2, dtype=torch.long))
    assert model(tokens, tokens).dim() == 0  # still works
    for missing in ("/no/such/model", "no-such-dir"):  # (not transformers' hub-id message: local directories only)
        with pytest.raises(ValueError, match=rf"^from_hf {missing}: no such directory \(from_hf reads a directory "
                                             r"save_pretrained wrote\)$"):
            models.GPT.from_hf(missing)


@pytest.mark.parametrize("scaling", [dict(rope_type="linear", factor=4.0),
                                     dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                          original_max_position_embeddings=8)])
@distributed(world_size=2)
def test_scaled_rope_loads_matches_and_saves(scaling, tmp_path):
    """Llama 3.1-style ("llama3") and linear RoPE scaling: from_hf takes it, logits equal HF's at TP=2 on a sequence
    past original_max_position_embeddings, and save_hf writes it back (from_pretrained gives the same logits)."""
    tp.init_mesh(tp=2)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      rope_scaling=dict(scaling), bos_token_id=0, eos_token_id=1)
    dense = transformers.LlamaForCausalLM(config).eval()
    model = models.GPT.from_hf(dense).eval()
    assert model.config.rope_scaling == scaling
    x = torch.randint(0, 100, (2, 24), generator=rng(1))
    expected = dense(x).logits
    assert torch.allclose(model(x), expected, atol=1e-5)
    assert not torch.allclose(models.GPT.from_hf(dense, rope_scaling=None).eval()(x), expected, atol=1e-3)
    model.save_hf(tmp_path)
    torch.distributed.barrier()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.config.rope_parameters["rope_type"] == scaling["rope_type"]
    assert torch.allclose(reloaded(x).logits, expected, atol=1e-5)


LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=8)


@pytest.mark.parametrize("scaling,message", [
    (dict(rope_type="longrope", factor=2.0), "rope_type must be one of"),
    (dict(rope_type="llama3", factor=8.0), r"finite positive numbers for \['low_freq_factor', 'high_freq_factor'"),
    (dict(rope_type="linear", factor=0), r"finite positive numbers for \['factor'\]"),
    (dict(rope_type="linear", factor=float("nan")), r"finite positive numbers for \['factor'\]"),
    (dict(rope_type="linear", factor=-2.0), r"finite positive numbers for \['factor'\]"),
    (dict(rope_type="linear", factor=True), r"finite positive numbers for \['factor'\]"),
    (dict(rope_type="linear", factor=2.0, foo=[1, 2]), r"unknown fields \['foo'\]"),
    (LLAMA3 | dict(original_max_position_embeddings=0), "original_max_position_embeddings"),
    (LLAMA3 | dict(low_freq_factor=4.0), "low_freq_factor < high_freq_factor"),
])
def test_bad_rope_scaling_is_refused_by_name(scaling, message):
    with pytest.raises(ValueError, match=message):
        cfg(rope_scaling=scaling)


def test_rope_scaling_needs_rope():
    with pytest.raises(ValueError, match="scaling applies to RoPE only"):
        cfg(**GPT2_LIKE, rope_scaling=dict(rope_type="linear", factor=2.0))


@distributed(world_size=1)
def test_from_hf_then_save_hf_keeps_the_token_ids_and_the_generation_config(tmp_path):
    """An HF model's bos/eos/pad ids (eos a list, as Llama 3's) and its generation_config.json, read by from_hf
    (directory or model object), are written back by save_hf: the export stops generating where the source did (it
    wrote the family's defaults, eos 2, and no generation config)."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tp.init_mesh(tp=1)
    ids = dict(bos_token_id=5, eos_token_id=[6, 7], pad_token_id=0)
    source = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=64, **ids))
    source.generation_config = GenerationConfig(**ids, max_new_tokens=7, do_sample=True, temperature=0.6)
    source.save_pretrained(tmp_path / "source")
    for name, read in (("dir", tmp_path / "source"), ("object", source)):
        models.GPT.from_hf(read).save_hf(tmp_path / name)
        config = transformers.AutoConfig.from_pretrained(tmp_path / name)
        assert {k: getattr(config, k) for k in ids} == ids, name
        generation = GenerationConfig.from_pretrained(tmp_path / name)
        assert (generation.eos_token_id, generation.max_new_tokens, generation.temperature) == ([6, 7], 7, 0.6), name
    tokenizer = type("Tokenizer", (), dict(bos_token_id=1, eos_token_id=2, pad_token_id=3, save_pretrained=print))()
    # an SFT run's tokenizer: its ids in both files (generate reads them from generation_config.json)
    hf_io.save_hf(models.GPT.from_hf(source), tmp_path / "retokenized", tokenizer=tokenizer)
    for config in (transformers.AutoConfig, GenerationConfig):
        read = config.from_pretrained(tmp_path / "retokenized")
        assert [getattr(read, k) for k in ids] == [1, 2, 3], config
