"""Blends (`--data 0.3 A 0.7 B`, models/training/data/blend.py): realised proportions within sampling error of the
weights, each dataset's windows all drawn before any repeats, deterministic by seed, the same global batches at
every split, validation windows held out per dataset, and a blended run's curve the same at tp2 x dp2 as in one
process."""
import json
import math

import numpy as np
import pytest
import torch

from models.training import data
from models.training.cli import job_config, parser, train, validate
from models.training.config import JobConfig
from models.training.data import blend, indexed
from tp.testing import distributed, run


def _positions(offset, count):
    """A token stream whose token i is offset + i: every window says which dataset and positions it read."""
    return torch.arange(offset, offset + count)


def _split_all(sizes, seq_len=8):
    return [data.split(_positions(1_000_000 * d, n), seq_len) for d, n in enumerate(sizes)]


@pytest.mark.parametrize("weights", [[0.3, 0.7], [1, 1, 1], [0.05, 0.9, 0.05], [2.5, 0.5]])
def test_every_prefix_of_the_draws_holds_each_dataset_in_proportion(weights):
    counts = blend.period_counts(weights)
    assert counts.sum() == blend.PERIOD and np.allclose(counts / blend.PERIOD, np.array(weights) / sum(weights),
                                                        atol=1 / blend.PERIOD)
    dataset, rank = blend.interleave(counts)
    seen = np.zeros((len(weights), len(dataset)), dtype=np.int64)
    seen[dataset, np.arange(len(dataset))] = 1
    drawn = np.cumsum(seen, axis=1)  # draws of each dataset among the first n
    share = counts[:, None] / counts.sum() * np.arange(1, len(dataset) + 1)
    assert np.abs(drawn - share).max() <= 1  # within one draw of its weight at every sample (Megatron's guarantee)
    for d in range(len(weights)):  # each dataset's draws numbered 0, 1, 2, ... in order
        assert rank[dataset == d].tolist() == list(range(counts[d]))


def test_a_blends_proportions_are_within_sampling_error_and_windows_do_not_repeat_early():
    splits = _split_all([801, 4001, 1601])  # 99, 495 and 198 training windows of 8 tokens
    weights = [0.2, 0.5, 0.3]
    mixed = data.Blend([s[0] for s in splits], weights, seed=7)
    draws = [mixed.source(i) for i in range(6000)]
    realised = np.bincount([d for d, _ in draws], minlength=3) / len(draws)
    for w, r in zip(np.array(weights) / sum(weights), realised):
        assert abs(r - w) <= 3 * math.sqrt(w * (1 - w) / len(draws))  # (in fact within a draw or two)
    for d, windows in enumerate(len(s[0]) for s in splits):
        picks = [j for e, j in draws if e == d]
        assert sorted(picks[:windows]) == list(range(windows))  # every window once before any repeats
        assert picks[:windows] != list(range(windows)) and picks[windows:2 * windows] != picks[:windows]  # reshuffled
    x, y = mixed[5]  # a window of the dataset it names
    d, j = mixed.source(5)
    assert x[0] == 1_000_000 * d + 8 * j and y[-1] == x[-1] + 1
    again = data.Blend([s[0] for s in splits], weights, seed=7)
    other = data.Blend([s[0] for s in splits], weights, seed=8)
    assert [again.source(i) for i in range(6000)] == draws != [other.source(i) for i in range(6000)]


@pytest.mark.parametrize("dp", [2, 4])
def test_a_blends_global_batches_are_the_same_for_any_dp_and_resume_where_they_stopped(dp):
    splits = _split_all([801, 1601])
    mixed = data.Blend([s[0] for s in splits], [0.4, 0.6], seed=3)
    options = dict(global_batch_size=8, micro_batch_size=2, seed=3)
    whole = data.batches(mixed, dp=1, dp_rank=0, **options)
    parts = [data.batches(mixed, dp=dp, dp_rank=r, **options) for r in range(dp)]
    steps = [next(whole) for _ in range(30)]
    for step in steps:
        rows = sorted(tuple(x) for part in parts for mb, _ in next(part) for x in mb.tolist())
        assert rows == sorted(tuple(x) for mb, _ in step for x in mb.tolist())
    resumed = data.batches(mixed, dp=1, dp_rank=0, start_step=17, **options)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(next(resumed), steps[17]))


