"""Megatron's indexed dataset (models/training/data/indexed.py): a pair written by Megatron-Core's own builder logic
(re-stated below, independently of ours) reads to the same documents, ours is that pair byte for byte, and a bad
pair is refused in one line before any process starts."""
import os
import struct

import numpy as np
import pytest

from models.training import data, tokens
from models.training.cli import job_config, parser, validate
from models.training.data import indexed

from .helpers import build_tokenizer


class MegatronBuilder:
    """Megatron-Core's IndexedDatasetBuilder + _IndexWriter (megatron/core/datasets/indexed_dataset.py), as written
    there: the tokens appended to PREFIX.bin; at finalize, PREFIX.idx = b"MMIDIDX\\x00\\x00", <Q 1, <B dtype code,
    <Q sequence count, <Q document count (len(document_indices)), int32 lengths, int64 byte pointers, int64 document
    indices (starting [0], one entry appended per document)."""

    CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.float64: 6, np.float32: 7,
             np.uint16: 8}

    def __init__(self, bin_path, dtype=np.int32):
        self.data_file = open(bin_path, "wb")
        self.dtype = dtype
        self.sequence_lengths = []
        self.document_indices = [0]

    @staticmethod
    def optimal_dtype(cardinality):
        return np.uint16 if cardinality is not None and cardinality < 65500 else np.int32

    def add_item(self, ids):
        array = np.array(ids, dtype=self.dtype)
        self.data_file.write(array.tobytes(order="C"))
        self.sequence_lengths.append(array.size)

    def add_document(self, ids, lengths):
        self.data_file.write(np.array(ids, dtype=self.dtype).tobytes(order="C"))
        self.sequence_lengths.extend(lengths)
        self.document_indices.append(len(self.sequence_lengths))

    def end_document(self):
        self.document_indices.append(len(self.sequence_lengths))

    def finalize(self, idx_path):
        self.data_file.close()
        itemsize = np.int64(np.dtype(self.dtype).itemsize)
        pointers, current = [], np.int64(0)
        for length in self.sequence_lengths:
            pointers.append(current.item())
            current += length * itemsize
        with open(idx_path, "wb") as f:
            f.write(b"MMIDIDX\x00\x00")
            f.write(struct.pack("<Q", 1))
            f.write(struct.pack("<B", self.CODES[self.dtype]))
            f.write(struct.pack("<Q", len(self.sequence_lengths)))
            f.write(struct.pack("<Q", len(self.document_indices)))
            f.write(np.array(self.sequence_lengths, dtype=np.int32).tobytes(order="C"))
            f.write(np.array(pointers, dtype=np.int64).tobytes(order="C"))
            f.write(np.array(self.document_indices, dtype=np.int64).tobytes(order="C"))


def _documents(rng, count, vocab, eos):
    """`count` documents of 1..40 ids, each ended by `eos` (preprocess_data.py --append-eod), one of a single
    token."""
    docs = [list(rng.integers(0, vocab, rng.integers(0, 40))) + [eos] for _ in range(count)]
    docs[3] = [eos]
    return docs


@pytest.mark.parametrize("vocab", [256, 400, 70000])
def test_our_writer_is_megatrons_builder_byte_for_byte(tmp_path, vocab):
    docs = _documents(np.random.default_rng(vocab), 30, vocab, vocab - 1)
    dtype = np.uint8 if vocab == 256 else MegatronBuilder.optimal_dtype(vocab)
    reference = MegatronBuilder(str(tmp_path / "megatron.bin"), dtype=dtype)
    for doc in docs:
        reference.add_document(doc, [len(doc)])  # one sequence per document, as preprocess_data.py writes
    reference.finalize(str(tmp_path / "megatron.idx"))
    assert indexed.dtype_for(vocab) == dtype
    ours = indexed.Writer(str(tmp_path / "ours"), indexed.dtype_for(vocab))
    for doc in docs:
        ours.append(doc[:5])  # in pieces, as the tokenizer's batches come
        ours.append(doc[5:])
        ours.end_document()
    ours.close()
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"ours{suffix}").read_bytes() == (tmp_path / f"megatron{suffix}").read_bytes(), suffix
    assert sorted(os.listdir(tmp_path)) == ["megatron.bin", "megatron.idx", "ours.bin", "ours.idx"]  # no leftovers


