"""A user's data and tokenizer, validation and the training log: token files and their cache (in the user's cache
directory, never beside the data), the held-out split, model FLOPs, bad --data/--tokenizer values, and a run on a
user's text directory with a locally built tokenizer whose loss and val_loss curves are the same at tp2 x pp2 x dp2 as
in one process."""
import inspect
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from models.training import data, tokens
from models.training.cli import job_config, parser, train, validate
from models.training.data import flat, formats, indexed
from tp.testing import distributed, run

from .helpers import build_tokenizer as _build_tokenizer


def _source(*modules):
    return "\n".join(inspect.getsource(__import__(name, fromlist=["_"])) for name in modules)


@pytest.fixture(autouse=True)
def _user_cache(tmp_path, monkeypatch):
    """The token cache of every test here under its own temporary directory (never the user's)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A user's text directory (three .txt files, a .jsonl of functions, a file to ignore) and a 400-token
    tokenizer trained on it."""
    root = tmp_path_factory.mktemp("user")
    text = root / "text"
    (text / "sub").mkdir(parents=True)
    (text / "a.txt").write_text(_source("dataclasses", "enum"))
    (text / "b.txt").write_text(_source("ast"))
    (text / "sub" / "c.txt").write_text(_source("typing"))
    rows = [{"text": inspect.getsource(f), "id": i} for i, f in enumerate(vars(__import__("shutil")).values())
            if inspect.isfunction(f) and f.__module__ == "shutil"]
    (text / "d.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows) + "\n")
    (text / "notes.md").write_text("not read: neither .txt nor .jsonl")
    docs = [(text / "a.txt").read_text(), (text / "b.txt").read_text(), *[r["text"] for r in rows],
            (text / "sub" / "c.txt").read_text()]  # the sorted walk: a.txt, b.txt, d.jsonl, sub/c.txt
    tokenizer = _build_tokenizer(root / "tokenizer", "\n".join(docs), 400)
    return {"text": str(text), "tokenizer": tokenizer, "docs": docs, "root": root}


def _args(*flags):
    return job_config(parser().parse_args(list(flags)))


# ---- token files and the cache ---------------------------------------------------------------------------------------


def test_text_is_tokenized_once_into_a_cache_keyed_by_tokenizer_and_data(corpus, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    args = _args("--data", corpus["text"], "--tokenizer", corpus["tokenizer"])
    (prefix,) = data.resolve(args, progress=False)
    assert os.path.dirname(prefix) == str(tmp_path / "xdg" / "tp-layers" / "tokens")  # the user's cache
    assert ".tokens" not in os.listdir(corpus["text"])  # nothing written beside the data
    index = indexed.read_index(prefix)
    stream = data.load(prefix)
    tok = AutoTokenizer.from_pretrained(corpus["tokenizer"])
    documents = [tok(doc, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for doc in corpus["docs"]]
    assert stream.dtype == np.uint16 and stream.tolist() == sum(documents, [])  # in order, each ended by EOS
    assert [stream[slice(*index.document_span(d))].tolist() for d in range(index.documents)] == documents
    assert data.vocab_size(args) == 400 and data.eod_id(args) == 0

    def no_rebuild(*a, **k):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(formats, "build", no_rebuild)  # (the formats tokenize into the cache)
    assert data.resolve(args) == [prefix]  # the same tokenizer and data: the cache
    monkeypatch.undo()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    other = _build_tokenizer(tmp_path / "other", "\n".join(corpus["docs"]), 300)
    assert data.resolve(_args("--data", corpus["text"], "--tokenizer", other), build_missing=False) == [None]
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "a.txt").write_text(corpus["docs"][0])
    first = data.resolve(_args("--data", str(copy), "--tokenizer", corpus["tokenizer"]), progress=False)
    (copy / "a.txt").write_text(corpus["docs"][0] + "x")
    assert data.resolve(_args("--data", str(copy), "--tokenizer", corpus["tokenizer"]), build_missing=False) == [None]
    assert first != data.resolve(_args("--data", str(copy), "--tokenizer", corpus["tokenizer"]), progress=False)
    # without a tokenizer: UTF-8 bytes, documents joined by a blank line (as the bundled corpus)
    as_bytes = data.load(data.resolve(_args("--data", str(copy)), progress=False)[0])
    assert as_bytes.dtype == np.uint8 and bytes(as_bytes) == (corpus["docs"][0] + "x").encode()
    assert data.vocab_size(_args("--data", str(copy))) == 256
    # --data-cache-dir: where the user says, beside the data if asked
    beside = _args("--data", str(copy), "--data-cache-dir", str(copy / ".tokens"))
    assert os.path.dirname(data.resolve(beside, progress=False)[0]) == str(copy / ".tokens")


def test_a_tokenizer_without_data_tokenizes_the_bundled_corpus_into_the_user_cache(corpus, tmp_path):
    from transformers import AutoTokenizer

    args = _args("--tokenizer", corpus["tokenizer"])
    (prefix,) = data.resolve(args, progress=False)
    assert prefix.startswith(str(tmp_path / "xdg" / "tp-layers" / "tokens"))
    tok = AutoTokenizer.from_pretrained(corpus["tokenizer"])
    assert data.load(prefix).tolist() == tok(data.corpus_text(), add_special_tokens=False)["input_ids"] + \
        [tok.eos_token_id]
    assert data.resolve(_args()) == [None] and data.vocab_size(_args()) is None  # bytes, in memory


def test_text_streams_through_in_pieces_into_the_same_tokens(tmp_path, monkeypatch):
    """A document longer than a piece is read, checked and tokenized ~CHUNK_CHARS at a time (a corpus larger than
    memory): the same ids as the whole text tokenized at once, here where each cut falls after a line end."""
    from transformers import AutoTokenizer

    from models.training.data import sources

    text = "".join(f"line {i} of a long document\n" for i in range(3000))
    tokenizer = _build_tokenizer(tmp_path / "tok", text, 300)
    (tmp_path / "long.txt").write_text(text)
    monkeypatch.setattr(sources, "CHUNK_CHARS", 1000)
    pieces = list(sources.text_pieces([str(tmp_path / "long.txt")], "text"))
    assert len(pieces) > 50 and "".join(p for p, _, _ in pieces) == text and [last for _, last, _ in pieces][-2:] \
        == [False, True]
    (prefix,) = data.resolve(_args("--data", str(tmp_path / "long.txt"), "--tokenizer", tokenizer), progress=False)
    tok = AutoTokenizer.from_pretrained(tokenizer)
    assert data.load(prefix).tolist() == tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


def test_a_flat_token_file_stays_readable_and_the_cli_writes_megatrons_pair(corpus, tmp_path, capsys):
    out = tmp_path / "mine"
    assert tokens.main(["--data", corpus["text"], "--tokenizer", corpus["tokenizer"], "--out", str(out)]) == 0
    cached = data.load(data.resolve(_args("--data", corpus["text"], "--tokenizer", corpus["tokenizer"]),
                                    progress=False)[0])
    assert np.array_equal(data.load(str(out)), cached) and str(len(cached)) in capsys.readouterr().out.replace(",", "")
    assert tokens.main(["--data", corpus["text"], "--tokenizer", corpus["tokenizer"], "--out", f"{out}.bin"]) == 0
    assert sorted(os.listdir(tmp_path)) == ["mine.bin", "mine.idx", "xdg"]  # --out PREFIX.bin is PREFIX too
    assert tokens.main(["--data", str(tmp_path / "nothing")]) == 2
    assert capsys.readouterr().err == f"error: --data {tmp_path / 'nothing'}: no such file or directory\n"
    args = _args("--data", str(out), "--tokenizer", corpus["tokenizer"], "--tp", "1", "--pp", "1", "--dp", "1",
                 "--seq-len", "32")
    assert validate(args).vocab_size == 400  # the tokenizer's
    big = tmp_path / "big.bin"  # a flat token file written by hand, as a user's own tool would: uint32 and a sidecar
    np.arange(70000, dtype="<u4").tofile(big)
    (tmp_path / "big.json").write_text(json.dumps({"dtype": "uint32", "count": 70000, "vocab_size": 70000}))
    stream, _ = flat.read(str(big))
    x, y = data.TokenWindows(stream, 8)[8000]
    assert x.dtype == torch.int64 and x.tolist() == list(range(64000, 64008)) and y[-1] == 64008
    flags = ["--data", str(big), "--tp", "1", "--pp", "1", "--dp", "1", "--seq-len", "32"]
    assert validate(_args(*flags)).vocab_size == 70000 and data.resolve(_args(*flags)) == [str(big)]


# ---- the held-out split -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_tokens,seq_len", [(3201, 32), (5000, 7), (700, 64)])
def test_held_out_windows_are_never_trained_on(num_tokens, seq_len):
    positions = torch.arange(num_tokens)  # token i is the number i: every batch says which positions it read
    train_windows, held_out = data.split(positions, seq_len)
    total = (num_tokens - 1) // seq_len
    assert len(held_out) == max(1, -(-total // 100)) and len(train_windows) >= total - len(held_out) - 1
    seen = set()
    stream = data.batches(train_windows, dp=2, dp_rank=1, global_batch_size=4, micro_batch_size=2, seed=3)
    for _ in range(3 * len(train_windows) // 4):  # three epochs
        for x, y in next(stream):
            seen |= set(x.flatten().tolist()) | set(y.flatten().tolist())
    held = set()
    for batch in data.eval_batches(held_out, dp=1, dp_rank=0, global_batch_size=4, micro_batch_size=2, iters=3):
        for x, y in batch:
            held |= set(x.flatten().tolist()) | set(y.flatten().tolist())
    assert not seen & held and max(seen) < train_windows.span(len(train_windows) - 1)[1] <= min(held)
    assert min(held) == held_out.span(0)[0] and max(held) < num_tokens


def test_the_sampler_draws_on_the_cpu_and_the_trainer_moves_the_batches_under_another_default_device():
    """A GPU job sets a CUDA default device (meta here; CUDA's randperm would refuse the CPU generator, meta's
    does not): the sampler draws the same order on the CPU, and the trainer moves the CPU-read micro-batches (and
    their documents' inputs) to the model's device."""
    from models.training.trainer import to_device

    train_windows, _ = data.split(torch.arange(701), 8)
    cpu = next(data.batches(train_windows, dp=1, dp_rank=0, global_batch_size=4, micro_batch_size=2, seed=3))
    with torch.device("meta"):
        other = next(data.batches(train_windows, dp=1, dp_rank=0, global_batch_size=4, micro_batch_size=2, seed=3))
    assert all(torch.equal(a, b) for pa, pb in zip(cpu, other) for a, b in zip(pa, pb))
    moved = to_device([(*cpu[0], {"position_ids": cpu[0][0]}), cpu[1]], torch.device("meta"))
    assert [t.device.type for t in (*moved[0][:2], moved[0][2]["position_ids"], *moved[1])] == ["meta"] * 5
    assert to_device(cpu, torch.device("cpu")) is cpu

@pytest.mark.parametrize("dp", [2, 4])
def test_eval_batches_are_the_same_global_batches_for_any_dp(dp):
    _, held_out = data.split(torch.arange(20001), 16)  # 13 held-out windows: 3 batches of 8 wrap round
    whole = data.eval_batches(held_out, dp=1, dp_rank=0, global_batch_size=8, micro_batch_size=2, iters=3)
    parts = [data.eval_batches(held_out, dp=dp, dp_rank=r, global_batch_size=8, micro_batch_size=2, iters=3)
             for r in range(dp)]
    for j in range(3):
        rows = sorted(tuple(x) for part in parts for mb, _ in part[j] for x in mb.tolist())
        assert rows == sorted(tuple(x) for mb, _ in whole[j] for x in mb.tolist())
    assert whole[0][0][0][0, 0] == held_out.span(0)[0]


# ---- model FLOPs --------------------------------------------------------------------------------------------------


@distributed(world_size=1)
def test_model_flops_match_a_count_of_the_dense_models_matmuls():
    """6N + attention + logits equals torch's FlopCounterMode over one forward and backward (math attention, so
    the counter sees its matmuls; a vocabulary that needs no padding)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    import tp
    from models.config import GPTConfig
    from models.flops import flops_per_token
    from models.gpt import GPT

    tp.init_mesh(tp=1)
    base = dict(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=24)
    for changes in ({}, {"activation": "gelu", "num_kv_heads": 4, "ffn_hidden_size": 96, "position": "learned"},
                    {"num_kv_heads": 1, "head_dim": 8, "tie_embeddings": True, "num_layers": 3}):
        config = GPTConfig(**(base | changes))
        model = GPT(config)
        x, y = torch.randint(0, 256, (3, 24)), torch.randint(0, 256, (3, 24))
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            model(x, y).backward()
        assert counter.get_total_flops() == 3 * 24 * flops_per_token(config, 24), changes
        halved = flops_per_token(config, 24) - flops_per_token(config, 24, causal_halved=True)
        assert halved == 6 * config.num_layers * config.num_heads * config.head_dim * 24


def test_model_flops_are_narayanans_formula():
    """With ffn = 4h, MHA and GELU: 72·L·h²·(1 + s/(6h) + V/(12·L·h)) per token (Narayanan et al. 2021, eq. 3
    without the recomputed forward)."""
    from models.config import GPTConfig
    from models.flops import flops_per_token

    L, h, s, V = 24, 1024, 2048, 50257
    config = GPTConfig(vocab_size=V, hidden_size=h, num_layers=L, num_heads=16, activation="gelu", max_seq_len=s)
    assert flops_per_token(config, s) == pytest.approx(72 * L * h * h * (1 + s / (6 * h) + V / (12 * L * h)),
                                                       rel=1e-12)


# ---- bad values ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_with_tokenizer(tmp_path_factory, corpus):
    """A save_pretrained Llama of vocabulary 300 holding the corpus's 400-token tokenizer (too large for it)."""
    import transformers

    path = tmp_path_factory.mktemp("hf") / "llama"
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    transformers.AutoTokenizer.from_pretrained(corpus["tokenizer"]).save_pretrained(path)
    return str(path)


def _tokenizer_without_eos(path):
    """A byte-level BPE saved by the tokenizers library alone (tokenizer.json, no special tokens)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel()
    bpe.train_from_iterator(["some text to learn from"] * 4, trainers.BpeTrainer(vocab_size=300))
    path.mkdir()
    bpe.save(str(path / "tokenizer.json"))


@pytest.mark.parametrize("flags,message", [
    (["--data", "{missing}"], r"^--data .*missing: no such file or directory$"),
    (["--data", "{big_prefix}"], r"^--data .*big: no such file or directory \(a token file\? .*big.bin\)$"),
    (["--data", "{empty_file}"], r"^--data .*empty.txt is empty$"),
    (["--data", "{no_text}"], r"^--data .*no_text holds no .txt, .jsonl or .parquet files$"),
    (["--data", "{blank_dir}"], r"^--data .*blank: its 2 data file\(s\) are all empty$"),
    (["--data", "{bin_alone}"], r"^--data .*alone.bin: a token file needs its JSON sidecar .*alone.json \(dtype, "
                                r"count, vocab_size\) or, for Megatron's format, its index .*alone.idx$"),
    (["--data", "/bin/ls"], r"^--data /bin/ls is not text \(a NUL byte at byte \d+\): give UTF-8 text"),
    (["--data", "{latin1}"], r"^--data .*latin1.txt is not text \(not UTF-8 at byte 3\)"),
    (["--data", "{binary_dir}"], r"^--data .*binary/b.txt is not text \(a NUL byte at byte 3\)$"),
    (["--data", "0.3", "{text}", "0", "{text}"], r"^--data 0.3 .* 0 .*: the weight '0' of .* is not a positive "
                                                 r"number \(a blend is WEIGHT PATH pairs"),
    (["--data", "0.3", "{text}", "-1", "{text}"], r"the weight '-1' of .* is not a positive number"),
    (["--data", "x", "{text}"], r"the weight 'x' of .* is not a positive number"),
    (["--data", "0.3", "{text}", "0.7"], r"^--data 0.3 .* 0.7: a blend is WEIGHT PATH pairs, e.g. --data 0.3 "
                                         r"PREFIX_A 0.7 PREFIX_B$"),
    (["--data", "{text}", "--data-cache-dir", "{empty_file}"], r"^--data-cache-dir .*empty.txt exists and is not a "
                                                                r"directory$"),
    (["--data", "{text}", "--tokenizer", "{missing}"], r"^--tokenizer .*missing: no such directory"),
    (["--data", "{text}", "--tokenizer", "{no_text}"], r"^--tokenizer .*no_text holds no tokenizer files "
                                                       r"\(tokenizer.json, tokenizer_config.json, tokenizer.model or "
                                                       r"vocab.json\)$"),
    (["--data", "{text}", "--tokenizer", "{empty_config}"], r"^--tokenizer .*empty_config: cannot load a tokenizer: "
                                                            r"Couldn't instantiate the backend tokenizer from one of: "
                                                            r"\S.*$"),  # (transformers' lines, joined: all of them)
    (["--data", "{text}", "--tokenizer", "{no_eos}"], r"^--tokenizer .*no_eos: the tokenizer has no EOS token to "
                                                      r"end documents with: name one \(eos_token in its "
                                                      r"tokenizer_config.json\)$"),
    (["--from-hf", "{hf}", "--seq-len", "32"], r"^the tokenizer of --from-hf .*llama has 400 tokens, more than the "
                                               r"model's vocab_size=300$"),
    (["--from-hf", "{hf}", "--tokenizer", "{tokenizer}", "--seq-len", "32"],
     r"^--tokenizer .*tokenizer has 400 tokens, more than the model's vocab_size=300$"),
    (["--from-hf", "{hf}", "--data", "{big_bin}", "--seq-len", "32"],
     r"^--data .*big.bin has vocab_size=500 in its sidecar, more than the model's vocab_size=300$"),
    (["--eval-iters", "0"], r"^--eval-iters=0 must be >= 1$"),
    (["--eval-every", "-1"], r"^--eval-every=-1 must be >= 0$"),
    (["--eval-only"], r"^--eval-only evaluates a model: give --load DIR"),
    (["--data", "{tiny}", "--global-batch-size", "8"], r"^--global-batch-size=8 exceeds the 5 sequences of "
                                                       r"--seq-len=64 in .*tiny.txt left for training"),
    (["--data", "{short}"], r"^--data .*short.txt has 10 tokens: one sequence of --seq-len=64 to train on and one "
                            r"held out for validation need 130; lower --seq-len or give more data$"),
])
def test_bad_data_values_are_one_line_naming_them(flags, message, corpus, hf_with_tokenizer, tmp_path):
    import re

    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "no_text").mkdir()
    (tmp_path / "no_text" / "data.csv").write_text("a,b\n")
    (tmp_path / "empty_config").mkdir()
    (tmp_path / "empty_config" / "tokenizer_config.json").write_text("{}")
    _tokenizer_without_eos(tmp_path / "no_eos")
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "x.txt").write_text("")
    (tmp_path / "blank" / "y.jsonl").write_text("")
    (tmp_path / "alone.bin").write_bytes(b"\0\0")
    np.arange(200, dtype=np.uint16).tofile(tmp_path / "big.bin")
    (tmp_path / "big.json").write_text(json.dumps({"dtype": "uint16", "count": 200, "vocab_size": 500}))
    (tmp_path / "tiny.txt").write_text("x" * 400)  # 6 windows of 64 bytes: 5 to train on, 1 held out
    (tmp_path / "short.txt").write_text("hello wor\n")
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9: d\u00e9j\u00e0 vu".encode("latin-1"))
    (tmp_path / "binary").mkdir()
    (tmp_path / "binary" / "a.txt").write_text("fine text")
    (tmp_path / "binary" / "b.txt").write_bytes(b"ELF\0\x01\x02")  # found while tokenizing, still before any rank
    paths = {"missing": str(tmp_path / "missing"), "empty_file": str(tmp_path / "empty.txt"),
             "no_text": str(tmp_path / "no_text"), "blank_dir": str(tmp_path / "blank"),
             "bin_alone": str(tmp_path / "alone.bin"), "text": corpus["text"], "hf": hf_with_tokenizer,
             "tokenizer": corpus["tokenizer"], "tiny": str(tmp_path / "tiny.txt"), "big_bin": str(tmp_path / "big.bin"),
             "big_prefix": str(tmp_path / "big"), "latin1": str(tmp_path / "latin1.txt"),
             "binary_dir": str(tmp_path / "binary"), "empty_config": str(tmp_path / "empty_config"),
             "no_eos": str(tmp_path / "no_eos"),  # big_prefix, Megatron's habit: a token file named without its .bin
             "short": str(tmp_path / "short.txt")}
    args = _args(*[flag.format(**paths) for flag in flags])
    with pytest.raises(ValueError) as error:
        validate(args)
        data.prepare(args)  # (what the launcher runs next, before any rank: tokenizing a user's text)
    assert len(str(error.value).splitlines()) == 1 and re.search(message, str(error.value)), str(error.value)


def test_a_jsonl_row_without_text_is_named_and_nothing_is_cached(tmp_path):
    (tmp_path / "rows.jsonl").write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    with pytest.raises(ValueError, match=r"rows.jsonl line 2: no field \"text\"$"):
        data.prepare(_args("--data", str(tmp_path / "rows.jsonl")))
    assert os.listdir(tmp_path / "xdg" / "tp-layers" / "tokens") == []  # the half-written file removed
    for name, text in (("one_line.json", '[{"text": "a"}, {"text": "b"}]\n'),
                       ("pretty.json", '[\n  {"text": "a"}\n]\n')):  # a JSON array: not one object a line
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=rf"{name} line 1: a JSON array; JSON lines hold one object a line "
                                             r"\(\{\"text\": \.\.\.\}\)$"):
            data.prepare(_args("--data", str(tmp_path / name)))
    (tmp_path / "numbers.jsonl").write_text('{"text": "fine"}\n{"text": 3}\n')
    with pytest.raises(ValueError, match=r"numbers.jsonl line 2: \"text\" is not a string \(--data-column names "
                                         r"the text\)$"):
        data.prepare(_args("--data", str(tmp_path / "numbers.jsonl")))
    (tmp_path / "bodies.jsonl").write_text('{"body": "one"}\n{"body": "two", "text": 3}\n')
    (prefix,) = data.resolve(_args("--data", str(tmp_path / "bodies.jsonl"), "--data-column", "body"), progress=False)
    assert bytes(data.load(prefix)) == b"one\n\ntwo"  # --data-column: another field


def test_a_json_file_is_json_lines_as_megatron_reads_it(tmp_path):
    """Megatron's preprocess_data reads --input corpus.json as one JSON object per line (field "text"): the documents,
    not the JSON syntax around them."""
    (tmp_path / "corpus.json").write_text('{"text": "first doc", "id": 0}\n{"text": "second", "id": 1}\n')
    (prefix,) = data.resolve(_args("--data", str(tmp_path / "corpus.json")), progress=False)
    assert bytes(data.load(prefix)) == b"first doc\n\nsecond" and indexed.read_index(prefix).documents == 2


def test_from_hf_reads_its_own_tokenizer_and_the_cli_refuses_in_one_line(hf_with_tokenizer, tmp_path, corpus):
    args = _args("--from-hf", hf_with_tokenizer)
    assert data.tokenizer_dir(args) == hf_with_tokenizer and data.vocab_size(args) == 400
    (tmp_path / "text").mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    result = subprocess.run([sys.executable, "-m", "models.train", "--data", str(tmp_path / "text")],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip() == f"error: --data {tmp_path / 'text'} holds no .txt, .jsonl or .parquet files"


# ---- a run on a user's text ---------------------------------------------------------------------------------------

RUN = ["--model", "tiny", "--seq-len", "32", "--global-batch-size", "8", "--micro-batch-size", "2", "--steps", "3",
       "--seed", "5", "--eval-every", "2", "--eval-iters", "2", "--check-inputs"]


@distributed(world_size=8, timeout=300)
def _train(flags, log):
    train(parser().parse_args([*flags, "--log-jsonl", log]))


def _rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_a_users_text_and_tokenizer_train_the_same_curve_at_2x2x2_as_in_one_process(corpus, tmp_path):
    fresh = tmp_path / "text"  # a copy with no cache yet: rank 0 of the 8 tokenizes it, the others wait
    fresh.mkdir()
    for name in ("a.txt", "b.txt", "d.jsonl"):
        (fresh / name).write_bytes(open(os.path.join(corpus["text"], name), "rb").read())
    cache = tmp_path / "cache"  # (the worker processes do not see this test's XDG_CACHE_HOME)
    user = [*RUN, "--data", str(fresh), "--tokenizer", corpus["tokenizer"], "--data-cache-dir", str(cache)]
    ckpt = str(tmp_path / "ckpt")
    run(_train, 8, timeout=300, flags=[*user, "--tp", "2", "--pp", "2", "--dp", "2", "--save", ckpt],
        log=str(tmp_path / "split.jsonl"))
    assert len([f for f in os.listdir(cache) if f.endswith(".idx")]) == 1 and os.listdir(fresh) == \
        ["a.txt", "b.txt", "d.jsonl"] or sorted(os.listdir(fresh)) == ["a.txt", "b.txt", "d.jsonl"]
    run(_train, 1, timeout=300, flags=[*user, "--tp", "1", "--pp", "1", "--dp", "1"],
        log=str(tmp_path / "serial.jsonl"))
    split, serial = _rows(tmp_path / "split.jsonl"), _rows(tmp_path / "serial.jsonl")
    assert [r["step"] for r in split] == [1, 2, 3] and [("val_loss" in r) for r in split] == [False, True, True]
    for ours, reference in zip(split, serial, strict=True):
        for key in ("loss", "val_loss", "grad_norm"):
            if key in reference:
                assert abs(ours[key] - reference[key]) <= 1e-5 * reference[key], (key, ours, reference)
        assert ours["tflops_per_rank"] > 0 and ours["tokens_per_s"] > 0 and ours["grad_norm"] > 0 and ours["lr"] > 0
    assert serial[-1]["loss"] < serial[0]["loss"] < 6.5  # ln(400) = 6.0: a 400-token vocabulary, not bytes
    # per-rank memory in the first row only: 8 ranks hold about a quarter of the model each (tp2 x pp2)
    assert all("param_bytes" in r for r in split[:1]) and not any("param_bytes" in r for r in split[1:])
    for key in ("param_bytes", "grad_bytes"):
        assert serial[0][key] / 4 <= split[0][key] < serial[0][key] / 2, key
    assert split[0]["optimizer_bytes"] >= 2 * split[0]["param_bytes"]  # AdamW: two moments
    # the checkpoint evaluated alone, in one process: the val_loss the 2x2x2 run logged at its last step
    run(_train, 1, timeout=300, flags=[*user, "--tp", "1", "--pp", "1", "--dp", "1", "--load", ckpt,
                                       "--eval-only"], log=str(tmp_path / "eval.jsonl"))
    (evaluated,) = _rows(tmp_path / "eval.jsonl")
    assert evaluated["step"] == 3 and abs(evaluated["val_loss"] - split[-1]["val_loss"]) <= 1e-5 * evaluated["val_loss"]


def test_eval_only_of_a_hf_model_with_its_own_tokenizer_is_transformers_loss_on_the_held_out_windows(corpus,
                                                                                                      tmp_path):
    import transformers

    path = tmp_path / "llama"
    config = transformers.LlamaConfig(vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    transformers.AutoTokenizer.from_pretrained(corpus["tokenizer"]).save_pretrained(path)
    flags = ["--from-hf", str(path), "--data", corpus["text"], "--eval-only", "--eval-iters", "2", "--seq-len", "32",
             "--global-batch-size", "8", "--micro-batch-size", "4", "--tp", "1", "--pp", "1", "--dp", "1",
             "--data-cache-dir", str(tmp_path / "cache")]
    run(_train, 1, timeout=300, flags=flags, log=str(tmp_path / "eval.jsonl"))
    (row,) = _rows(tmp_path / "eval.jsonl")
    args = _args(*flags)
    assert data.tokenizer_dir(args) == str(path)  # no --tokenizer: the model directory's own
    _, held_out, _ = data.datasets(args, data.resolve(args))
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    losses = []
    with torch.no_grad():
        for batch in data.eval_batches(held_out, dp=1, dp_rank=0, global_batch_size=8, micro_batch_size=4, iters=2):
            losses += [torch.nn.functional.cross_entropy(model(x).logits.flatten(0, 1), y.flatten()).item()
                       for x, y in batch]
    assert row["step"] == 0 and abs(row["val_loss"] - sum(losses) / len(losses)) <= 1e-5 * row["val_loss"]
