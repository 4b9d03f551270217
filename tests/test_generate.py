"""Generation (`GPT.generate`, `python -m models.generate`): greedy output through the KV cache equals Hugging Face's
`generate` on the same weights token for token (Llama with GQA, GPT-2's learned positions, Mixtral's experts on one
prompt: odd token counts at tp 2), at tp 1 and tp 2 (the cache sharded by heads: kv heads fewer than, equal to tp);
the cache path gives the no-cache logits; sampling is seeded; bad input is one line. The command: prompt then
continuation, streamed; its refusals before any process."""
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import models
import tp
from models.generate import main
from models.generation import next_tokens
from tp.testing import distributed

from .helpers import GREEDY_MARGIN, greedy_margin, rng, train_refusal

transformers = pytest.importorskip("transformers")

VOCAB = 50


def hf_model(family, kv_heads=2, seed=0, positions=48):
    torch.manual_seed(seed)
    if family == "mixtral":
        config = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24,
                                            num_hidden_layers=2, head_dim=4, num_attention_heads=4,
                                            num_key_value_heads=kv_heads, max_position_embeddings=positions,
                                            num_local_experts=4, num_experts_per_tok=2)
    elif family == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=4, n_positions=positions,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    else:
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24,
                                          num_hidden_layers=2, head_dim=4, num_attention_heads=4,
                                          num_key_value_heads=kv_heads, max_position_embeddings=positions)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # sharper logits than the init's: greedy paths with clear winners, varied tokens
        for p in model.parameters():
            p.mul_(8.0 if p.dim() > 1 else 1.0)
    return model


def prompts():
    return torch.randint(0, VOCAB, (2, 5), generator=rng(3))


@pytest.mark.parametrize("tp_size", [1, 2])
@distributed(world_size=2)
def test_greedy_equals_hugging_face_token_for_token(tp_size):
    tp.init_mesh(tp=tp_size, dp=2 // tp_size)
    group = tp.get_mesh().tp_group
    for family, kv_heads, batch, seed in (("llama", 1, 2, 0), ("llama", 2, 2, 0), ("gpt2", 4, 2, 0),
                                          ("mixtral", 2, 1, 7)):
        hf = hf_model(family, kv_heads, seed)
        model = models.GPT.from_hf(hf, group=group)
        x = prompts()[:batch]  # (one prompt of 5 tokens, then 1 a step: token counts tp 2 does not divide, MoE)
        expected = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False,
                               pad_token_id=0)
        ours = model.generate(x, 12)
        # equal tokens on any machine: our logits along HF's greedy sequence are HF's within 1e-4 (the cache's within
        # 1e-5 of them, below) and each step's choice leads by GREEDY_MARGIN (tests/helpers.py)
        with torch.no_grad():
            reference = hf(expected).logits
            assert (model(expected) - reference).abs().max().item() <= 1e-4
        assert greedy_margin(reference[:, 4:-1], expected[:, 5:]) >= GREEDY_MARGIN, (family, kv_heads)
        assert ours.shape == (batch, 17) and torch.equal(ours, expected), (family, kv_heads, ours, expected)
        assert len(set(ours[:, 5:].flatten().tolist())) > 3  # (a real continuation, not one token repeated)
        # the cache path's logits are the full forward's at every position
        full = model(ours)
        cache = models.generation.KVCache(model, batch, 17)
        pieces = [model(ours[:, :5], cache=cache)] + [model(ours[:, i:i + 1], cache=cache) for i in range(5, 17)]
        assert torch.allclose(torch.cat(pieces, 1), full, atol=1e-5)


@distributed(world_size=2)
def test_sampling_is_seeded_and_the_same_on_every_tp_rank():
    tp.init_mesh(tp=2)
    model = models.GPT.from_hf(hf_model("llama"))
    x = prompts()
    draws = [model.generate(x, 10, temperature=0.8, top_k=20, top_p=0.9, generator=rng(s))
             for s in (1, 1, 2)]
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])
    gathered = [torch.empty_like(draws[0]) for _ in range(2)]
    torch.distributed.all_gather(gathered, draws[0])
    assert torch.equal(gathered[0], gathered[1])  # the same tokens on both tp ranks
    stop = int(draws[0][0, 6])  # the eos: sequence 0 stops there, padded with it; generation ends when both have
    out = model.generate(x, 10, temperature=0.8, top_k=20, top_p=0.9, eos_token_id=stop,
                         generator=rng(1))
    assert torch.equal(out[0, :7], draws[0][0, :7]) and (out[0, 7:] == stop).all()


def test_top_k_and_top_p_keep_the_likeliest_tokens():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    g = rng(0)
    for _ in range(50):
        assert next_tokens(logits, temperature=1.0, top_k=2, top_p=None, generator=g).item() in (0, 1)
        assert next_tokens(logits, temperature=1.0, top_k=None, top_p=0.5, generator=g).item() == 0  # p(0) = 0.64
    assert next_tokens(logits, temperature=0.0, top_k=None, top_p=None, generator=None).item() == 0