def test_a_megatron_dataset_reads_to_the_same_documents(tmp_path):
    """Sentence-split documents (several sequences each) and int32 ids, as Megatron's builder writes them: the
    memory-mapped stream is the documents back to back, each document's span its own ids."""
    rng = np.random.default_rng(0)
    builder = MegatronBuilder(str(tmp_path / "corpus_text_sentence.bin"), dtype=np.int32)
    documents = []
    for d in range(12):
        sentences = [list(rng.integers(0, 100_000, rng.integers(1, 9))) for _ in range(1 + d % 3)]
        for sentence in sentences:
            builder.add_item(sentence)
        builder.end_document()
        documents.append([i for s in sentences for i in s])
    builder.finalize(str(tmp_path / "corpus_text_sentence.idx"))
    index = indexed.read_index(str(tmp_path / "corpus_text_sentence"))
    stream = indexed.read_tokens(index)
    assert (index.dtype, index.documents, len(index.lengths)) == (np.dtype(np.int32), 12, sum(1 + d % 3
                                                                                              for d in range(12)))
    assert stream.tolist() == [i for doc in documents for i in doc]
    assert [stream[slice(*index.document_span(d))].tolist() for d in range(12)] == documents
    prefix = str(tmp_path / "corpus_text_sentence")
    for given in (prefix, prefix + ".bin", prefix + ".idx"):  # the prefix, as Megatron's flag takes it, or a file
        assert data.Source(given).kind == "indexed"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    text = "".join(f"document {i}: the quick brown fox {i * 7} jumps over the lazy dog.\n" for i in range(200))
    return build_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer", text, 300)


def test_the_token_cli_writes_what_megatrons_preprocess_data_would(tmp_path, tokenizer, capsys):
    from transformers import AutoTokenizer

    (tmp_path / "docs.jsonl").write_text('{"text": "the quick brown fox"}\n{"text": "jumps"}\n\n{"text": "x"}\n')
    assert tokens.main(["--data", str(tmp_path / "docs.jsonl"), "--tokenizer", tokenizer,
                        "--out", str(tmp_path / "out" / "mine")]) == 0
    assert capsys.readouterr().out == f"{tmp_path / 'out' / 'mine'}.bin: 10 uint16 tokens, 3 documents\n"
    tok = AutoTokenizer.from_pretrained(tokenizer)
    reference = MegatronBuilder(str(tmp_path / "ref.bin"), dtype=MegatronBuilder.optimal_dtype(tok.vocab_size))
    for text in ("the quick brown fox", "jumps", "x"):
        ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]  # --append-eod
        reference.add_document(ids, [len(ids)])
    reference.finalize(str(tmp_path / "ref.idx"))
    for suffix in (".bin", ".idx"):
        assert (tmp_path / "out" / f"mine{suffix}").read_bytes() == (tmp_path / f"ref{suffix}").read_bytes()
    assert sorted(os.listdir(tmp_path / "out")) == ["mine.bin", "mine.idx"]


def _job(*flags):
    return job_config(parser().parse_args(["--tp", "1", "--pp", "1", "--dp", "1", "--seq-len", "8",
                                           "--global-batch-size", "4", *flags]))


