"""Documents inside a window: a packed window, with document_ids, computes what its documents compute one by one
through the dense model (logits, the loss over the same tokens, every gradient; fp64), at tp x cp splits in every
context-parallel mode (ring, all-gather, a2a, a2a+ring), with SP, recompute and learned positions, and through every
pipeline schedule; positions restart at each document (or follow position_ids); the edge cases of packing."""
import pytest
import torch
import torch.distributed as dist

import models
import tp
from models.block import document_positions
from models.hf import hf_state_dict
from models.stages import build_chunks
from tp.pipeline import PipelineRunner
from tp.testing import distributed

from .helpers import rng, train_refusal

VOCAB, SEQ, BATCH = 50, 24, 2  # 3 tokens per chunk at cp = 4
ROPE = dict(vocab_size=VOCAB, hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=24,
            max_seq_len=32)
LEARNED = ROPE | dict(position="learned", norm="layernorm", activation="gelu", bias=True, num_kv_heads=4,
                      tie_embeddings=True)


def window(seed, seq=SEQ, batch=BATCH):
    """(tokens, targets, document_ids) [batch, seq]: row 0 starts mid-document (ids from 5), holds one-token
    documents and random lengths; row 1 is one document longer than the window but for two short ones inside its
    first 3 tokens (at cp = 4 only rank 0's share holds a document start)."""
    g = rng(seed)
    tokens, targets = (torch.randint(0, VOCAB, (batch, seq), generator=g) for _ in range(2))
    starts = (torch.rand(batch, seq, generator=g) < 0.25).long()
    starts[0, 1:3] = 1  # one-token documents at 1 and 2
    docs = 5 + starts.cumsum(1)
    if batch > 1:
        docs[1] = torch.tensor([0, 1, 1] + [2] * (seq - 3))
    return tokens, targets, docs


def runs(docs_row):
    """(start, stop) of each document of a row of document ids."""
    bounds = [0] + [t for t in range(1, len(docs_row)) if docs_row[t] != docs_row[t - 1]] + [len(docs_row)]
    return list(zip(bounds, bounds[1:]))


def one_by_one(model, tokens, targets, docs, position_ids=None):
    """The dense model on each document alone: (logits [b, s, V], the mean loss over the window's tokens)."""
    logits, total = [], 0
    for i in range(tokens.shape[0]):
        row = []
        for a, b in runs(docs[i]):
            x, y = tokens[i:i + 1, a:b], targets[i:i + 1, a:b]
            kw = {} if position_ids is None else {"position_ids": position_ids[i:i + 1, a:b]}
            row.append(model(x, **kw))
            total = total + model(x, y, **kw) * (b - a)
        logits.append(torch.cat(row, 1))
    return torch.cat(logits).detach(), total / tokens.numel()


def solo_group():
    return [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]


def build(config, group, cp_group):
    torch.manual_seed(0)  # the same weights at any split
    return models.GPT(config, group=group, cp_group=cp_group).double()


def reference(config, solo, tokens, targets, docs, position_ids=None):
    """(logits, loss, HF-named gradients) of the dense model run on each document alone."""
    model = build(config, solo, solo)
    logits, loss = one_by_one(model, tokens, targets, docs, position_ids)
    loss.backward()
    return logits, loss.detach(), hf_state_dict(model, solo, grads=True)


def compare(model, mesh, expected, tokens, targets, docs, what, position_ids=None):
    logits, loss, grads = expected
    ours = model(tokens, document_ids=docs, position_ids=position_ids)
    assert (ours - logits).abs().max().item() <= 1e-12, f"{what}: logits"
    total = model(tokens, targets, document_ids=docs, position_ids=position_ids)
    assert abs(total.item() - loss.item()) <= 1e-12, f"{what}: loss {total.item()} vs {loss.item()}"
    total.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad, group=mesh.cp_group)  # each cp rank's share of the gradient
    got = hf_state_dict(model, grads=True)
    assert set(got) == set(grads), what
    for name, grad in got.items():
        err = (grad - grads[name]).abs().max().item()
        assert err <= 1e-10, f"{what}: {name} grad err {err}"


