"""One device, the whole training step (forward and backward over the micro-batches, gradient clipping, AdamW), of
any model shape (a preset of models.MODELS, with overrides): tokens/s, MFU (models/flops.py's 6N + attention over
the device's dense bf16 peak), peak memory, host syncs per step (CUDA: torch.cuda.set_sync_debug_mode counts every
synchronising call; elsewhere tp.host_syncs.count_host_syncs counts the reads a GPU would sync on) and a
torch.profiler breakdown of one step's time by category (GEMMs, attention, norms and other elementwise, loss,
optimizer, idle), per row: a kernels backend (torch, triton, auto), eager or compiled blocks.

    python -m bench.mfu --model llama3-8b --layers 16 --hidden 2048 ... --rows torch auto auto+compile [--search]

The model runs in the chosen dtype (bf16 on CUDA by default) with AdamW on its parameters (fused where torch has
the kernel: tp.optim.fast_adam); the tokens are random. On CPU the MFU is left out (no peak to divide by) unless
--peak-tflops is given.
--search first tries every recompute granularity × --search-batches micro-batch size on --search-row, briefly, the
planner's fastest predictions first, out-of-memory ones recorded and passed over, until --search-seconds are spent;
the rows then run at the fastest. Each row's step time is written beside the planner's prediction for the same
one-device plan on the device's profile (bench.plan.measured; `python -m bench.plan --check-mfu` reads the JSON).
"""
import argparse
import contextlib
import copy
import dataclasses
import gc
import json
import time
import warnings

import torch
from torch.profiler import record_function

import kernels
import tp
from models import GPT, GPTConfig
from models.flops import flops_per_token
from models.presets import MODELS
from models.recompute import GRANULARITIES
from tp.host_syncs import count_host_syncs

from .common import at_least, machine, median, print_table, scratch_path, write_json
from .gpu_sections import peak_flops
from .mfu_profile import BREAKDOWN, breakdown, sync
from .plan.measured import predict_step, predicted_rows, profile_for

ROW_KINDS = (*kernels.ops.BACKENDS, "auto")  # a row: a backend, then any of ROW_OPTIONS, e.g. "auto+compile+fp8"
ROW_OPTIONS = ("compile", "fp8")  # compiled blocks; the linears in float8 (kernels.fp8's tensorwise recipe)
FP8_ROW_RECIPE = "tensorwise"  # torchao's default for training
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
RECOMPUTE = tuple(GRANULARITIES)
SEARCH_BATCHES = (1, 2, 4, 8)  # --search's micro-batch sizes by default


def config_of(args) -> GPTConfig:
    """The preset with the shape flags given on top of it."""
    overrides = {"hidden_size": args.hidden, "num_layers": args.layers, "num_heads": args.heads,
                 "num_kv_heads": args.kv_heads, "ffn_hidden_size": args.ffn, "vocab_size": args.vocab}
    shape = MODELS[args.model] | {k: v for k, v in overrides.items() if v is not None}
    return GPTConfig(**shape).replace(max_seq_len=max(args.seq_len, shape.get("max_seq_len", 0)),
                                      recompute=args.recompute)


def train_step(model, optimizer, batches, clip):
    """Forward and backward over the micro-batches, the clipped global norm (left on the device: no host sync),
    AdamW; the gradients dropped."""
    for tokens, targets in batches:
        (model(tokens, targets) / len(batches)).backward()
    with record_function("optimizer: clip_grad_norm"):
        tp.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@contextlib.contextmanager
def counting_syncs(device):
    """A list that collects one entry per host synchronisation inside (CUDA's sync debug mode; elsewhere
    tp.host_syncs.count_host_syncs: every read of a tensor's values by the host, as a GPU would sync on it)."""
    if device.type != "cuda":
        with count_host_syncs(device) as seen:
            yield seen
        return
    seen = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield seen
        finally:
            torch.cuda.set_sync_debug_mode(0)
    seen.extend(w for w in caught if "synchroniz" in str(w.message))