def test_training_reads_a_megatron_dataset_in_place_with_its_tokenizers_vocabulary(tmp_path, tokenizer):
    docs = _documents(np.random.default_rng(1), 200, 300, 0)
    writer = indexed.Writer(str(tmp_path / "corpus"), np.uint16)
    for doc in docs:
        writer.add_document(doc)
    writer.close()
    job = _job("--data", str(tmp_path / "corpus"), "--tokenizer", tokenizer)
    assert validate(job).vocab_size == 300  # the tokenizer's
    (token_file,) = data.resolve(job)
    assert token_file == str(tmp_path / "corpus") and data.load(token_file).tolist() == sum(docs, [])
    train, held = data.datasets(job, [token_file])[:2]
    x, y = train[0]
    assert x.tolist() == sum(docs, [])[:8] and y.tolist() == sum(docs, [])[1:9]
    data.prepare(job)  # ids checked against the vocabulary: fine
    assert sorted(os.listdir(tmp_path)) == ["corpus.bin", "corpus.idx"]  # nothing written beside the data


def test_windows_carry_each_documents_eod_where_the_document_ends(tmp_path):
    """The windows are the token stream cut every seq_len tokens: a document longer than a window spans several, a
    window starts mid-document, a one-token document is its EOD alone; the EOD after each document is where the
    index says it ends (what document ids are derived from)."""
    eod, seq_len = 1, 8
    docs = [[5] * 20 + [eod], [eod], [6, 7, eod], [8] * 3 + [eod], [9] * 30 + [eod]]  # lengths 21, 1, 3, 4, 31
    _write(str(tmp_path / "docs"), docs, np.uint8)
    index = indexed.read_index(str(tmp_path / "docs"))
    windows = data.TokenWindows(indexed.read_tokens(index), seq_len)
    ends = {index.document_span(d)[1] - 1 for d in range(index.documents)}  # each document's last token: its EOD
    for i in range(len(windows)):
        x, _ = windows[i]
        first, _ = windows.span(i)
        assert {first + p for p in (x == eod).nonzero().flatten().tolist()} == {e for e in ends
                                                                                 if first <= e < first + seq_len}
    assert windows.span(2)[0] == 16 and index.document_span(0)[1] > 16  # window 2 starts inside document 0


def _write(prefix, docs, dtype=np.uint16):
    writer = indexed.Writer(prefix, dtype)
    for doc in docs:
        writer.add_document(doc)
    writer.close()


def _corrupt(tmp_path, how):
    prefix = str(tmp_path / "c")
    _write(prefix, [[1, 2, 3, 0]] * 20)
    idx = bytearray(open(prefix + ".idx", "rb").read())
    if how == "header":
        idx[:9] = b"NOTMEGATR"
    elif how == "version":
        idx[9:17] = struct.pack("<Q", 2)
    elif how == "float":
        idx[17] = 7
    elif how == "truncated":
        idx = idx[:-5]
    elif how == "bin":
        with open(prefix + ".bin", "ab") as f:
            f.write(b"\0\0")
    elif how == "no_idx":
        os.remove(prefix + ".idx")
    elif how == "no_bin":
        os.remove(prefix + ".bin")
    if how not in ("bin", "no_idx", "no_bin"):
        open(prefix + ".idx", "wb").write(bytes(idx))
    return prefix


@pytest.mark.parametrize("how,message", [
    ("header", r"^--data .*c: .*c.idx is not a Megatron index \(its header is not b'MMIDIDX\\x00\\x00'\)$"),
    ("version", r"^--data .*c: .*c.idx: index version 2, only 1 is known$"),
    ("float", r"^--data .*c: .*c.idx: dtype code 7 is not an integer token type"),
    ("truncated", r"^--data .*c: .*c.idx: 437 bytes, but its 20 sequences and 21 document indices make 442: "
                  r"truncated or corrupt$"),
    ("bin", r"^--data .*c: .*c.bin holds 162 bytes, but its index says 80 uint16 tokens \(160 bytes\) back to back$"),
    ("no_idx", r"^--data .*c: no such file or directory, and .*c.bin has no index .*c.idx \(Megatron's indexed "
               r"dataset is PREFIX.bin \+ PREFIX.idx\)$"),
    ("no_bin", r"^--data .*c: its index .*c.idx is there but not its tokens .*c.bin$"),
])
def test_a_bad_megatron_pair_is_one_line_before_any_process(tmp_path, tokenizer, how, message):
    import re

    prefix = _corrupt(tmp_path, how)
    with pytest.raises(ValueError) as error:
        validate(_job("--data", prefix, "--tokenizer", tokenizer))
    assert len(str(error.value).splitlines()) == 1 and re.search(message, str(error.value)), str(error.value)