def modes(cp):
    return [("ring", None), ("allgather", None), ("a2a", None)] + ([("a2a+ring", 2)] if cp == 4 else [])


@pytest.mark.parametrize("tp_size,cp_size", [(1, 1), (1, 2), (1, 4), (2, 2), (4, 1)])
@distributed(world_size=4)
def test_packed_window_equals_its_documents_one_by_one(tp_size, cp_size):
    """fp64: logits ~1e-12, the loss over the same tokens ~1e-12, every gradient ~1e-10, RoPE (GQA) and learned
    positions (tied embeddings), every cp mode, SP under tp, selective and full recompute."""
    mesh = tp.init_mesh(tp=tp_size, cp=cp_size)
    solo = solo_group()
    tokens, targets, docs = window(seed=tp_size * 10 + cp_size)
    for name, fields in (("rope", ROPE), ("learned", LEARNED)):
        config = models.GPTConfig(**fields)
        expected = reference(config, solo, tokens, targets, docs)
        for i, (mode, a2a_size) in enumerate(modes(cp_size) if cp_size > 1 else [("ring", None)]):
            variant = dict(cp_mode=mode, cp_a2a_size=a2a_size, sequence_parallel=tp_size > 1 and i % 2 == 0,
                           recompute=("none", "selective", "full")[i % 3])
            model = build(config.replace(**variant), mesh.tp_group, mesh.cp_group)
            compare(model, mesh, expected, tokens, targets, docs, f"{name} {variant}")


@distributed(world_size=4)
def test_positions_restart_or_follow_position_ids():
    """document_positions is each token's index inside its document; position_ids overrides them (documents without
    position resets: each document as one run at its window positions); position_ids of 0..s-1 alone change
    nothing; out-of-range or misshapen ids are refused on every rank before any collective."""
    docs = torch.tensor([[3, 3, 4, 5, 5, 5], [0, 0, 0, 0, 0, 0]])
    assert document_positions(docs).tolist() == [[0, 1, 0, 0, 1, 2], list(range(6))]
    assert document_positions(torch.tensor([[1, 2, 1, 2]])).tolist() == [[0, 0, 1, 1]]  # equal ids: one document
    mesh = tp.init_mesh(tp=2, cp=2)
    solo = solo_group()
    tokens, targets, docs = window(seed=3)
    config = models.GPTConfig(**ROPE)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    expected = reference(config, solo, tokens, targets, docs, position_ids=positions)
    for mode in ("ring", "a2a"):
        model = build(config.replace(cp_mode=mode, sequence_parallel=True), mesh.tp_group, mesh.cp_group)
        compare(model, mesh, expected, tokens, targets, docs, f"position_ids {mode}", position_ids=positions)
        assert torch.equal(model(tokens, position_ids=positions), model(tokens))
    model = build(config, mesh.tp_group, mesh.cp_group)
    from torch.distributed.tensor.debug import CommDebugMode
    cases = [({"document_ids": docs[:, :-2]}, r"document_ids must be integers of the tokens' shape \[batch, seq\] "
                                              r"\(2, 24\), got torch.int64 \(2, 22\)"),
             ({"document_ids": docs.float()}, r"document_ids must be integers .* got torch.float32"),
             ({"position_ids": positions + 9}, r"position id 32 is outside \[0, max_seq_len=32\)")]
    with CommDebugMode() as collectives:
        for kwargs, message in cases:
            with pytest.raises(ValueError, match=message):
                model(tokens, targets, **kwargs)
    assert collectives.get_total_counts() == 0
    with tp.set_debug(True):  # a rank passing its own ids is caught, not trained on
        model(tokens, targets, document_ids=docs)
        with pytest.raises(ValueError, match=r"document_ids of GPT .* differs across the cp group"):
            model(tokens, targets, document_ids=docs + mesh.cp_rank)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zb"])
