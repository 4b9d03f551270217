"""A Hugging Face Llama, fwd+bwd wall time per training step at TP = 1, 2, 4 on gloo CPU ranks, parallelized three
ways, next to the dense model on every rank:
  ours      tp.parallelize(model)
  DTensor   torch's parallelize_module with the model's base_model_tp_plan as ColwiseParallel/RowwiseParallel
  HF        transformers' own apply_tensor_parallelism with the same plan (what from_pretrained(tp_plan=...) runs)
and, with the output layer vocab-parallel too (each library's vocab-parallel cross-entropy on the local logits):
  ours vp   tp.parallelize(model, {**tp.default_plan(model), "lm_head": "colwise"}): HF's loss call runs
            tp.vocab_parallel_cross_entropy
  DTensor vp  lm_head ColwiseParallel(output_layouts=Shard(-1), use_local_output=False), the step under
            torch's loss_parallel()

    python -m bench.parallelize [--iters 20] [--out PATH]     # JSON to a scratch path unless --out says otherwise

All parallel models follow the same plan (attention and MLP linears sharded, embedding and lm_head whole; the vp
models shard lm_head too) and start from the same weights. Each rank runs the models round-robin in one loop (so
machine noise hits all alike); a step (forward with labels, HF's loss, backward) is timed on rank 0 between
barriers. Times are medians; ratios are medians of per-iteration ratios (steps taken back to back, so load from
other processes mostly cancels). Target: ours/DTensor <= 0.6 at TP = 2.
"""
import contextlib
import copy
import functools

import torch
import torch.distributed as dist

import tp
from tp import default_plan, testing
from tp.parallelize import parallelize

from .common import machine, median, parser, print_table, round_robin_times, write_json

# hidden, ffn, heads, kv heads, layers, batch, sequence: overhead-bound (per-op dispatch outweighs the GEMMs), larger
SHAPES = [(128, 344, 4, 4, 2, 1, 128), (256, 688, 8, 4, 2, 4, 128), (512, 1376, 8, 4, 2, 4, 128)]
VOCAB = 1024


def _llama(hidden, ffn, heads, kv_heads, layers):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=hidden, intermediate_size=ffn, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, num_hidden_layers=layers, vocab_size=VOCAB,
                         max_position_embeddings=512, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _dtensor(model, mesh, vocab_parallel=False):
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {pattern: styles[style]() for pattern, style in default_plan(model).items()}
    if vocab_parallel:  # logits stay a DTensor sharded over the vocabulary, for loss_parallel()
        plan["lm_head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    return parallelize_module(model, mesh.device_mesh["tp"], plan)


def _hf(model, mesh):
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    plan = default_plan(model)
    if hasattr(model, "_expand_parallel_plan"):  # transformers 5.24: the plan is an argument, wildcards expanded
        return apply_tensor_parallelism(model, mesh.device_mesh["tp"], model._expand_parallel_plan(plan))
    model.tp_plan = plan  # transformers 5.17: the model's own plan, wildcards as they are
    return apply_tensor_parallelism(model, mesh.device_mesh["tp"])


def bench_rank(shape, iters, warmup):
    """On every rank of a tp group: rank 0's step times of each model, iteration by iteration."""
    torch.set_num_threads(1)
    mesh = tp.init_mesh(tp=dist.get_world_size())
    hidden, ffn, heads, kv_heads, layers, batch, seq = shape
    from torch.distributed.tensor.parallel import loss_parallel

    dense = _llama(hidden, ffn, heads, kv_heads, layers)
    vocab_parallel_plan = {**default_plan(dense), "lm_head": "colwise"}
    models = {"ours": parallelize(copy.deepcopy(dense)), "dtensor": _dtensor(copy.deepcopy(dense), mesh),
              "hf": _hf(copy.deepcopy(dense), mesh), "dense": dense,
              "ours_vp": parallelize(copy.deepcopy(dense), vocab_parallel_plan),
              "dtensor_vp": _dtensor(copy.deepcopy(dense), mesh, vocab_parallel=True)}
    ids = torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))

    def step(name, backward=True):
        with loss_parallel() if name == "dtensor_vp" else contextlib.nullcontext():
            loss = models[name](ids, labels=ids).loss
            if backward:
                loss.backward()
                models[name].zero_grad(set_to_none=True)
        return loss

    with torch.no_grad():
        losses = {name: step(name, backward=False) for name in models}
    losses = {name: getattr(loss, "full_tensor", lambda: loss)().item() for name, loss in losses.items()}
    assert max(losses.values()) - min(losses.values()) < 1e-4, losses  # the same model six ways
    return round_robin_times({name: functools.partial(step, name) for name in models}, iters=iters, warmup=warmup,
                             sync=dist.barrier, reduce=list)


