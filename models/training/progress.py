"""What rank 0 shows while training: a tqdm bar on a terminal; one plain line every --log-interval steps when stdout
is a file or a pipe (Megatron's style: no carriage returns); and the JSONL log, kept as one run across resumes.

The line (`postfix`): the loss, the gradient norm, the learning rate, the tokens consumed so far, tokens/s, the
pipeline's bubble, rank 0's peak memory (the GPU's allocated bytes; on the CPU the process's resident high-water
mark), the elapsed time and the time per step."""
import json
import os
import sys
import time
from typing import Any, TextIO


def progress(show: bool, start: int, total: int, *, interval: int, stream: TextIO | None = None) -> Any:
    """A tqdm-like object (`update(n)`, `set_postfix(**fields)`, `close()`): tqdm when `stream` (stdout) is a
    terminal, else plain lines every `interval` steps and at the last; nothing when not `show`."""
    stream = sys.stdout if stream is None else stream
    if not show:
        return _Quiet()
    if stream.isatty():
        from tqdm import tqdm

        return tqdm(total=total, initial=start, desc="train", unit="step", dynamic_ncols=True, file=stream)
    return PlainLines(start, total, interval=interval, stream=stream)


class _Quiet:
    def update(self, n=1):
        pass

    def set_postfix(self, **fields):
        pass

    def close(self):
        pass


def postfix(record: dict, *, tokens: int, peak_bytes: int, bubble: bool) -> dict[str, str]:
    """The fields of a step's progress line, in order, from its log record, the `tokens` trained on so far and rank
    0's `peak_bytes`."""
    fields = {"loss": f"{record['loss']:.4f}",
              "grad_norm": "skipped" if record.get("skipped") else f"{record['grad_norm']:.3f}",
              "lr": f"{record['lr']:.3g}", "tokens": amount(tokens), "tok_s": f"{record['tokens_per_s']:.0f}"}
    if bubble:
        fields["bubble"] = f"{record['bubble']:.2f}"
    fields["peak_mem"] = f"{peak_bytes / 2**30:.2f} GiB"
    if "val_loss" in record:
        fields["val_loss"] = f"{record['val_loss']:.4f}"
    return fields


def amount(n: int) -> str:
    """12345678 -> 12.3M (K, M, B, T)."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def peak_memory_bytes(device: Any) -> int:
    """This process's peak memory: on a GPU the bytes torch allocated there at most, else the resident set's
    high-water mark."""
    if getattr(device, "type", "cpu") == "cuda":
        import torch

        return torch.cuda.max_memory_allocated(device)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # (Linux: KiB)


class PlainLines:
    """`step 10/100 | loss 4.8123 | ... | tok_s 1884 | elapsed 0:00:04 | 0.35 s/step`: printed when set_postfix follows
    an update that reached a multiple of `interval` (or the last step)."""

    def __init__(self, start: int, total: int, *, interval: int, stream: TextIO):
        self.n, self.total, self.interval, self.stream = start, total, max(1, interval), stream
        self._since, self._steps, self._printed = time.perf_counter(), 0, start
        self._started = self._since

    def update(self, n: int = 1) -> None:
        self.n += n
        self._steps += n

    def set_postfix(self, **fields: Any) -> None:
        """Print the line if this step is due (every `interval`, the last, or one with a val_loss to show)."""
        due = self.n % self.interval == 0 or self.n == self.total or "val_loss" in fields
        if self._printed == self.n or not due:
            return
        now = time.perf_counter()
        per_step = (now - self._since) / max(1, self._steps)
        width = len(str(self.total))
        elapsed = int(now - self._started)
        line = " | ".join([f"step {self.n:>{width}}/{self.total}", *(f"{k} {v}" for k, v in fields.items()),
                           f"elapsed {elapsed // 3600}:{elapsed // 60 % 60:02d}:{elapsed % 60:02d}",
                           f"{per_step:.3g} s/step"])
        print(line, file=self.stream, flush=True)
        self._since, self._steps, self._printed = now, 0, self.n

    def close(self) -> None:
        pass


def exclude(bar: Any, seconds: float) -> None:
    """Leave `seconds` (an evaluation's) out of the bar's time per step: s/step (and tokens/s) measure training."""
    if isinstance(bar, PlainLines):
        bar._since += seconds
    elif hasattr(bar, "start_t"):  # tqdm: its rate runs from start_t, its smoothing from last_print_t
        bar.start_t += seconds
        bar.last_print_t += seconds


def open_log(path: str, start_step: int) -> TextIO:
    """The JSONL log opened for appending by a run that starts after step `start_step`: rows of later steps (a run
    that died after its last checkpoint and redoes them) are dropped, so the file reads as one run; earlier rows are
    kept as written. A fresh run (start_step 0) starts an empty file. The file is cut where it is, never replaced by
    another (preflight made sure it is the job's own log: destinations.py)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if not start_step or not os.path.exists(path):
        return open(path, "w")
    with open(path, "rb") as f:
        lines = f.readlines()
    kept = [line for line in lines if line.endswith(b"\n") and _step_of(line) is not None
            and _step_of(line) <= start_step]  # (a row cut by the kill has no newline, or does not parse)
    if kept != lines:
        with open(path, "r+b") as f:
            f.writelines(kept)
            f.truncate()
    return open(path, "a")


def _step_of(line: bytes) -> int | None:
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row.get("step", 0) if isinstance(row, dict) else None