def measure_row(row, base, *, device, batch, micro_batches, seq_len, steps, warmup, clip, profile_step, peak):
    """One row: the backend (compiled blocks with "+compile", the fp8 linears with "+fp8") on a copy of `base`."""
    backend, *options = row.split("+")
    if "fp8" in options:
        base = rebuilt(base, fp8_recipe=FP8_ROW_RECIPE)
    config = base.config
    model = copy.deepcopy(base).to(device)  # (from the CPU: the peak memory is this row's alone)
    if "compile" in options:
        model.compile_blocks()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, **tp.optim.fast_adam(model.parameters()))
    g = torch.Generator().manual_seed(1)
    batches = [tuple(t.to(device) for t in torch.randint(0, config.vocab_size, (2, batch, seq_len), generator=g))
               for _ in range(micro_batches)]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, syncs = [], []
    with kernels.use_backend(backend):
        def run_step():
            train_step(model, optimizer, batches, clip)
        for i in range(warmup + steps):
            sync(device)
            start = time.perf_counter()
            with counting_syncs(device) as seen:
                run_step()
            sync(device)
            if i >= warmup:
                times.append(time.perf_counter() - start)
                syncs.append(len(seen))
        step_s = median(times)
        parts = breakdown(run_step, device, step_s) if profile_step else None
    tokens = batch * micro_batches * seq_len
    rate = tokens / step_s
    return {"row": row, "recompute": config.recompute, "batch": batch, "step_s": round(step_s, 4),
            "tokens_per_s": round(rate, 1),
            "mfu": round(flops_per_token(config, seq_len) * rate / peak, 4) if peak else None,
            "peak_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
            "host_syncs": max(syncs), "breakdown": parts}


def measure(config: GPTConfig, rows, *, batch: int = 1, micro_batches: int = 1, seq_len: int, dtype: torch.dtype,
            device: torch.device, steps: int = 3, warmup: int = 1, clip: float = 1.0, profile: bool = True,
            peak: float | None = None) -> list[dict]:
    """One dict per row (see measure_row), on a one-rank mesh (tp.init_mesh, destroyed after)."""
    with one_rank():
        base = base_model(config, dtype)
        return [measure_row(row, base, device=device, batch=batch, micro_batches=micro_batches, seq_len=seq_len,
                            steps=steps, warmup=warmup, clip=clip, profile_step=profile, peak=peak) for row in rows]


@contextlib.contextmanager
def one_rank():
    """A one-rank mesh (tp.init_mesh) over a one-process gloo group unless one is up; both torn down after."""
    own = not torch.distributed.is_initialized()
    if own:
        torch.distributed.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    tp.init_mesh()
    try:
        yield
    finally:
        tp.destroy_mesh()
        if own:
            torch.distributed.destroy_process_group()


def base_model(config: GPTConfig, dtype: torch.dtype) -> GPT:
    """The model every row copies, seeded, on the CPU (built once: a large model's init takes seconds)."""
    torch.manual_seed(0)
    return GPT(config).to(dtype=dtype)


def rebuilt(base: GPT, **changes) -> GPT:
    """`base` with other config fields (runtime ones: recompute, fp8_recipe), built on the meta device (no init),
    holding base's tensors."""
    if all(getattr(base.config, name) == value for name, value in changes.items()):
        return base
    with torch.device("meta"):
        model = GPT(base.config.replace(**changes))
    model.load_state_dict(base.state_dict(), assign=True)
    return model