def _shape(text):
    import argparse

    fields = text.split(":")
    if len(fields) != 7 or not all(f.isdigit() and int(f) > 0 for f in fields):
        raise argparse.ArgumentTypeError(f"needs 7 positive integers hidden:ffn:heads:kv_heads:layers:batch:seq, "
                                         f"got {text!r}")
    return tuple(map(int, fields))


def main(argv=None):
    p = parser(__doc__, "parallelize", iters=20, warmup=3)
    p.add_argument("--shapes", nargs="+", type=_shape,
                   default=SHAPES, help="hidden:ffn:heads:kv_heads:layers:batch:seq each (default: "
                   + " ".join(":".join(map(str, shape)) for shape in SHAPES) + ")")
    args = p.parse_args(argv)
    for hidden, _ffn, heads, kv_heads, *_ in args.shapes:
        for tp_size in args.tp:
            if heads % tp_size or kv_heads % tp_size or hidden % heads or kv_heads > heads:
                p.error(f"shape hidden {hidden}, heads {heads}/{kv_heads} cannot be split over --tp {tp_size} (heads "
                        "and kv heads divisible by tp, hidden by heads)")
    rows = []
    for shape in args.shapes:
        for tp_size in args.tp:
            times = testing.run(bench_rank, world_size=tp_size, timeout=1800, shape=shape, iters=args.iters,
                                warmup=args.warmup)[0]
            hidden, ffn, heads, kv_heads, layers, batch, seq = shape
            row = {"hidden": hidden, "ffn": ffn, "heads": f"{heads}/{kv_heads}", "layers": layers,
                   "tokens": f"{batch}x{seq}", "tp": tp_size}
            row |= {f"{name}_ms": 1e3 * median(ts) for name, ts in times.items()}
            # Ratios of steps taken back to back (median over iterations): load from other processes cancels.
            row |= {f"ours_vs_{name}": median([a / b for a, b in zip(times["ours"], times[name])])
                    for name in ("dtensor", "hf", "dense")}
            row["ours_vp_vs_dtensor_vp"] = median([a / b for a, b in zip(times["ours_vp"], times["dtensor_vp"])])
            rows.append(row)
    testing.shutdown()
    print(f"\nHF Llama (vocab {VOCAB}) fwd+bwd step, median of {args.iters}, on {machine()}, gloo")
    table = print_table(rows, [
        ("hidden", "hidden", "{}"), ("ffn", "ffn", "{}"), ("heads", "heads/kv", "{}"), ("layers", "layers", "{}"),
        ("tokens", "tokens", "{}"), ("tp", "TP", "{}"), ("ours_ms", "tp.parallelize ms", "{:.1f}"),
        ("dtensor_ms", "DTensor ms", "{:.1f}"), ("hf_ms", "HF tp_plan ms", "{:.1f}"),
        ("dense_ms", "dense ms", "{:.1f}"),
        ("ours_vs_dtensor", "ours/DTensor", "{:.2f}"), ("ours_vs_hf", "ours/HF", "{:.2f}"),
        ("ours_vs_dense", "ours/dense", "{:.2f}"),
    ])
    print("\nThe same with the output layer vocab-parallel and each library's vocab-parallel loss")
    table += "\n\n" + print_table(rows, [
        ("hidden", "hidden", "{}"), ("tokens", "tokens", "{}"), ("tp", "TP", "{}"),
        ("ours_vp_ms", "tp.parallelize vp ms", "{:.1f}"), ("dtensor_vp_ms", "DTensor loss_parallel ms", "{:.1f}"),
        ("ours_vp_vs_dtensor_vp", "ours/DTensor", "{:.2f}"),
    ])
    write_json(args.out, {"machine": machine(), "iters": args.iters, "rows": rows, "table": table})


if __name__ == "__main__":
    main()
