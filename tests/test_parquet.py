"""Parquet files and directories, and Hugging Face `save_to_disk` directories (models/training/data/arrow.py):
rows streamed a batch at a time into the same tokens as each row tokenized alone, --data-column, and the bad
inputs (no such column, not parquet, no pyarrow) refused in one line before any process starts."""
import json
import re
import sys

import numpy as np
import pytest

from models.training import data
from models.training.cli import job_config, parser, validate
from models.training.data import arrow, indexed, sources

from .helpers import build_tokenizer

try:
    import pyarrow as pa
    import pyarrow.parquet as pq
except ImportError:
    pa = pq = None
needs_pyarrow = pytest.mark.skipif(pa is None, reason="pyarrow is not installed (pip install 'tp-layers[data]')")

ROWS = [f"row {i}: " + "words and more words " * (i % 7) for i in range(300)]


@pytest.fixture(autouse=True)
def _user_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer", "\n".join(ROWS), 300)


def _job(*flags):
    return job_config(parser().parse_args(["--tp", "1", "--pp", "1", "--dp", "1", "--seq-len", "16",
                                           "--global-batch-size", "4", *flags]))


def _expected(tokenizer, texts):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    return sum((tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts), [])


def _parquet(path, rows, row_group_size=64, **columns):
    table = pa.table({"text": rows, "id": list(range(len(rows))), **columns})
    pq.write_table(table, path, row_group_size=row_group_size)
    return str(path)


@needs_pyarrow
def test_a_parquet_file_and_directory_stream_into_the_tokens_of_each_row(tmp_path, tokenizer, monkeypatch):
    path = _parquet(tmp_path / "corpus.parquet", ROWS)
    assert pq.ParquetFile(path).num_row_groups == 5
    monkeypatch.setattr(arrow, "_BATCH_ROWS", 16)  # many batches per row group: the file is never read whole
    batches = []
    real = pq.ParquetFile.iter_batches
    monkeypatch.setattr(pq.ParquetFile, "iter_batches",
                        lambda self, **kw: (batches.append(b.num_rows) or b for b in real(self, **kw)))
    job = _job("--data", path, "--tokenizer", tokenizer)
    validate(job)
    (prefix,) = data.resolve(job, progress=False)
    assert data.load(prefix).tolist() == _expected(tokenizer, ROWS) and indexed.read_index(prefix).documents == 300
    assert max(batches) == 16 and len(batches) >= 300 // 16
    # a directory of parquet files (and text beside them), sorted; --data-column another column
    (tmp_path / "dir" / "sub").mkdir(parents=True)
    _parquet(tmp_path / "dir" / "b.parquet", ROWS[100:], body=ROWS[100:][::-1])
    _parquet(tmp_path / "dir" / "sub" / "c.parquet", ROWS[:50], body=ROWS[:50][::-1])
    (tmp_path / "dir" / "a.jsonl").write_text("".join(json.dumps({"body": r}) + "\n" for r in ROWS[50:100]))
    job = _job("--data", str(tmp_path / "dir"), "--tokenizer", tokenizer, "--data-column", "body")
    validate(job)
    (prefix,) = data.resolve(job, progress=False)
    assert data.load(prefix).tolist() == _expected(tokenizer, ROWS[50:100] + ROWS[100:][::-1] + ROWS[:50][::-1])


def _saved_to_disk(directory, shards, dict_splits=None):
    """A directory as datasets' save_to_disk writes it: Arrow IPC stream shards named in state.json (written here
    with pyarrow alone; test_a_save_to_disk_directory_reads_what_datasets_loads checks datasets' own)."""
    if dict_splits:
        directory.mkdir(parents=True)
        (directory / "dataset_dict.json").write_text(json.dumps({"splits": dict_splits}))
        directory = directory / dict_splits[0]
    directory.mkdir(parents=True)
    names = [f"data-{i:05d}-of-{len(shards):05d}.arrow" for i in range(len(shards))]
    for name, rows in zip(names, shards):
        table = pa.table({"text": rows, "id": list(range(len(rows)))})
        with pa.OSFile(str(directory / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=7):
                writer.write_batch(batch)
    (directory / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names],
                                                      "_fingerprint": "0", "_format_type": None, "_split": None}))
    (directory / "dataset_info.json").write_text("{}")