def search_order(config: GPTConfig, *, batches, micro_batches: int, seq_len: int, device_name: str, dtype: str,
                 threads: int) -> list[dict]:
    """The candidates (recompute × micro-batch size), most likely fastest first: by the planner's predicted tokens/s
    on the device's profile, those it predicts to fit first; with no profile, less recompute and larger batches
    first."""
    try:
        cluster, software = profile_for(device_name, threads=threads, dtype=dtype)
    except ValueError:
        cluster = None
    out = []
    for recompute in RECOMPUTE:
        for batch in batches:
            one = {"recompute": recompute, "batch": batch}
            if cluster is not None:
                got = predict_step(config, batch=batch, micro_batches=micro_batches, seq_len=seq_len,
                                   recompute=recompute, cluster=cluster, software=software)
                one.update(predicted_step_s=got["step_s"], predicted_tokens_per_s=got["tokens_per_s"],
                           predicted_fits=got["fits"])
            out.append(one)
    if cluster is None:
        return sorted(out, key=lambda c: (RECOMPUTE.index(c["recompute"]), -c["batch"]))
    return sorted(out, key=lambda c: (not c["predicted_fits"], -c["predicted_tokens_per_s"]))


def search(base: GPT, row: str, candidates: list[dict], *, seconds: float, device, micro_batches: int, seq_len: int,
           steps: int, warmup: int, clip: float, peak) -> list[dict]:
    """Each candidate measured briefly on `row` in order (no profiled step) until `seconds` have passed (the first
    always runs): its status ("measured", "out of memory", "skipped (time)") and, measured, its row's figures and
    predicted / measured step time."""
    start, out = time.perf_counter(), []
    for candidate in candidates:
        if out and time.perf_counter() - start > seconds:
            out.append({"row": row, **candidate, "status": "skipped (time)"})
            continue
        try:
            got = measure_row(row, rebuilt(base, recompute=candidate["recompute"]), device=device,
                              batch=candidate["batch"], micro_batches=micro_batches, seq_len=seq_len, steps=steps,
                              warmup=warmup, clip=clip, profile_step=False, peak=peak)
            got = {**candidate, **got, "status": "measured"}
            if "predicted_step_s" in candidate:
                got["ratio"] = float(f"{candidate['predicted_step_s'] / got['step_s']:.4g}")
        except torch.OutOfMemoryError:
            got = {"row": row, **candidate, "status": "out of memory"}
        out.append({k: v for k, v in got.items() if k != "breakdown"})
        gc.collect()  # (a failed candidate's tensors go with its frames)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def best_of(candidates: list[dict]) -> dict:
    """The measured candidate with the most tokens/s; ValueError when none ran."""
    measured = [c for c in candidates if c["status"] == "measured"]
    if not measured:
        raise ValueError(f"--search: no candidate ran ({', '.join(c['status'] for c in candidates)})")
    return max(measured, key=lambda c: c["tokens_per_s"])


def _row(text):
    backend, *options = text.split("+")
    if backend not in ROW_KINDS or any(o not in ROW_OPTIONS for o in options) or len(set(options)) < len(options):
        raise argparse.ArgumentTypeError(f"{text!r}: a row is one of {ROW_KINDS}, then any of "
                                         f"{', '.join('+' + o for o in ROW_OPTIONS)}")
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=tuple(MODELS), default="tiny", help="the shape to start from")
    for flag in ("hidden", "layers", "heads", "kv-heads", "ffn", "vocab"):
        p.add_argument(f"--{flag}", type=at_least(1), help=f"override the preset's {flag}")
    p.add_argument("--seq-len", type=at_least(1), default=128)
    p.add_argument("--batch", type=at_least(1), default=1, help="sequences per micro-batch")
    p.add_argument("--micro-batches", type=at_least(1), default=1, help="micro-batches per step (accumulated)")
    p.add_argument("--dtype", choices=tuple(DTYPES), help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--rows", type=_row, nargs="+", default=["torch", "auto"],
                   help=f"what to measure: {', '.join(ROW_KINDS)}, each optionally +compile (compiled blocks) "
                        f"and/or +fp8 (the linears in float8, {FP8_ROW_RECIPE})")
    p.add_argument("--steps", type=at_least(1), default=3, help="timed steps per row (the median is reported)")
    p.add_argument("--warmup", type=at_least(0), default=1)
    p.add_argument("--no-profile", action="store_true", help="skip the profiled step (no time breakdown)")
    p.add_argument("--peak-tflops", type=float, help="the device's peak for MFU (default: its dense bf16 datasheet "
                                                     "figure on H100/H200/A100, none on CPU)")
    p.add_argument("--recompute", choices=RECOMPUTE, default="none", help="activation recomputation (models.recompute)")
    p.add_argument("--search", action="store_true", help="first try each --recompute × --search-batches on "
                                                         "--search-row; the rows run at the fastest")
    p.add_argument("--search-batches", type=at_least(1), nargs="+", default=list(SEARCH_BATCHES),
                   help="the micro-batch sizes --search tries")
    p.add_argument("--search-seconds", type=float, default=60.0,
                   help="--search starts no candidate after this many seconds (the rest: skipped)")
    p.add_argument("--search-row", type=_row, default="auto", help="the row --search measures (eager is quicker)")
    p.add_argument("--out", default=scratch_path("mfu.json"), help="JSON output")
    return p


