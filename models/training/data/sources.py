"""The files of a `--data PATH` of documents (the formats of formats.py that tokenize into the cache), and their
documents read in pieces (a corpus larger than memory streams through).

- A directory written by Hugging Face datasets' `save_to_disk` (state.json and Arrow stream files; a DatasetDict's
  "train" split), rows read with pyarrow (arrow.py).
- Text: a .txt file (one document), a .jsonl file (one document per line, field "text" or --data-column; a .json file
  given as --data reads the same way: Megatron's loose JSON), a .parquet file (one document per row, streamed in row
  groups), or a directory of them (searched recursively, sorted, hidden entries skipped). Text must be UTF-8 without
  NUL bytes: anything else (a binary file given by mistake) is refused in one line, never trained on.

Also the names a Megatron dataset goes by (prefix_of) and the line for a path that is not there (missing).
"""
import codecs
import json
import os
from collections.abc import Iterator
from typing import Any

from . import arrow, indexed

FILE_SUFFIXES = (".txt", ".jsonl", ".parquet")  # what a directory's walk reads
ROW_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")
CHUNK_CHARS = 1 << 20  # a long document is tokenized in pieces of ~1M characters cut at line ends
_SNIFF = 1 << 16  # bytes of a single text file checked before any process starts
DEFAULT_COLUMN, SFT_COLUMN = "text", "messages"


def prefix_of(path: str) -> str:
    """A Megatron dataset's PREFIX, also when given as PREFIX.bin or PREFIX.idx."""
    return path[:-4] if path.endswith((".bin", ".idx")) and indexed.exists(path[:-4]) else path


def missing(path: str) -> str:
    """The one line for a --data PATH that does not exist, with a hint when a token file is near."""
    if os.path.isfile(path + ".bin") and os.path.isfile(path + ".json"):
        return f"--data {path}: no such file or directory (a token file? {path}.bin)"
    if os.path.isfile(path + ".bin"):
        return f"--data {path}: no such file or directory, and {path}.bin has no index {path}.idx (Megatron's " \
               "indexed dataset is PREFIX.bin + PREFIX.idx)"
    if os.path.isfile(path + ".idx"):
        return f"--data {path}: its index {path}.idx is there but not its tokens {path}.bin"
    return f"--data {path}: no such file or directory"


def data_files(path: str) -> list[str]:
    """The files of --data PATH that hold documents: the file itself, a directory's .txt/.jsonl/.parquet files, or a
    save_to_disk directory's Arrow files, in order."""
    if arrow.is_saved_dataset(path):
        return arrow.data_files(path)
    if os.path.isfile(path):
        return [path]
    found = []
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [os.path.join(root, f) for f in sorted(files) if f.endswith(FILE_SUFFIXES) and not f.startswith(".")]
    return found


def check_text(path: str, what: str = "--data") -> None:
    """One line if the start of file `path` is not text (a NUL byte, or not UTF-8)."""
    with open(path, "rb") as f:
        head = f.read(_SNIFF)
    problem = _not_text(head, final=len(head) < _SNIFF)
    if problem:
        raise ValueError(f"{what} {path} is not text ({problem}): give UTF-8 text (.txt, .jsonl), .parquet, a "
                         "Megatron PREFIX (PREFIX.bin + PREFIX.idx) or a token file PREFIX.bin with its PREFIX.json")


def _not_text(raw, *, final, offset=0):
    nul = raw.find(b"\0")
    if nul >= 0:
        return f"a NUL byte at byte {offset + nul}"
    try:
        codecs.getincrementaldecoder("utf-8")().decode(raw, final=final)
    except UnicodeDecodeError as e:
        return f"not UTF-8 at byte {offset + e.start}"
    return None


def check_columns(files: list[str], column: str, what: str = "--data") -> None:
    """The parquet and Arrow files hold `column` (their schemas only: no rows read)."""
    for path in files:
        if path.endswith((".parquet", ".arrow")):
            arrow.check_column(path, column, what)


# ---- reading ---------------------------------------------------------------------------------------------------------