@distributed(world_size=4)
def test_every_schedule_passes_the_documents_to_every_stage(schedule):
    """pp = 2 with cp = 2 (ring), and with tp = 2 under SP (a2a needs cp: tp alone): the runner hands each
    micro-batch's document ids to every stage from the batch; loss and every gradient of the documents one by one."""
    chunks_per_rank = 2 if schedule == "interleaved" else 1
    solo = solo_group()
    config = models.GPTConfig(**ROPE | dict(num_layers=4, tie_embeddings=True))
    micro = [window(seed=k, batch=1) for k in range(4)]
    model = build(config, solo, solo)
    loss = sum(one_by_one(model, *m)[1] for m in micro) / len(micro)
    loss.backward()
    expected = hf_state_dict(model, solo, grads=True)
    for tp_size, cp_size in ((1, 2), (2, 1)):
        mesh = tp.init_mesh(tp=tp_size, cp=cp_size, pp=2)
        torch.manual_seed(0)
        chunks = [c.double() for c in build_chunks(config.replace(sequence_parallel=tp_size > 1), mesh,
                                                   chunks_per_rank)]
        runner = PipelineRunner(chunks if chunks_per_rank > 1 else chunks[0], mesh, micro_batch_size=1, seq_len=SEQ)
        stats = runner.run([(x, y, {"document_ids": d}) for x, y, d in micro], schedule)
        assert abs(stats.loss - loss.item()) <= 1e-12, (schedule, tp_size, stats.loss, loss.item())
        models.stages.allreduce_tied_embedding_grads(chunks, mesh)
        got = {}
        for chunk in chunks:
            for p in chunk.parameters():
                dist.all_reduce(p.grad, group=mesh.cp_group)
            got |= hf_state_dict(chunk, grads=True)
        for name, grad in got.items():
            err = (grad - expected[name]).abs().max().item()
            assert err <= 1e-10, f"{schedule} tp={tp_size} cp={cp_size}: {name} grad err {err}"
        assert runner.forward_only([(x, y, {"document_ids": d}) for x, y, d in micro]) == pytest.approx(stats.loss)
        tp.destroy_mesh(keep_groups=True)


# ---- the training job ---------------------------------------------------------------------------------------------

from .test_cp_model import _close, _train_on_4_ranks  # noqa: E402  (the training job's test helpers)
from .test_train import _curve, _losses  # noqa: E402

EOD = 10  # "\n": the token file below makes every line of the bundled corpus a document


def megatron_masks(tokens, eod):
    """Megatron's _get_ltor_masks_and_position_ids (reset_position_ids, reset_attention_mask), as its loop: (may
    attend [b, s, s], position ids [b, s])."""
    b, s = tokens.shape
    attend = torch.ones(s, s, dtype=torch.bool).tril().repeat(b, 1, 1)
    positions = torch.arange(s).repeat(b, 1)
    for i in range(b):
        previous = 0
        for j in (tokens[i] == eod).nonzero().flatten().tolist():
            attend[i, j + 1:, :j + 1] = False
            positions[i, j + 1:] -= j + 1 - previous
            previous = j + 1
    return attend, positions


def test_documents_come_from_the_eod_token_as_megatron_finds_them():
    from models.training.documents import window_inputs

    g = rng(0)
    tokens = torch.randint(0, 6, (3, 16), generator=g)  # EOD (5) ~1 in 6: one-token documents, EOD first or last
    tokens[2] = 1  # no EOD at all: the window inside one document longer than it
    tokens[0, 0] = tokens[1, -1] = 5
    targets = torch.randint(0, 6, (3, 16), generator=g)
    attend, positions = megatron_masks(tokens, 5)
    flags = dict(eod=5, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)
    x, y, inputs = window_inputs(tokens, targets, **flags)
    docs = inputs["document_ids"]
    assert set(inputs) == {"document_ids"} and torch.equal(x, tokens)
    assert torch.equal(tp.context.document_attention_mask(docs)[:, 0], attend)
    assert torch.equal(document_positions(docs), positions)
    assert torch.equal(y, targets.masked_fill(tokens == 5, -100))  # no loss on predicting from an EOD
    _, y, inputs = window_inputs(tokens, targets, **flags | dict(reset_attention_mask=False, eod_mask_loss=False))
    assert torch.equal(inputs["position_ids"], positions) and set(inputs) == {"position_ids"} and y is targets
    _, _, inputs = window_inputs(tokens, targets, **flags | dict(reset_position_ids=False))
    assert torch.equal(inputs["position_ids"], torch.arange(16).expand(3, 16))  # mask only: positions run on


