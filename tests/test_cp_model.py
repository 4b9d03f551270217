"""The GPT under context parallelism against Hugging Face's dense model: logits, loss and every gradient (summed over
cp, gathered over tp) in fp64 at cp = 2 and 4, with tp, SP, GQA/MQA, learned positions and the ring, all-gather and
a2a modes; ignored tokens; the training job's curves, pipelines and checkpoints across cp; bad configurations (dropout
under cp: tests/test_dropout.py)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import models
import tp
from models.block import token_positions
from models.hf import hf_state_dict
from tp.testing import distributed

from .helpers import rng, train_refusal

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH = 50, 24, 2  # s/(2cp) = 3 tokens per chunk at cp = 4; no tp divides the vocabulary


def hf_model(family, kv_heads):
    torch.manual_seed(0)
    if family == "gpt2":  # learned positions, LayerNorm, GELU, biases, tied embeddings
        config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=4, n_positions=32,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    else:
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                          head_dim=4, num_attention_heads=4, num_key_value_heads=kv_heads,
                                          max_position_embeddings=32)
    return transformers.AutoModelForCausalLM.from_config(config).double().eval()


def batch(seed):
    g = rng(seed)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def _grads(model, mesh):
    """Every gradient as HF tensors: each cp rank's share summed over the cp group, then gathered over tp."""
    for p in model.parameters():
        dist.all_reduce(p.grad, group=mesh.cp_group)
    return hf_state_dict(model, grads=True)


def _compare(hf, model, mesh, x, y, what):
    logits = hf(x).logits
    expected = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
    expected.backward()
    ours = model(x)
    assert (ours - logits).abs().max().item() <= 1e-12, f"{what}: logits"
    loss = model(x, y)
    assert abs(loss.item() - expected.item()) <= 1e-12, f"{what}: loss {loss.item()} vs {expected.item()}"
    loss.backward()
    reference = {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}
    grads = _grads(model, mesh)
    assert set(grads) == set(reference), what
    for name, grad in grads.items():
        err = (grad - reference[name]).abs().max().item()
        assert err <= 1e-10, f"{what}: {name} grad err {err}"


@pytest.mark.parametrize("tp_size,cp_size", [(1, 2), (1, 4), (2, 2)])
@distributed(world_size=4)
def test_gpt_under_cp_equals_the_dense_model(tp_size, cp_size):
    mesh = tp.init_mesh(tp=tp_size, cp=cp_size)
    for family, kv_heads in (("llama", 2), ("llama", 1), ("gpt2", 4)):
        for sequence_parallel in (False, True) if tp_size > 1 else (False,):
            for mode in ("ring", "allgather", "a2a"):
                hf = hf_model(family, kv_heads)
                model = models.GPT.from_hf(hf, sequence_parallel=sequence_parallel, cp_mode=mode,
                                           dtype=torch.float64)
                assert model.cp_size == cp_size
                _compare(hf, model, mesh, *batch(1), f"{family} kv={kv_heads} sp={sequence_parallel} {mode}")


@distributed(world_size=2)
def test_ignored_tokens_under_cp():
    """A rank whose tokens are all ignored still gets the global mean (finite); every token ignored gives NaN with
    zero gradients, exactly as F.cross_entropy."""
    mesh = tp.init_mesh(cp=2)
    x, y = batch(2)
    rank0 = torch.cat([torch.arange(SEQ).chunk(4)[i] for i in (0, 3)])  # cp rank 0's chunks
    y_partly = y.clone()
    y_partly[:, rank0] = -100  # every token cp rank 0 holds
    hf = hf_model("llama", 2)
    model = models.GPT.from_hf(hf, dtype=torch.float64)
    _compare(hf, model, mesh, x, y_partly, "rank 0's tokens ignored")
    hf.zero_grad(), model.zero_grad()
    y_none = torch.full_like(y, -100)
    expected = F.cross_entropy(hf(x).logits.reshape(-1, VOCAB), y_none.reshape(-1))
    loss = model(x, y_none)
    assert torch.isnan(expected) and torch.isnan(loss)
    loss.backward()
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())  # zero, as F.cross_entropy's


