"""The data formats and the data plan (models/training/data/formats.py, plan.py): every --data path found as its
format in FORMATS, a new format added as one class and one registry line, and what the job found (per dataset:
documents, tokens, share of the blend, epochs its --steps take) printed by the launcher before any rank starts and
written by rank 0 to the ranks' log directory."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from models.training import data
from models.training.cli import job_config, parser, validate
from models.training.data import formats, indexed

SMALL = ["--model", "tiny", "--seq-len", "16", "--global-batch-size", "8", "--micro-batch-size", "2", "--steps", "3",
         "--tp", "1", "--pp", "1", "--dp", "1"]


@pytest.fixture(autouse=True)
def _user_cache(tmp_path, monkeypatch):
    """The token cache under the test's own directory (never the user's)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


def _job(*flags):
    return job_config(parser().parse_args([*SMALL, *flags]))


def _megatron(prefix, docs):
    writer = indexed.Writer(str(prefix), np.uint8)
    for doc in docs:
        writer.add_document(list(doc.encode()))
    writer.close()
    return str(prefix)


def test_each_path_is_found_as_its_format(tmp_path):
    prefix = _megatron(tmp_path / "m_text_document", ["one document\n\n"])
    (tmp_path / "t.bin").write_bytes(bytes(10))
    (tmp_path / "t.json").write_text(json.dumps({"dtype": "uint8", "count": 10, "vocab_size": 256}))
    (tmp_path / "saved").mkdir()
    (tmp_path / "saved" / "state.json").write_text("{}")
    (tmp_path / "texts").mkdir()
    found = {None: "bundled", prefix: "indexed", f"{prefix}.bin": "indexed", f"{prefix}.idx": "indexed",
             str(tmp_path / "t.bin"): "flat", str(tmp_path / "saved"): "save_to_disk", "rows.parquet": "parquet",
             "rows.jsonl": "jsonl", "rows.json": "jsonl", "a.txt": "text", str(tmp_path / "texts"): "text",
             "not/there": "text"}
    assert {path: data.Source(path).kind for path in found} == found
    assert set(found.values()) == set(data.FORMATS)  # (each format of the registry found from a path)


def test_the_data_line_names_a_directorys_files_by_kind(tmp_path):
    """A directory of documents is read by the "text" format (its files each by suffix): what the job prints says
    which files it holds, not "text"."""
    (tmp_path / "shards" / "sub").mkdir(parents=True)
    for name in ("a.parquet", "b.parquet", "sub/c.txt"):
        (tmp_path / "shards" / name).write_text("x")
    source = data.Source(str(tmp_path / "shards"))
    assert source.kind == "text" and source.label == "a directory of 2 .parquet and 1 .txt files"
    assert data.Source("a.txt").label == "text" and data.Source(None).label == "bundled"


class NpyTokens(formats.Format):
    """A format as a user would add it: a numpy .npy array of token ids, read in place."""

    @staticmethod
    def detect(path):
        return path is not None and path.endswith(".npy")

    def check(self, reading):
        np.load(self.path, mmap_mode="r")

    def tokenized(self, reading):
        return False

    def token_file(self, reading, *, build_missing=True, progress=True):
        return self.path

    def open(self, token_file):
        return np.load(token_file, mmap_mode="r")

    def documents(self, token_file):
        return None


def test_a_format_is_one_class_and_one_registry_line(tmp_path, monkeypatch, capsys):
    tokens = (np.arange(1000) % 251).astype(np.uint8)
    np.save(tmp_path / "t.npy", tokens)
    monkeypatch.setattr(formats, "FORMATS", {"npy": NpyTokens, **formats.FORMATS})
    job = _job("--data", str(tmp_path / "t.npy"))
    assert validate(job).vocab_size == 256  # the preflight's checks, through the format
    plan = data.DataPlan.of(job)
    # 62 windows of 16 tokens, 1 held out: 61 to train on, 7 global batches of 8 an epoch
    expected = [f"data: {tmp_path / 't.npy'} (npy): no document index, 1,000 tokens; 3 steps take 0.429 epochs of "
                "its 61 training windows"]
    assert plan.prepare() == expected and capsys.readouterr().out.splitlines() == expected
    train, held, notes = plan.datasets(plan.resolve())
    x, y = train[5]
    assert (len(train), len(held), notes) == (61, 1, [])
    assert x.tolist() == tokens[80:96].tolist() and y.tolist() == tokens[81:97].tolist()


def test_the_launcher_says_what_the_job_found_and_the_log_keeps_it(tmp_path):
    """A blend of a Megatron dataset of bytes (300 documents, 7,990 tokens) and a text file (11,490 bytes): each
    dataset's documents, tokens, share and epochs on stdout before the layout (before any rank starts), and the same
    lines in LOG_DIR/data.txt."""
    a = _megatron(tmp_path / "a_text_document", [f"doc {i}: alpha beta gamma\n\n" for i in range(300)])
    b = tmp_path / "b.txt"
    b.write_text("".join(f"line {i} of the other corpus\n" for i in range(400)))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    result = subprocess.run([sys.executable, "-m", "models.train", *SMALL, "--data", "0.3", a, "0.7", str(b),
                             "--log-dir", str(tmp_path / "logs"), "--no-sample"],
                            capture_output=True, text=True, timeout=300, env=env | {"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    # 499 windows of 16 tokens, 5 held out: 494; 718 windows, 8 held out: 710; 3 steps of 8 draw 7.2 and 16.8
    expected = [f"data: {a} (indexed): 300 documents, 7,990 tokens, 30.0% of the blend; 3 steps take 0.0146 epochs "
                "of its 494 training windows",
                f"data: {b} (text): 1 document, 11,490 tokens, 70.0% of the blend; 3 steps take 0.0237 epochs of its "
                "710 training windows"]
    lines = result.stdout.splitlines()
    assert lines[:2] == expected and lines[2].startswith("layout: 1 ranks"), result.stdout
    assert (tmp_path / "logs" / data.FOUND_FILE).read_text().splitlines() == expected