def token_file(tmp_path):
    """The bundled corpus as a uint8 token file whose sidecar names "\\n" the end-of-document token."""
    import json

    import numpy as np

    from models.training import data

    path = tmp_path / "lines.bin"
    tokens = data.corpus().numpy()
    tokens.astype(np.uint8).tofile(path)
    (tmp_path / "lines.json").write_text(json.dumps({"format": "tp-tokens", "version": 1, "dtype": "uint8",
                                                     "count": len(tokens), "vocab_size": 256, "eos_id": EOD}))
    return str(path)


def test_document_flags_train_the_serial_curve(tmp_path):
    """--reset-attention-mask --reset-position-ids train the curve of one process (fp32, 1e-5) at tp x cp x pp x dp
    splits (a2a under tp and SP with pp and the zb schedule; ring with dp and recompute), a curve other than the one
    without the flags; with --eod-mask-loss too (the job's loss is a mean of micro-batch means, as Megatron's
    without calculate_per_token_loss: every split runs the same micro-batches, so the mean is the same)."""
    data = ["--data", token_file(tmp_path)]
    documents = ["--reset-attention-mask", "--reset-position-ids"]
    curves = {}
    for name, flags in (("plain", []), ("documents", documents), ("eod", [*documents, "--eod-mask-loss"])):
        curves[name] = _curve(str(tmp_path), f"serial_{name}", "--tp", "1", "--pp", "1", "--dp", "1", *data, *flags,
                              world_size=1)
    assert all(abs(a - b) > 1e-3 for a, b in zip(curves["documents"], curves["plain"]))
    split = ["--tp", "2", "--cp", "2", "--pp", "2", "--dp", "1", "--cp-mode", "a2a", "--sequence-parallel",
             "--schedule", "zb"]
    _close(_curve(str(tmp_path), "tp2cp2pp2", *split, *data, *documents, "--eod-mask-loss"), curves["eod"],
           "2x2x2x1 a2a sp zb")
    from tp.testing import run

    log = str(tmp_path / "ring_dp.jsonl")
    split = ["--tp", "1", "--cp", "2", "--pp", "1", "--dp", "2", "--recompute", "full"]
    run(_train_on_4_ranks, 4, flags=[*split, *data, *documents, "--eod-mask-loss"], log=log, timeout=300)
    _close(_losses(log), curves["eod"], "1x2x1x2 ring recompute")


@pytest.mark.parametrize("flags,message", [
    (["--reset-attention-mask", "--eod-mask-loss"],
     r"--reset-attention-mask --eod-mask-loss: documents are found by an end-of-document token, and the bundled "
     r"corpus as bytes has none"),
    (["--cp", "2", "--cp-mode", "a2a", "--tp", "2", "--num-heads", "2", "--num-kv-heads", "2"],
     r"--cp-mode a2a with --cp=2 --tp=2: cp_mode='a2a' splits each tp rank's num_heads/tp=1 .* over 2 ranks"),
    (["--cp", "2", "--cp-mode", "a2a", "--tp", "1", "--num-heads", "6", "--num-kv-heads", "3", "--hidden-size", "96"],
     r"--cp-mode a2a with --cp=2 --tp=1: cp_mode='a2a' splits each tp rank's kv heads over 2 ranks: kv heads 3 neither "
     r"divides nor is divisible by 2 \(num_heads/tp=6 divides\)"),
    (["--cp", "4", "--cp-mode", "a2a+ring", "--cp-a2a-size", "3"],
     r"--cp-mode a2a\+ring needs --cp-a2a-size, a divisor of --cp=4 .*; got 3"),
    (["--cp", "2", "--cp-a2a-size", "2"], r"--cp-a2a-size=2 is for --cp-mode a2a\+ring, not ring"),
])
def test_bad_document_and_a2a_configuration_is_one_line_before_any_process(flags, message, capsys):
    import re

    code, _, lines = train_refusal(flags, capsys)
    assert code == 2 and len(lines) == 1 and re.search(message, lines[0]), lines
