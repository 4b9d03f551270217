"""The measured choice of backend "auto" on CUDA: per call shape, the fastest module implementing the primitives.

Per key (primitive, dtype, activation, bias, main_grad accumulation, token bucket, N, K, device name; for the
experts' grouped GEMM also the number of groups) the first use times every candidate (ops.BACKENDS: the Triton
kernels, cuBLAS with torch's epilogue, cuBLAS with Triton's elementwise passes; kernels.grouped's two
implementations) on operands of that shape with CUDA events, in alternating rounds (ROUNDS), keeps the fastest and
caches it: in memory, and on disk in one JSON file per (device name, torch and triton versions), as Triton's
autotune cache does, so a second run pays nothing. The directory is $TP_KERNELS_CACHE_DIR, else
~/.cache/tp-layers; a corrupt or unwritable file is ignored with one warning.

kernels.tune_linear runs every primitive of a layer before the pipeline runner's first schedule, so the measuring
happens there. A key first met later (a new token bucket) is measured at that call: every tensor-parallel rank sees
the same shapes, so all ranks measure at the same point of the step rather than one stalling its peers.
"""
import functools
import hashlib
import json
import os
import statistics
import warnings
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import NamedTuple

import torch

OPS = ("forward", "dgrad", "wgrad")
GROUPED_OPS = ("grouped_forward", "grouped_dgrad", "grouped_wgrad")  # kernels.grouped's primitives
WARMUP, REPS = 2, 5  # launches before timing (the first compiles and autotunes), then timed launches (median)
ROUNDS = 3  # each candidate timed once per round, the order reversed every other round; its median round kept


class Key(NamedTuple):
    op: str                 # one of OPS or GROUPED_OPS
    dtype: str              # "bfloat16", ...
    activation: str | None  # forward and dgrad only
    bias: bool              # forward only
    main_grad: bool         # wgrad only: accumulated into an fp32 main_grad
    tokens: int             # token_bucket of the rows
    N: int                  # the weight's rows
    K: int                  # the weight's columns (in-features)
    device: str             # device_name
    kernels: str            # the Triton candidate's kernels for these tensors (its kernel_family(x)): "sm90-tma"...
    groups: int = 0         # grouped GEMMs: the weight's groups (experts), their rows split evenly when measured


def token_bucket(tokens: int) -> int:
    """The autotune key's token count: the next power of two (at least 64). Tuning once per bucket, not per count,
    spares variable batches and generation a 5-7 config re-tune at every new length; a tile choice tuned for 2^k
    tokens suits 2^(k-1)..2^k of them."""
    return max(64, 1 << max(0, tokens - 1).bit_length())


def measurable(x: torch.Tensor) -> bool:
    """Whether "auto" measures its choice for tensors like x: CUDA tensors only (the tests swap this predicate)."""
    return x.is_cuda


