"""Columnar data through pyarrow, an optional dependency (pip install 'tp-layers[data]'): parquet files read one
batch of rows at a time (row group by row group), and directories written by Hugging Face datasets' `save_to_disk`:
Arrow IPC stream files named in its state.json ("_data_files"), read the same way, without `datasets`. A
DatasetDict's directory (dataset_dict.json) is read through its "train" split.
"""
import json
import os
from collections.abc import Iterator
from typing import Any

_BATCH_ROWS = 1024  # rows per batch read: a few MB of text


def require(path: str, what: str = "--data") -> Any:
    """pyarrow, or one line saying it is needed."""
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise ValueError(f"{what} {path}: reading parquet or Arrow data needs pyarrow (pip install "
                         "'tp-layers[data]')") from None
    return pyarrow


def is_saved_dataset(path: str) -> bool:
    """A directory written by datasets' save_to_disk (a Dataset's or a DatasetDict's)."""
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, name))
                                       for name in ("state.json", "dataset_dict.json"))


def data_files(directory: str) -> list[str]:
    """The Arrow files of a save_to_disk directory, in order; one line if its state.json is not as written."""
    if os.path.isfile(os.path.join(directory, "dataset_dict.json")):
        splits = _json(os.path.join(directory, "dataset_dict.json")).get("splits", [])
        if "train" not in splits:
            raise ValueError(f"--data {directory}: a DatasetDict without a \"train\" split (splits: "
                             f"{', '.join(map(str, splits))}): give the directory of the split to read")
        directory = os.path.join(directory, "train")
    state = _json(os.path.join(directory, "state.json"))
    files = [entry.get("filename") if isinstance(entry, dict) else None for entry in state.get("_data_files") or []]
    if not files or not all(isinstance(f, str) and f == os.path.basename(f) for f in files):
        raise ValueError(f"--data {directory}: state.json lists no Arrow files (\"_data_files\") by plain name")
    paths = [os.path.join(directory, f) for f in files]
    for path in paths:
        if not os.path.isfile(path):
            raise ValueError(f"--data {directory}: state.json lists {os.path.basename(path)}, which is not there")
    return paths


def _json(path):
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--data {os.path.dirname(path)}: unreadable {os.path.basename(path)}: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"--data {os.path.dirname(path)}: {os.path.basename(path)} is not a JSON object")
    return value


def _open(path, what):
    """(a pyarrow ParquetFile or RecordBatchStreamReader, the memory-mapped file of the latter)."""
    pa = require(path, what)
    try:
        if path.endswith(".parquet"):
            import pyarrow.parquet as pq

            return pq.ParquetFile(path), None
        source = pa.memory_map(path)
        return pa.ipc.open_stream(source), source
    except (pa.ArrowException, OSError) as e:
        kind = "a parquet file" if path.endswith(".parquet") else "an Arrow stream file (save_to_disk)"
        raise ValueError(f"{what} {path} is not {kind}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
                         ) from None


def check_column(path: str, column: str, what: str = "--data") -> None:
    """One line if the file has no `column` (its schema only is read)."""
    reader, _ = _open(path, what)
    names = reader.schema_arrow.names if path.endswith(".parquet") else reader.schema.names
    if column not in names:
        raise ValueError(f"{what} {path} has no column \"{column}\" (columns: {', '.join(names)}; --data-column "
                         "NAME picks one)")


def rows(path: str, column: str) -> Iterator[tuple[Any, int, float]]:
    """Yield (the value of `column`, the row's number from 1, the fraction of the file read) for every row."""
    check_column(path, column)
    reader, source = _open(path, "--data")
    if source is None:  # parquet: row groups, a batch of rows at a time
        total = max(1, reader.metadata.num_rows)
        batches, fraction = reader.iter_batches(batch_size=_BATCH_ROWS, columns=[column]), lambda: number / total
    else:  # an Arrow stream: its record batches as written
        size = max(1, os.path.getsize(path))
        batches, fraction = reader, lambda: source.tell() / size
    number = 0
    for batch in batches:
        done = fraction()
        for value in batch.column(column).to_pylist():
            number += 1
            yield value, number, done