def run_search(args, base: GPT, *, device, dtype: str, peak) -> dict:
    """--search: the candidates in the order tried, each's outcome, and the fastest."""
    candidates = search_order(base.config, batches=args.search_batches, micro_batches=args.micro_batches,
                              seq_len=args.seq_len, device_name=machine(), dtype=dtype,
                              threads=torch.get_num_threads())
    tried = search(base, args.search_row, candidates, seconds=args.search_seconds, device=device,
                   micro_batches=args.micro_batches, seq_len=args.seq_len, steps=min(args.steps, 2),
                   warmup=1, clip=1.0, peak=peak)
    return {"row": args.search_row, "seconds": args.search_seconds, "candidates": tried, "best": best_of(tried)}


def with_predictions(payload: dict) -> dict:
    """Each row with the planner's step time for its one-device plan and predicted / measured (an "error" where the
    device has no profile)."""
    try:
        predicted = predicted_rows(payload | {"rows": [r for r in payload["rows"] if "error" not in r]},
                                   candidates=False)
    except ValueError as e:
        predicted = [{"error": str(e)}] * len(payload["rows"])
    for row, got in zip([r for r in payload["rows"] if "error" not in r], predicted):
        row["predicted"] = got if "error" in got else {"profile": got["profile"], "step_s": got["predicted_step_s"],
                                                       "ratio": float(f"{got['ratio']:.4g}")}
    return payload


def report(payload: dict) -> None:
    """The shape line, the rows' table, the search's candidates."""
    print(f"{payload['machine']}: {payload['shape']}")
    flat = [{**r, **{f"{k}_s": v for k, v in (r.get("breakdown") or {}).items()},
             "ratio": r.get("predicted", {}).get("ratio")} for r in payload["rows"]]
    print_table(flat, [("row", "row", "{}"), ("tokens_per_s", "tokens/s", "{:.0f}"), ("mfu", "MFU", "{:.3f}"),
                       ("peak_gib", "peak GiB", "{:.2f}"), ("host_syncs", "syncs", "{}"),
                       *((f"{k}_s", k, "{:.4f}") for k in BREAKDOWN), ("ratio", "planner/measured", "{:.3g}")])
    if "search" in payload:
        print(f"--search on {payload['search']['row']} (fastest first by the planner; the rows ran at the best):")
        print_table(payload["search"]["candidates"], SEARCH_TABLE)


SEARCH_TABLE = [("recompute", "recompute", "{}"), ("batch", "batch", "{}"), ("status", "status", "{}"),
                ("tokens_per_s", "tokens/s", "{:.0f}"), ("peak_gib", "peak GiB", "{:.2f}"),
                ("predicted_step_s", "predicted s", "{:.4g}"), ("step_s", "measured s", "{:.4g}"),
                ("ratio", "predicted/measured", "{:.3g}")]