@needs_pyarrow
def test_a_save_to_disk_directory_streams_its_shards_in_order(tmp_path, tokenizer):
    _saved_to_disk(tmp_path / "ds", [ROWS[:120], ROWS[120:]])
    _saved_to_disk(tmp_path / "dd", [ROWS[:40]], dict_splits=["train", "test"])
    for name, rows in (("ds", ROWS), ("dd", ROWS[:40])):
        job = _job("--data", str(tmp_path / name), "--tokenizer", tokenizer)
        assert data.data_sources(job)[0].kind == "save_to_disk"
        validate(job)
        (prefix,) = data.resolve(job, progress=False)
        assert data.load(prefix).tolist() == _expected(tokenizer, rows)
    _saved_to_disk(tmp_path / "test_only", [ROWS[:10]], dict_splits=["test"])
    with pytest.raises(ValueError, match=r"^--data .*test_only: a DatasetDict without a \"train\" split \(splits: "
                                         r"test\): give the directory of the split to read$"):
        validate(_job("--data", str(tmp_path / "test_only"), "--tokenizer", tokenizer))


@needs_pyarrow
def test_a_save_to_disk_directory_reads_what_datasets_loads(tmp_path):
    datasets = pytest.importorskip("datasets")
    table = datasets.Dataset.from_dict({"text": ROWS, "n": list(range(len(ROWS)))})
    table.save_to_disk(str(tmp_path / "one"), num_shards=3)
    table.shuffle(seed=0).select(range(50)).save_to_disk(str(tmp_path / "picked"))  # an indices mapping, flattened
    datasets.DatasetDict({"train": table, "test": table.select(range(5))}).save_to_disk(str(tmp_path / "dict"))
    for name in ("one", "picked", "dict"):
        loaded = datasets.load_from_disk(str(tmp_path / name))
        loaded = loaded["train"] if isinstance(loaded, datasets.DatasetDict) else loaded
        files = sources.data_files(str(tmp_path / name))
        assert [text for text, _, _ in sources.rows(files, "text")] == loaded["text"], name


@needs_pyarrow
@pytest.mark.parametrize("case,message", [
    ("no_column", r"^--data .*corpus.parquet has no column \"body\" \(columns: text, id; --data-column NAME picks "
                  r"one\)$"),
    ("not_parquet", r"^--data .*fake.parquet is not a parquet file: "),
    ("no_pyarrow", r"^--data .*corpus.parquet: reading parquet or Arrow data needs pyarrow \(pip install "
                   r"'tp-layers\[data\]'\)$"),
    ("arrow_no_column", r"^--data .*data-00000-of-00001.arrow has no column \"body\" \(columns: text, id;"),
    ("state", r"^--data .*broken: state.json lists data-00009.arrow, which is not there$"),
])
def test_bad_columnar_input_is_one_line_before_any_process(tmp_path, tokenizer, monkeypatch, case, message):
    path = _parquet(tmp_path / "corpus.parquet", ROWS[:20])
    (tmp_path / "fake.parquet").write_text("not parquet at all")
    _saved_to_disk(tmp_path / "ds", [ROWS[:20]])
    _saved_to_disk(tmp_path / "broken", [ROWS[:20]])
    (tmp_path / "broken" / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00009.arrow"}]}))
    flags = {"no_column": [path, "--data-column", "body"], "not_parquet": [str(tmp_path / "fake.parquet")],
             "no_pyarrow": [path], "arrow_no_column": [str(tmp_path / "ds"), "--data-column", "body"],
             "state": [str(tmp_path / "broken")]}[case]
    if case == "no_pyarrow":
        monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow raises ImportError
    with pytest.raises(ValueError) as error:
        validate(_job("--tokenizer", tokenizer, "--data", *flags))
    assert len(str(error.value).splitlines()) == 1 and re.search(message, str(error.value)), str(error.value)
    assert not (tmp_path / "xdg").exists()  # nothing tokenized


def test_the_package_imports_and_reads_text_without_pyarrow(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    (tmp_path / "a.txt").write_text("plain text needs no pyarrow")
    (prefix,) = data.resolve(_job("--data", str(tmp_path / "a.txt")), progress=False)
    assert bytes(np.asarray(data.load(prefix))) == b"plain text needs no pyarrow"