@functools.cache
def device_name(device: torch.device) -> str:
    """The key's device: the GPU's model name ("NVIDIA H200"), else the device type (the tests' "cpu")."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def library_versions() -> dict[str, str | None]:
    """The versions a cached choice is valid for: a new torch (cuBLAS) or triton re-measures."""
    try:
        triton = metadata.version("triton")
    except metadata.PackageNotFoundError:
        triton = None
    return {"torch_version": torch.__version__, "triton_version": triton}


def make_key(op: str, x: torch.Tensor, N: int, K: int, *, activation: str | None = None, bias: bool = False,
             main_grad: bool = False, kernels: str = "", groups: int = 0) -> Key:
    """The key of one primitive call on x's rows (x, grad_out or dz) with a weight [N, K] (grouped: [groups, N, K]);
    `kernels` names which Triton kernels the candidate would run (a choice timed against Hopper's TMA kernels is not
    the sm80 ones')."""
    return Key(op, str(x.dtype).removeprefix("torch."), activation, bias, main_grad, token_bucket(x.shape[0]), N, K,
               device_name(x.device), kernels, groups)


def time_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Median milliseconds of fn() over REPS launches after WARMUP, by CUDA events (the tests swap this timer)."""
    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(REPS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _call(key: Key, device: torch.device) -> Callable[[object], object]:
    """module -> one run of the key's primitive on that module, on operands of the key's shape."""
    dtype = getattr(torch, key.dtype)
    make = functools.partial(torch.randn, device=device, dtype=dtype)  # (zeros would flatter the power draw)
    weight, tokens = make(key.N, key.K), key.tokens
    if key.op == "forward":
        x, bias = make(tokens, key.K), make(key.N) if key.bias else None
        return lambda module: module.linear_forward(x, weight, bias, key.activation)
    if key.op == "dgrad":
        grad_out = make(tokens, key.N // 2 if key.activation == "swiglu" else key.N)
        preact = None if key.activation is None else make(tokens, key.N)
        return lambda module: module.linear_dgrad(grad_out, weight, preact, key.activation)
    dz, x = make(tokens, key.N), make(tokens, key.K)
    grad_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    main_grad = torch.zeros(key.N, key.K, device=device, dtype=grad_dtype) if key.main_grad else None
    return lambda module: module.linear_wgrad(dz, x, main_grad=main_grad)


_table: dict[Key, dict] = {}  # every key measured or read from disk in this process -> its row (see choices)
_read: set[Path] = set()      # the cache files already read into _table
_warned: set[Path] = set()


def _identity(device: str) -> dict:
    return {"device": device, **library_versions()}


def cache_path(device: str) -> Path:
    """The JSON file holding the choices for this device name and the installed torch and triton."""
    root = Path(os.environ.get("TP_KERNELS_CACHE_DIR") or Path.home() / ".cache" / "tp-layers")
    digest = hashlib.sha256(json.dumps(_identity(device), sort_keys=True).encode()).hexdigest()[:16]
    return root / f"kernel-choices-{digest}.json"


def _warn_once(path: Path, message: str) -> None:
    if path not in _warned:
        _warned.add(path)
        warnings.warn(f"kernels: auto-choice cache {path}: {message}", stacklevel=2)


def _load(path: Path, device: str) -> dict[Key, dict]:
    """The rows of the cache file (none if absent; a file for another device or versions is never used)."""
    try:
        data = json.loads(path.read_text())
        if any(data[name] != value for name, value in _identity(device).items()):
            raise ValueError("written for another device or library version")
        defaults = Key._field_defaults  # (a field added since the file was written: its default)
        return {Key(**{f: row[f] if f in row or f not in defaults else defaults[f] for f in Key._fields}): row
                for row in data["choices"]}
    except (FileNotFoundError, NotADirectoryError):  # nothing cached yet (an unusable directory warns at the write)
        return {}
    except (OSError, ValueError, KeyError, TypeError) as e:  # (json.JSONDecodeError is a ValueError)
        _warn_once(path, f"ignored ({e}); measuring again")
        return {}


def _save(path: Path, device: str) -> None:
    rows = [row for key, row in _table.items() if key.device == device]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # ranks of one node write at the same time
        scratch.write_text(json.dumps({**_identity(device), "choices": rows}, indent=1))
        os.replace(scratch, path)
    except OSError as e:
        _warn_once(path, f"not written ({e}); the choices stay in memory")


def lookup(key: Key) -> dict | None:
    """The cached row of key (the disk cache is read once per process), or None."""
    row = _table.get(key)
    if row is not None:  # (every call of a tuned step: one dict lookup, no path hashing the library versions)
        return row
    path = cache_path(key.device)
    if path not in _read:
        _read.add(path)
        _table.update(_load(path, key.device))
    return _table.get(key)


def choose(key: Key, candidates: dict[str, object], device: torch.device,
           call: Callable[[Key, torch.device], Callable[[object], object]] | None = None) -> str:
    """The name of the fastest candidate for key: cached, else measured now and cached. `call(key, device)` gives
    the candidate -> one run on operands of the key's shape (default: the linear primitives' on a module)."""
    row = lookup(key)
    if row is None or row["choice"] not in candidates:
        run = (call or _call)(key, device)
        with torch.no_grad():
            times = _rounds({name: functools.partial(run, module) for name, module in candidates.items()}, device)
        row = {**key._asdict(), **{f"{name}_ms": ms for name, ms in times.items()},
               "choice": min(times, key=times.get)}
        _table[key] = row
        _save(cache_path(key.device), key.device)
    return row["choice"]


def _rounds(runs: dict[str, Callable[[], object]], device: torch.device) -> dict[str, float]:
    """Each candidate's median over ROUNDS rounds of time_ms, the rounds alternating the order: a GPU whose clocks
    ramp or drift while it measures (cuBLAS's square GEMM moved 13 % between two measurements on an H200) slows
    every candidate alike rather than the one measured first."""
    names, rounds = list(runs), {name: [] for name in runs}
    for r in range(ROUNDS):
        for name in names if r % 2 == 0 else reversed(names):
            rounds[name].append(time_ms(runs[name], device))
    return {name: statistics.median(ms) for name, ms in rounds.items()}


def choices() -> list[dict]:
    """The table of auto's choices this process knows (measured, or read from the disk cache): one dict per key
    with the Key fields, `<candidate>_ms` per candidate (median milliseconds) and `choice`."""
    return [dict(row) for row in _table.values()]


def clear() -> None:
    """Forget the in-memory table (the disk cache stays, and is read again at the next use)."""
    _table.clear()
    _read.clear()