def main(argv: list[str] | None = None) -> list[dict]:
    args = build_parser().parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    config = config_of(args)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else peak_flops()
    found, batch = None, args.batch
    with one_rank():
        base = base_model(config, DTYPES[dtype])
        if args.search:
            found = run_search(args, base, device=device, dtype=dtype, peak=peak)
            base, batch = rebuilt(base, recompute=found["best"]["recompute"]), found["best"]["batch"]
        shape = (f"h{config.hidden_size} L{config.num_layers} heads {config.num_heads}/{config.num_kv_heads} "
                 f"ffn {config.ffn_hidden_size} V{config.vocab_size} b{batch}x{args.micro_batches} s{args.seq_len} "
                 f"{dtype} recompute {base.config.recompute}")
        payload = {"machine": machine(), "shape": shape, "config": dataclasses.asdict(config), "seq_len": args.seq_len,
                   "micro_batches": args.micro_batches, "dtype": dtype, "threads": torch.get_num_threads(),
                   "rows": [], **({"search": found} if found else {})}
        for row in args.rows:
            try:
                result = measure_row(row, base, device=device, batch=batch, micro_batches=args.micro_batches,
                                     seq_len=args.seq_len, steps=args.steps, warmup=args.warmup, clip=1.0,
                                     profile_step=not args.no_profile, peak=peak)
            except Exception as e:  # (a compile error, out of memory): that row's result, the next rows still run
                result = {"row": row, "error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
            print(f"{row}: " + (result.get("error") or f"{result['tokens_per_s']:.0f} tokens/s, MFU {result['mfu']}"),
                  flush=True)
            payload["rows"].append(result)
            write_json(args.out, payload)  # after every row: a run cut short keeps the rows it measured
    report(with_predictions(payload))
    write_json(args.out, payload)
    rows = payload["rows"]
    return rows


# Llama-3.2-1B's shape (its config.json on the Hugging Face hub: hidden 2048, 16 layers, 32 heads / 8 kv heads, ffn
# 8192, vocab 128256), trained at 4096 tokens a sequence
LLAMA_1B = dict(hidden="2048", layers="16", heads="32", kv_heads="8", ffn="8192", vocab="128256")


def gpu_check_section(on_gpu: bool, out) -> dict:
    """bench.mfu's rows at the best recompute and micro-batch size --search finds on "torch" eager (30 s on the GPU):
    the whole training step of the 1B shape in bf16 on the torch backend, on "auto" (the fused kernels), "auto"
    with compiled blocks and that with fp8 linears (last: the costliest to compile), each beside the planner's
    prediction; the CPU smoke: the tiny preset, eager rows only, a 20 s search on torch."""
    if on_gpu:
        shape = [f"--{k.replace('_', '-')}={v}" for k, v in LLAMA_1B.items()]
        flags = ["--model", "llama3-8b", *shape, "--seq-len", "4096", "--steps", "4", "--warmup", "2", "--rows",
                 "torch", "auto", "auto+compile", "auto+compile+fp8", "--search", "--search-seconds", "30",
                 "--search-row", "torch"]  # (compiled blocks run torch's ops; "auto" eager is host-bound: run 3)
    else:
        flags = ["--model", "tiny", "--layers", "2", "--seq-len", "16", "--steps", "1", "--warmup", "0", "--rows",
                 "torch", "auto", "--search", "--search-row", "torch", "--search-batches", "1", "2",
                 "--search-seconds", "20"]  # (the search on torch: "auto" runs Triton's interpreter here)
    main([*flags, "--out", str(out / "mfu.json")])
    with open(out / "mfu.json") as f:
        payload = json.load(f)
    rows = payload["rows"]
    details = {r["row"]: {k: v for k, v in r.items() if k != "row"} for r in rows}
    best = payload["search"]["best"]
    details["search"] = {"best": f"recompute {best['recompute']} batch {best['batch']}",
                         "tried": [f"{c['recompute']} b{c['batch']}: {c['status']}"
                                   + (f" {c['tokens_per_s']:.0f} tokens/s" if "tokens_per_s" in c else "")
                                   for c in payload["search"]["candidates"]]}
    if not on_gpu:
        details["compiled"] = "skipped (no CUDA)"
    return {**details, "ok": all(r.get("tokens_per_s", 0) > 0 for r in rows)}


if __name__ == "__main__":
    main()