@distributed(world_size=4)
def test_token_positions_follow_the_load_balanced_layout():
    mesh = tp.init_mesh(tp=2, cp=2)
    positions, seq = token_positions(6, sequence_parallel=False, tp_group=mesh.tp_group, cp_group=mesh.cp_group,
                                     device="cpu")
    chunks = torch.arange(12).chunk(4)
    assert seq == 12 and positions.tolist() == torch.cat([chunks[mesh.cp_rank], chunks[3 - mesh.cp_rank]]).tolist()
    positions, seq = token_positions(3, sequence_parallel=True, tp_group=mesh.tp_group, cp_group=mesh.cp_group,
                                     device="cpu")  # under SP: this tp rank's half of the cp share
    mine = torch.cat([chunks[mesh.cp_rank], chunks[3 - mesh.cp_rank]]).chunk(2)[mesh.tp_rank]
    assert seq == 12 and positions.tolist() == mine.tolist()
    assert token_positions(6, sequence_parallel=False, tp_group=mesh.tp_group, cp_group=None, device="cpu") is None


@distributed(world_size=4)
def test_from_hf_takes_an_explicit_cp_group_and_save_hf_writes_once_per_cp_group():
    """from_hf(cp_group=...) as GPT(cp_group=...); the ranks of a cp group hold the same weights, so save_hf writes
    from one of them (several writers of one file race on a shared filesystem), with or without dp_group."""
    import tempfile
    from unittest import mock

    import safetensors.torch

    mesh = tp.init_mesh(cp=2, dp=2)
    hf = hf_model("llama", 2)
    model = models.GPT.from_hf(hf, cp_group=mesh.cp_group, dtype=torch.float64)
    assert model.cp_group is mesh.cp_group and model.cp_size == 2
    x, y = batch(3)
    expected = F.cross_entropy(hf(x).logits.reshape(-1, VOCAB), y.reshape(-1))
    assert abs(model(x, y).item() - expected.item()) <= 1e-12
    path = [tempfile.mkdtemp()]
    dist.broadcast_object_list(path, src=0)
    for dp_group, writers in ((None, {0, 1}), (mesh.dp_group, {0})):  # (dp rank, cp rank 0) writes
        with mock.patch.object(safetensors.torch, "save_file", wraps=safetensors.torch.save_file) as save:
            model.save_hf(path[0], dp_group=dp_group)
        wrote = [None] * 4
        dist.all_gather_object(wrote, (mesh.dp_rank, mesh.cp_rank, save.call_count))
        assert sorted((dp, n) for dp, cp, n in wrote if n) == [(dp, 1) for dp in sorted(writers)], wrote
        assert all(cp == 0 for _, cp, n in wrote if n), wrote


@distributed(world_size=2)
def test_debug_mode_catches_cp_ranks_passing_different_tokens():
    """Each cp rank passing its own data (a sampler over the global rank) or its own share (Megatron's
    get_batch_on_this_cp_rank) trains on garbage silently; TP_DEBUG names it on every rank."""
    mesh = tp.init_mesh(cp=2)
    model = models.GPT.from_hf(hf_model("llama", 2), dtype=torch.float64)
    x, y = batch(4)
    with tp.set_debug(True):
        model(x, y)  # the same full sequence on both: fine
        for tokens in (batch(5 + mesh.cp_rank)[0], tp.cp_shard(torch.cat([x, x], 1), 1)):
            with pytest.raises(ValueError, match=r"tokens of GPT .* differs across the cp group: ranks \[0\] vs "
                                                 r"ranks \[1\]"):
                model(tokens)


@distributed(world_size=2)
def test_bad_sequence_lengths_are_refused_on_every_rank():
    tp.init_mesh(cp=2)
    config = models.GPTConfig(vocab_size=VOCAB, hidden_size=16, num_heads=4, num_layers=1, max_seq_len=32)
    model = models.GPT(config)
    with pytest.raises(ValueError, match=r"sequence length 10 is not divisible by 4: 2\*cp = 2\*2"):
        model(torch.zeros(1, 10, dtype=torch.long))