@distributed(world_size=1)
def test_bad_generation_input_is_one_line():
    tp.init_mesh(tp=1)
    model = models.GPT.from_hf(hf_model("llama", positions=16))
    x = prompts()
    for kwargs, message in (({"max_new_tokens": 12}, r"the prompt \(5 tokens\) and max_new_tokens=12 exceed the "
                                                     r"model's context, max_seq_len=16"),
                            ({"max_new_tokens": 2, "top_k": 5}, r"top_k and top_p .* need temperature > 0"),
                            ({"max_new_tokens": 2, "temperature": -1.0}, r"temperature=-1.0 must be >= 0"),
                            ({"max_new_tokens": 2, "temperature": 1.0, "top_p": 0.0}, r"top_p=0.0 must be in")):
        with pytest.raises(ValueError, match=message):
            model.generate(x, **kwargs)


def test_without_a_tokenizer_bytes_stream_and_larger_ids_print_as_placeholders():
    """No tokenizer: ids 0-255 are UTF-8 bytes (a character shown once whole), and an id past 255 (a model with a
    larger vocabulary) prints as <|id|>, an unfinished character before it as U+FFFD (it was a crash)."""
    from models.generation import Text

    text = Text(None)
    assert text.encode("dé") == [100, 0xC3, 0xA9]
    assert [text.more(t) for t in (100, 0xC3, 0xA9, 300, 0xC3, 511, 33)] == ["d", "", "é", "<|300|>", "",
                                                                           "\ufffd<|511|>", "!"]

# ---- python -m models.generate ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory):
    """A save_pretrained Llama over bytes (vocabulary 256), and HF's greedy continuation of "def " by 12 tokens: each
    step's choice leads by GREEDY_MARGIN (tests/helpers.py; ours, the same fp32 weights, chooses alike)."""
    path = tmp_path_factory.mktemp("hf") / "llama"
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(path)
    x = torch.tensor([list(b"def ")])
    ids = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert greedy_margin(hf(ids).logits[:, 3:-1], ids[:, 4:]) >= GREEDY_MARGIN
    return str(path), bytes(ids[0].tolist()).decode("utf-8", errors="replace")


def env():
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                               "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    return clean | {"OMP_NUM_THREADS": "1"}


# tp 1's command (slow): test_greedy_equals_hugging_face_token_for_token[1] checks tp 1's tokens in-process, tp 2's
# command the same run() and its printing, and the docs' `python -m models.generate --load ckpt` runs it at tp 1
@pytest.mark.parametrize("tp_size", [pytest.param("1", marks=pytest.mark.slow), "2"])
def test_the_command_prints_the_prompt_then_the_greedy_continuation(byte_model, tp_size):
    path, expected = byte_model
    result = subprocess.run([sys.executable, "-m", "models.generate", "--from-hf", path, "--prompt", "def ",
                             "--max-new-tokens", "12", "--tp", tp_size], capture_output=True, text=True,
                            timeout=300, env=env())
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout == expected + "\n"  # HF's greedy tokens, at tp 1 and tp 2


def test_a_truncated_safetensors_file_is_one_line_before_any_process(byte_model, capsys, tmp_path):
    """A --from-hf directory whose weights were cut short: one line naming the file, exit 2, no process started, in
    models.generate and models.train alike."""
    damaged = tmp_path / "damaged"
    shutil.copytree(byte_model[0], damaged)
    weights = damaged / "model.safetensors"
    os.truncate(weights, os.path.getsize(weights) // 2)
    message = rf"error: --from-hf {damaged}: {weights} is not a whole safetensors file: .*incomplete metadata.*"
    assert main(["--from-hf", str(damaged), "--prompt", "def", "--tp", "2"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and re.fullmatch(message + "\n", err), err
    code, out, err = train_refusal(["--from-hf", str(damaged), "--tp", "2", "--steps", "1"], capsys)  # models.train
    assert code == 2 and len(err) == 1 and re.fullmatch(message, err[0]), err


@pytest.mark.parametrize("flags,message", [
    (["--prompt", "x" * 70], r"the prompt \(70 tokens\) and --max-new-tokens=64 exceed the model's context, "
                             r"max_seq_len=64: the prompt alone is longer"),
    (["--prompt", "def", "--top-k", "5"], r"--top-k is a sampling flag: give --temperature > 0 too"),
    (["--prompt", "def", "--top-p", "0.9", "--seed", "1"], r"--top-p and --seed sample: give --temperature > 0"),
    (["--prompt", "def", "--temperature", "1", "--top-p", "1.5"], r"--top-p=1.5 must be in \(0, 1\]"),
    (["--prompt", "def", "--tp", "3"], r"num_heads=4 .*3"),
    (["--prompt-file", "{missing}"], r"--prompt-file .*missing: no such file"),
])
def test_bad_input_is_one_line_before_any_process(byte_model, flags, message, capsys, tmp_path):
    flags = [f.format(missing=tmp_path / "missing") for f in flags]
    assert main(["--from-hf", byte_model[0], *flags]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and re.search(message, err), err
    assert main(["--from-hf", str(tmp_path / "nowhere"), "--prompt", "x"]) == 2
    assert "--from-hf" in capsys.readouterr().err


def test_a_torchrun_rank_exits_without_tearing_its_process_groups_down(monkeypatch):
    """At interpreter exit a live gloo group's destructor sometimes aborted the rank ("terminate called without an
    active exception", exit -6: test_the_command_prints_the_prompt_then_the_greedy_continuation[2] once): a rank
    launched by torchrun flushes and leaves through os._exit, as the training job's ranks do."""
    from models import generate

    exits = []
    monkeypatch.setenv("RANK", "0")  # as torchrun's ranks see it
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(generate, "main", lambda: 3)
    monkeypatch.setattr(os, "_exit", exits.append)
    generate.entry()
    assert exits == [3]