def rows(files: list[str], column: str) -> Iterator[tuple[Any, str, int]]:
    """Yield (the row's `column` value, where it is for an error: "FILE line N" / "FILE row N", bytes of the source
    read so far) for every row of the .jsonl/.json/.parquet/.arrow files."""
    done = 0
    for path in files:
        size = os.path.getsize(path)
        if path.endswith((".parquet", ".arrow")):
            for value, number, fraction in arrow.rows(path, column):
                yield value, f"{path} row {number}", done + int(size * fraction)
        elif path.endswith((".jsonl", ".json")):
            yield from _json_rows(path, column, done)
        else:
            raise ValueError(f"--data {path}: rows are read from .jsonl, .parquet or save_to_disk data, not text "
                             "files")
        done += size


def _json_rows(path, column, done):
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            done += len(line)
            if not line.strip():
                continue
            if line.lstrip().startswith(b"["):
                raise ValueError(f"--data {path} line {number}: a JSON array; JSON lines hold one object a line "
                                 f"({{\"{column}\": ...}})")
            try:
                row = json.loads(line)
            except UnicodeDecodeError as e:
                raise ValueError(f"--data {path} line {number}: not UTF-8 ({e.reason})") from None
            except json.JSONDecodeError as e:
                raise ValueError(f"--data {path} line {number}: not JSON ({e})") from None
            if not isinstance(row, dict) or column not in row:
                raise ValueError(f"--data {path} line {number}: no field \"{column}\"")
            yield row[column], f"{path} line {number}", done


def text_pieces(files: list[str], column: str) -> Iterator[tuple[str, bool, int]]:
    """Yield (a piece of a document, whether it ends the document, bytes of the source read so far): a .txt file is
    one document, a row of the others one."""
    done = 0
    for path in files:
        if path.endswith(ROW_SUFFIXES):
            for text, where, read in rows([path], column):
                if not isinstance(text, str):
                    raise ValueError(f"--data {where}: \"{column}\" is not a string (--data-column names the text)")
                pieces = list(_pieces(text))
                for i, piece in enumerate(pieces):
                    yield piece, i == len(pieces) - 1, done + read
        else:
            for piece, last, read in _file_pieces(path):
                yield piece, last, done + read
        done += os.path.getsize(path)


def _file_pieces(path):
    """A text file read ~1 MB at a time and checked as it goes; a file longer than CHUNK_CHARS in pieces (_cut)."""
    decoder, offset, pending = codecs.getincrementaldecoder("utf-8")(), 0, ""
    with open(path, "rb") as f:
        while True:
            raw = f.read(CHUNK_CHARS)
            problem = _not_text(raw, final=not raw, offset=offset) if b"\0" in raw else None
            try:
                pending += decoder.decode(raw, final=not raw)
            except UnicodeDecodeError as e:
                problem = f"not UTF-8 near byte {offset + e.start}"
            if problem:
                raise ValueError(f"--data {path} is not text ({problem})")
            offset += len(raw)
            if not raw:
                yield pending, True, offset
                return
            if len(pending) > CHUNK_CHARS:
                cut = _cut(pending, CHUNK_CHARS)
                yield pending[:cut], False, offset
                pending = pending[cut:]


def _pieces(text):
    """A document in pieces of ~CHUNK_CHARS characters (_cut)."""
    start = 0
    while len(text) - start > CHUNK_CHARS:
        stop = start + _cut(text[start:start + CHUNK_CHARS + 1], CHUNK_CHARS)
        yield text[start:stop]
        start = stop
    yield text[start:]


def _cut(text, limit):
    """Where to cut `text` at or before `limit`: after a line end followed by a non-blank character where there is
    one (the pieces are tokenized apart, and a tokenizer's pre-split keeps a line's leading blanks with the line end
    before them), else after any line end, else at `limit`."""
    cut = text.rfind("\n", 0, limit)
    while cut > 0 and (cut + 1 >= len(text) or text[cut + 1].isspace()):
        cut = text.rfind("\n", 0, cut)
    if cut > 0:
        return cut + 1
    return (text.rfind("\n", 0, limit) + 1) or limit