def test_ids_beyond_the_vocabulary_and_a_missing_tokenizer_are_refused(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    _write(str(tmp_path / "big"), [[1, 2, 3, 0]] * 30 + [[5, 299, 300, 0]] + [[1, 0]] * 10)
    job = _job("--data", str(tmp_path / "big"), "--tokenizer", tokenizer)
    validate(job)  # (the header alone: the ids are scanned once, by the launcher)
    with pytest.raises(ValueError, match=r"^--data .*big: token 122 is id 300, outside the vocabulary of 300 ids of "
                                         r"--tokenizer .*tokenizer$"):
        data.prepare(job)
    with pytest.raises(ValueError, match=r"^--data .*big: a Megatron dataset of uint16 ids needs the vocabulary it "
                                         r"was tokenized with: give --tokenizer DIR \(a Hugging Face tokenizer "
                                         r"directory, as save_pretrained writes\), or --tokenizer-type "
                                         r"NullTokenizer --vocab-size N for ids below N$"):
        validate(_job("--data", str(tmp_path / "big")))
    _write(str(tmp_path / "fine"), [[1, 2, 3, 0]] * 30)
    fine = _job("--data", str(tmp_path / "fine"), "--tokenizer", tokenizer)
    data.prepare(fine)
    marker, = os.listdir(tmp_path / "cache" / "tp-layers" / "tokens" / "checked")  # scanned once per file version
    data.prepare(fine)
    _write(str(tmp_path / "bytes"), [list(b"some bytes\n\n")] * 30, np.uint8)  # uint8 ids: bytes, no tokenizer
    assert validate(_job("--data", str(tmp_path / "bytes"))).vocab_size == 256


def test_megatrons_null_tokenizer_reads_pretokenized_ids_below_the_vocab_size(tmp_path, monkeypatch):
    """Megatron's `--tokenizer-type NullTokenizer --vocab-size N`: token ids below N with no tokenizer, N the end of
    document, the model's vocabulary N + 1 (padded for tp); ids past N refused; text (nothing to tokenize it with),
    a tokenizer beside it and a missing --vocab-size are one line each."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    eod = 1000
    docs = [list(np.random.default_rng(d).integers(0, 1000, 20)) + [eod] for d in range(40)]
    _write(str(tmp_path / "ids"), docs, np.uint16)
    null = ("--data", str(tmp_path / "ids"), "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000")
    job = _job(*null, "--reset-attention-mask")
    config = validate(job)
    assert config.vocab_size >= 1001 and data.vocab_size(job) == 1001 and data.eod_id(job) == eod
    data.prepare(job)  # every id <= 1000
    _write(str(tmp_path / "over"), docs + [[1001, eod]], np.uint16)
    with pytest.raises(ValueError, match=r"^--data .*over: token 840 is id 1001, outside the vocabulary of 1001 "
                                         r"ids of --tokenizer-type NullTokenizer --vocab-size 1000$"):
        data.prepare(_job("--data", str(tmp_path / "over"), *null[2:]))
    (tmp_path / "text.txt").write_text("some text\n")
    for flags, message in [
            (("--data", str(tmp_path / "text.txt"), *null[2:]), r"^--tokenizer-type NullTokenizer reads token ids "
             r"\(a Megatron \.bin/\.idx pair or a flat token file\), not --data .*text\.txt"),
            (null[:4], r"^--tokenizer-type NullTokenizer needs --vocab-size N \(its ids are below N, N ends a "
             r"document\)$"),
            ((*null, "--tokenizer", str(tmp_path)), r"^--tokenizer-type NullTokenizer with --tokenizer .*: the one "
             r"reads ids without a tokenizer, the other tokenizes: give one")]:
        with pytest.raises(ValueError, match=message):
            validate(_job(*flags))