def test_validation_windows_are_held_out_per_dataset():
    splits = _split_all([801, 3201])
    train_windows = data.Blend([s[0] for s in splits], [0.5, 0.5], seed=1)
    held_out = data.Blend([s[1] for s in splits], [0.5, 0.5], seed=None)
    trained, held = set(), set()
    for step in range(100):
        for x, y in next(data.batches(train_windows, dp=1, dp_rank=0, global_batch_size=8, micro_batch_size=8,
                                      seed=1, start_step=step)):
            trained |= set(x.flatten().tolist()) | set(y.flatten().tolist())
    for batch in data.eval_batches(held_out, dp=1, dp_rank=0, global_batch_size=8, micro_batch_size=8, iters=4):
        for x, y in batch:
            held |= set(x.flatten().tolist()) | set(y.flatten().tolist())
    assert not trained & held
    for d, (_, held_split) in enumerate(splits):
        mine = {t for t in held if t // 1_000_000 == d}
        assert mine and min(mine) - 1_000_000 * d == held_split.span(0)[0]  # each dataset's own last ~1%
        assert max(t for t in trained if t // 1_000_000 == d) - 1_000_000 * d < held_split.span(0)[0]


# ---- through the job -------------------------------------------------------------------------------------------------


def _megatron(prefix, docs):
    writer = indexed.Writer(prefix, np.uint8)
    for doc in docs:
        writer.add_document(doc)
    writer.close()
    return prefix


@pytest.fixture
def two_sources(tmp_path):
    """A Megatron dataset of bytes and a text file, of different lengths."""
    a = _megatron(str(tmp_path / "a_text_document"), [list(f"doc {i}: alpha beta gamma\n\n".encode())
                                                      for i in range(300)])
    (tmp_path / "b.txt").write_text("".join(f"line {i} of the other corpus\n" for i in range(400)))
    return a, str(tmp_path / "b.txt")


FLAGS = ["--model", "tiny", "--seq-len", "16", "--global-batch-size", "8", "--micro-batch-size", "2", "--steps", "3",
         "--seed", "9", "--eval-every", "3", "--eval-iters", "2"]


def test_a_blend_through_the_job_and_its_bad_values(two_sources, tmp_path):
    a, b = two_sources
    job = job_config(parser().parse_args([*FLAGS, "--tp", "1", "--pp", "1", "--dp", "1", "--data", "0.3", a, "0.7",
                                          b, "--data-cache-dir", str(tmp_path / "cache")]))
    assert [(s.weight, s.kind) for s in data.data_sources(job)] == [(0.3, "indexed"), (0.7, "text")]
    (tmp_path / "job.toml").write_text(job.to_toml())  # the blend in TOML: [data] path = ["0.3", "A", "0.7", "B"]
    assert JobConfig.from_toml(str(tmp_path / "job.toml")) == job and f'path = ["0.3", "{a}", "0.7",' in job.to_toml()
    (tmp_path / "by_hand.toml").write_text(f'[data]\npath = [0.3, "{a}", 0.7, "{b}"]\n')
    assert JobConfig.from_toml(str(tmp_path / "by_hand.toml")).data.blend() == [(0.3, a), (0.7, b)]
    assert validate(job).vocab_size == 256
    data.prepare(job)
    train_windows, held, notes = data.datasets(job, data.resolve(job))
    assert isinstance(train_windows, data.Blend) and notes == []
    assert len(held.datasets[0]) == math.ceil(((len(data.load(a)) - 1) // 16) / 100)  # ~1% of each dataset's
    with pytest.raises(ValueError, match=r"^--data .*b.txt has 9 tokens: one sequence of --seq-len=16 to train on "
                                         r"and one held out for validation need 34; lower --seq-len or give more "
                                         r"data$"):
        (tmp_path / "b.txt").write_text("too short")
        data.prepare(job)


@distributed(world_size=4, timeout=300)
def _train(flags, log):
    train(parser().parse_args([*flags, "--log-jsonl", log]))


def _rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_a_blended_run_trains_the_same_curve_at_tp2_dp2_as_in_one_process(two_sources, tmp_path):
    a, b = two_sources
    flags = [*FLAGS, "--data", "0.3", a, "0.7", b, "--data-cache-dir", str(tmp_path / "cache")]
    run(_train, 4, timeout=300, flags=[*flags, "--tp", "2", "--pp", "1", "--dp", "2"], log=str(tmp_path / "s.jsonl"))
    run(_train, 1, timeout=300, flags=[*flags, "--tp", "1", "--pp", "1", "--dp", "1"], log=str(tmp_path / "1.jsonl"))
    split, serial = _rows(tmp_path / "s.jsonl"), _rows(tmp_path / "1.jsonl")
    assert [r["step"] for r in split] == [1, 2, 3] and "val_loss" in split[-1]
    for ours, reference in zip(split, serial, strict=True):
        for key in ("loss", "val_loss", "grad_norm"):
            if key in reference:
                assert abs(ours[key] - reference[key]) <= 1e-5 * reference[key], (key, ours, reference)