# ---- the training job ---------------------------------------------------------------------------------------------

from .test_train import SMALL, _curve, _hf_loss  # noqa: E402  (the training job's test helpers)


@distributed(world_size=4, timeout=300)
def _train_on_4_ranks(flags, log):
    from models.training.cli import parser, train

    train(parser().parse_args([*SMALL, *flags, "--log-jsonl", log]))


def _close(curve, reference, what):
    assert len(curve) == len(reference), what
    for step, (ours, expected) in enumerate(zip(curve, reference)):
        assert abs(ours - expected) <= 1e-5 * expected, f"{what}, step {step + 1}: {ours} vs {expected}"


@pytest.mark.slow
def test_more_cp_splits_train_the_serial_curve(tmp_path):
    """cp with SP and dp, and the all-gather cp mode under FSDP2 with selective recompute (the fast run: below)."""
    serial = _curve(str(tmp_path), "serial", "--tp", "1", "--pp", "1", "--dp", "1", world_size=1)
    splits = {  # tp x cp x pp x dp
        "2x2x1x2 sp": ["--tp", "2", "--cp", "2", "--pp", "1", "--dp", "2", "--sequence-parallel"],
        "1x4x1x2 allgather fsdp selective": ["--tp", "1", "--cp", "4", "--pp", "1", "--dp", "2", "--cp-mode",
                                             "allgather", "--dp-mode", "fsdp", "--recompute", "selective"],
    }
    for name, flags in splits.items():
        _close(_curve(str(tmp_path), name.replace(" ", "_"), *flags), serial, name)


def test_cp_splits_train_the_serial_curve_and_reshard_across_cp(tmp_path):
    serial = _curve(str(tmp_path), "serial", "--tp", "1", "--pp", "1", "--dp", "1", world_size=1)
    splits = {  # tp x cp x pp x dp
        "1x2x2x2 ring interleaved": ["--tp", "1", "--cp", "2", "--pp", "2", "--dp", "2", "--schedule", "interleaved",
                                     "--virtual-stages", "2"],
        "2x2x2x1 sp zb zero1": ["--tp", "2", "--cp", "2", "--pp", "2", "--dp", "1", "--sequence-parallel",
                                "--schedule", "zb", "--dp-mode", "zero1"],
    }
    for name, flags in splits.items():
        export = ["--export-hf", str(tmp_path / "exported")] if name.startswith("2x2") else []
        _close(_curve(str(tmp_path), name.replace(" ", "_"), *flags, *export), serial, name)
    exported = _hf_loss(tmp_path / "exported")  # written once by the dp x cp replicas, loadable by transformers
    assert abs(exported - serial[-1]) < 0.5 and exported < serial[0]
    # Save at cp = 2 (with pp = 2 x 2 virtual stages) after 2 steps, resume at cp = 4: step 3 as if never
    # interrupted.
    ckpt = str(tmp_path / "ckpt")
    _curve(str(tmp_path), "first_two", *splits["1x2x2x2 ring interleaved"], "--steps", "2", "--save", ckpt)
    resumed = _curve(str(tmp_path), "resumed", "--tp", "2", "--cp", "4", "--pp", "1", "--dp", "1", "--load", ckpt)
    _close(resumed, serial[2:], "resumed at cp=4")


@pytest.mark.parametrize("flags,message", [
    (["--cp", "2", "--seq-len", "30"], r"--seq-len=30 with --cp=2: sequence length 30 is not divisible by 4: "
                                       r"2\*cp = 2\*2"),
    (["--cp", "2", "--tp", "2", "--sequence-parallel", "--seq-len", "36"],
     r"--seq-len=36 with --cp=2 --tp=2 --sequence-parallel: .* not divisible by 8"),
    (["--cp", "0"], r"--cp=0 must be >= 1"),
])
def test_bad_cp_configuration_is_one_line_before_any_process(flags, message, capsys):
    import re

    code, _, lines = train_refusal(flags, capsys)
    assert code == 2 and len(lines) == 1 and re.search(message, lines[0]), lines
