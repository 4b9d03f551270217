"""The GPT's fwd+bwd time per step and saved-activation bytes at TP = 1, 2, 4, sequence parallelism off and on, side
by side with the same Hugging Face Llama under torch DTensor TP and, where installed, megatron-core's GPTModel.

    python -m bench.gpt [--iters 20] [--tp 1 2 4] [--hidden 256 --layers 2 ...] [--compile] [--out PATH]
    (--out default: a temp folder)

One LlamaForCausalLM (random weights, no download) is built on every rank and parallelized three ways:
  ours      models.GPT.from_hf(llama, sequence_parallel=sp); under SP the norm/bias grads are summed in one coalesced
            all-reduce after backward, inside the timed step (sequence_parallel_grad_sync=False)
  DTensor   parallelize_module with HF's base_model_tp_plan (ColwiseParallel/RowwiseParallel); SP as torch's TP tutorial
            does for Llama (HF is batch-first, so the sequence is dim 1): SequenceParallel norms, attention and MLP
            inputs gathered from Shard(1) once per module, o_proj/down_proj RowwiseParallel(output_layouts=Shard(1))
  megatron  megatron-core's GPTModel with the local layer spec (no Apex/TE), the Llama's weights copied in; a few
            CUDA-only spots patched for CPU (_megatron_on_cpu)
  compiled  (--compile) ours with each block torch.compile'd by inductor, as models.train --compile: "ours/compiled"
            is the eager step's time over the compiled one's (> 1: compiling pays)
The losses of all three are checked against the dense Llama once per row (printed). fp32, gloo, one thread per rank.

Time: each rank runs the models round-robin; a step (forward, mean cross-entropy, backward) is timed on rank 0 between
barriers; median of --iters after --warmup; ratios are medians of per-iteration ratios (steps taken back to back, so
load from other processes mostly cancels). Saved activations: bytes of the distinct storages autograd saves in one
forward and loss (torch.autograd.graph.saved_tensors_hooks; parameters excluded), on rank 0, by region: norm/dropout
(norms, dropout and the residual stream in the layers), attn/mlp, other (embedding, output layer, loss).
Targets at TP=2: ours <= 0.6x DTensor and <= 0.95x megatron-core; SP divides the norm/dropout region by ~tp.
"""
import argparse
import contextlib
import copy
import importlib.metadata
import importlib.util
import os
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from einops import rearrange

import models
import tp
from tp import testing

from .common import at_least, machine, median, print_table, round_robin_times, scratch_path, write_json

REGIONS = ("norm/dropout", "attn/mlp", "other")
# The transformer layers of the three implementations: their own code (residual adds, dropout) is residual stream.
LAYERS = ("models.block.TransformerBlock", "transformers.models.llama.modeling_llama.LlamaDecoderLayer",
          "megatron.core.transformer.transformer_layer.TransformerLayer")


def _region(module):
    """The region a module's saved tensors count in, or None to inherit its caller's."""
    name = type(module).__name__
    if "Norm" in name or "Dropout" in name or f"{type(module).__module__}.{name}" in LAYERS:
        return "norm/dropout"
    if "Attention" in name or "MLP" in name:
        return "attn/mlp"
    return None


def saved_activation_bytes(step, params):
    """{region: bytes} of the distinct storages autograd saves while step() runs (parameters excluded)."""
    from torch.distributed.tensor import DTensor

    def storage(t):
        return (t._local_tensor if isinstance(t, DTensor) else t).untyped_storage()

    seen = {storage(p).data_ptr() for p in params}
    stack, totals = ["other"], dict.fromkeys(REGIONS, 0)

    def enter(module, args):  # inside attention/MLP everything stays there (attention dropout is not SP's)
        stack.append(stack[-1] if stack[-1] == "attn/mlp" else _region(module) or stack[-1])

    def leave(module, args, output):
        stack.pop()

    def pack(t):
        s = storage(t)
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            totals[stack[-1]] += s.nbytes()
        return t

    hooks = [torch.nn.modules.module.register_module_forward_pre_hook(enter),
             torch.nn.modules.module.register_module_forward_hook(leave)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = step()
    finally:
        for hook in hooks:
            hook.remove()
    loss.backward()
    return totals


# ---- the three implementations ----------------------------------------------------------------------------------


def _llama(a):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn, num_hidden_layers=a.layers,
                         num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, max_position_embeddings=a.seq,
                         bos_token_id=0, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _dtensor(model, mesh, sequence_parallel):
    """HF's own plan through parallelize_module; with SP, the sequence (dim 1) sharded between the tp regions."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    base = model.base_model_prefix + "."
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {base + name: styles[style]() for name, style in model.config.base_model_tp_plan.items()}
    if sequence_parallel:
        seq, full, layer = Shard(1), Replicate(), base + "layers.*."
        gather = dict(input_layouts=(seq,), desired_input_layouts=(full,), use_local_output=True)
        plan |= {
            # the embedding stays whole (HF derives positions and the mask from its output); the first layer splits it
            base + "layers.0": PrepareModuleInput(input_layouts=(full,), desired_input_layouts=(seq,),
                                                  use_local_output=True),
            layer + "input_layernorm": SequenceParallel(), layer + "post_attention_layernorm": SequenceParallel(),
            layer + "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": seq},
                                                    desired_input_kwarg_layouts={"hidden_states": full},
                                                    use_local_output=True),
            layer + "self_attn.o_proj": RowwiseParallel(output_layouts=seq),
            layer + "mlp": PrepareModuleInput(**gather),
            layer + "mlp.down_proj": RowwiseParallel(output_layouts=seq),
            base + "norm": SequenceParallel(),
            "lm_head": PrepareModuleInput(**gather),
        }
    return parallelize_module(model, mesh.device_mesh["tp"], plan)


def _sp_torch_norm(cls, config, hidden_size, eps=1e-5, **unused):
    """megatron-core's torch-norm wrapper without its SP refusal: under SP the weight is tagged, as Apex/TE norms tag
    theirs, for the grad all-reduce megatron runs at the optimizer step (outside the timed fwd+bwd)."""
    norm = torch.nn.RMSNorm(hidden_size, eps=eps)
    norm.weight.sequence_parallel = config.sequence_parallel
    return norm


@contextlib.contextmanager
def _megatron_on_cpu():
    """megatron-core's CUDA-only spots pointed at the CPU: the current device (RoPE frequencies, the SP all-gather
    buffer), the CUDA RNG tracker (a CPU generator state; dropout is off) and the torch-norm wrapper under SP."""
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    patches = [(torch.cuda, "current_device", lambda: torch.device("cpu")),
               (mrandom, "_get_cuda_rng_state", lambda *args, **kwargs: torch.get_rng_state()),
               (mrandom, "_set_cuda_rng_state", lambda state, *args, **kwargs: torch.set_rng_state(state)),
               (WrappedTorchNorm, "__new__", _sp_torch_norm)]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, value in patches:
        setattr(obj, name, value)
    mrandom.get_cuda_rng_tracker().states_.setdefault("model-parallel-rng", torch.get_rng_state())
    try:
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)


def _megatron(hf, sequence_parallel):
    """megatron-core GPTModel of the Llama's shape holding this rank's slices of its weights."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    c, size = hf.config, parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    config = TransformerConfig(
        num_layers=c.num_hidden_layers, hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
        num_query_groups=c.num_key_value_heads, ffn_hidden_size=c.intermediate_size, gated_linear_unit=True,
        activation_func=F.silu, normalization="RMSNorm", layernorm_epsilon=c.rms_norm_eps, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True, params_dtype=torch.float32,
        tensor_model_parallel_size=size, sequence_parallel=sequence_parallel)
    model = GPTModel(config, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=c.vocab_size,
                     max_sequence_length=c.max_position_embeddings, position_embedding_type="rope",
                     rotary_base=int(c.rope_parameters["rope_theta"]), share_embeddings_and_output_weights=False)

    hf_weights = hf.state_dict()

    def shard(name, dim=0):
        return hf_weights[name].chunk(size, dim)[rank]

    state = {"embedding.word_embeddings.weight": shard("model.embed_tokens.weight"),
             "decoder.final_layernorm.weight": hf_weights["model.norm.weight"],
             "output_layer.weight": shard("lm_head.weight")}
    groups, d = c.num_key_value_heads, c.hidden_size // c.num_attention_heads
    for i in range(c.num_hidden_layers):
        ours, theirs = f"decoder.layers.{i}.", f"model.layers.{i}."
        q, k, v = (rearrange(hf_weights[f"{theirs}self_attn.{x}_proj.weight"], "(g n d) h -> g (n d) h", g=groups, d=d)
                   for x in "qkv")
        qkv = rearrange(torch.cat([q, k, v], dim=1), "g r h -> (g r) h")  # per kv group: its q heads, k, v
        state |= {
            f"{ours}input_layernorm.weight": hf_weights[f"{theirs}input_layernorm.weight"],
            f"{ours}self_attention.linear_qkv.weight": qkv.chunk(size)[rank],
            f"{ours}self_attention.linear_proj.weight": shard(f"{theirs}self_attn.o_proj.weight", 1),
            f"{ours}pre_mlp_layernorm.weight": hf_weights[f"{theirs}post_attention_layernorm.weight"],
            f"{ours}mlp.linear_fc1.weight": torch.cat([shard(f"{theirs}mlp.gate_proj.weight"),
                                                       shard(f"{theirs}mlp.up_proj.weight")]),
            f"{ours}mlp.linear_fc2.weight": shard(f"{theirs}mlp.down_proj.weight", 1),
        }
    model.load_state_dict(state)
    return model


# ---- one tp size on its ranks -------------------------------------------------------------------------------------


def bench_rank(a, use_megatron, compile_blocks=False):
    """On every rank of a tp group: per SP setting, rank 0's step times, saved bytes and losses of each model."""
    torch.set_num_threads(1)
    mesh = tp.init_mesh(tp=dist.get_world_size())
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, a.vocab, (a.batch, a.seq), generator=g) for _ in range(2))
    hf = _llama(a)

    def hf_loss(model):
        return F.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten())

    reference = hf_loss(hf).item()
    with contextlib.ExitStack() as stack:
        if use_megatron:
            warnings.filterwarnings("ignore", module=r"megatron\.")  # Apex/TE missing, CUDA-only advice
            warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated")
            from megatron.core import parallel_state

            stack.enter_context(_megatron_on_cpu())
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=mesh.tp_size)
            stack.callback(parallel_state.destroy_model_parallel)
            mask = torch.ones(a.seq, a.seq, dtype=torch.bool).triu(1)[None, None]  # True: masked
            positions = torch.arange(a.seq).expand(a.batch, -1)
        results = {}
        for sp in (False, True) if mesh.tp_size > 1 else (False,):
            # SP norm/bias grads: one coalesced all-reduce after backward, inside the timed step (DTensor and
            # megatron-core leave theirs partial until the optimizer step, outside it).
            ours = models.GPT.from_hf(hf, sequence_parallel=sp, sequence_parallel_grad_sync=False)
            dtensor = _dtensor(copy.deepcopy(hf), mesh, sp)
            steps = {"ours": (ours, lambda: ours(x, y)), "dtensor": (dtensor, lambda: hf_loss(dtensor))}
            if compile_blocks:  # models.train --compile: each block torch.compile'd (inductor), the rest eager
                compiled = models.GPT.from_hf(hf, sequence_parallel=sp, sequence_parallel_grad_sync=False)
                compiled.compile_blocks()
                steps["compiled"] = (compiled, lambda: compiled(x, y))
            if use_megatron:
                megatron = _megatron(hf, sp)
                steps["megatron"] = (megatron, lambda: megatron(x, positions, mask, labels=y).mean())
            losses = {name: step().item() for name, (_, step) in steps.items()}
            bad = {name: loss for name, loss in losses.items() if abs(loss - reference) > 1e-4}
            if bad:
                raise AssertionError(f"tp={mesh.tp_size} sp={sp}: losses {bad} differ from the dense Llama's "
                                     f"{reference}")
            saved = {name: saved_activation_bytes(step, list(model.parameters())) for name, (model, step) in
                     steps.items()}

            def fwd_bwd(model, step):
                step().backward()
                if model is ours or model is steps.get("compiled", (None,))[0]:
                    tp.allreduce_sequence_parallel_grads(model)
                model.zero_grad(set_to_none=True)

            times = round_robin_times({name: (lambda m=m, s=s: fwd_bwd(m, s)) for name, (m, s) in steps.items()},
                                      iters=a.iters, warmup=a.warmup, sync=dist.barrier, reduce=list)
            results[sp] = {"times": times, "saved": saved, "losses": losses, "reference": reference}
        return results


def _row(tp_size, sp, r):
    row = {"tp": tp_size, "sp": "on" if sp else "off",
           "loss_err": max(abs(loss - r["reference"]) for loss in r["losses"].values())}
    for name, seconds in r["times"].items():
        row |= {f"{name}_ms": 1e3 * median(seconds), f"{name}_mib": sum(r["saved"][name].values()) / 2**20,
                f"{name}_norm_mib": r["saved"][name]["norm/dropout"] / 2**20}
        if name != "ours":  # steps taken back to back: load from other processes mostly cancels in the ratio
            row[f"ours_vs_{name}"] = median([a / b for a, b in zip(r["times"]["ours"], seconds)])
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, default in (("iters", 20), ("warmup", 3), ("hidden", 256), ("ffn", 688), ("layers", 2), ("heads", 8),
                          ("kv-heads", 4), ("vocab", 2048), ("seq", 128), ("batch", 2)):
        p.add_argument(f"--{flag}", type=at_least(0 if flag == "warmup" else 1), default=default)
    p.add_argument("--tp", type=at_least(1), nargs="+", default=[1, 2, 4])
    p.add_argument("--no-megatron", action="store_true", help="leave megatron-core out even where it is installed")
    p.add_argument("--compile", action="store_true",
                   help="also ours with each block torch.compile'd (models.train --compile): 'compiled' columns, and "
                        "ours/compiled, the eager step over the compiled one")
    p.add_argument("--out", default=scratch_path("gpt.json"), help="JSON (bench/results/gpt.json: the committed one)")
    a = p.parse_args(argv)
    megatron = "not installed" if importlib.util.find_spec("megatron") is None else (
        "left out (--no-megatron)" if a.no_megatron else None)
    for tp_size in a.tp:  # what would fail inside the ranks: one usage error here
        try:
            models.GPTConfig(vocab_size=a.vocab, hidden_size=a.hidden, num_layers=a.layers, num_heads=a.heads,
                             num_kv_heads=a.kv_heads, ffn_hidden_size=a.ffn, max_seq_len=a.seq).check_tp(tp_size)
        except ValueError as e:
            p.error(str(e))
        if a.kv_heads % tp_size:
            p.error(f"DTensor TP (HF's plan shards k/v projections) needs --kv-heads {a.kv_heads} divisible by "
                    f"--tp {tp_size}")
        if megatron is None and a.vocab % tp_size:
            p.error(f"megatron-core needs --vocab {a.vocab} divisible by --tp {tp_size} (or --no-megatron)")
    rows, raw = [], {}
    for tp_size in a.tp:
        results = testing.run(bench_rank, world_size=tp_size, timeout=3600, a=a, use_megatron=megatron is None,
                              compile_blocks=a.compile)[0]
        for sp, r in results.items():
            rows.append(_row(tp_size, sp, r))
            raw[f"tp{tp_size}_sp{int(sp)}"] = r
    shape = (f"Llama hidden {a.hidden}, ffn {a.ffn}, {a.layers} layers, {a.heads} heads / {a.kv_heads} kv, vocab "
             f"{a.vocab}, batch {a.batch} x seq {a.seq}")
    names = [n for n in ("ours", "dtensor", "megatron", "compiled") if (n != "megatron" or megatron is None)
             and (n != "compiled" or a.compile)]
    headers = {"ours": "ours", "dtensor": "DTensor", "megatron": "megatron", "compiled": "compiled"}
    print(f"\nGPT fwd+bwd step, median of {a.iters}, {shape}, fp32, on {machine()}, gloo"
          + (f"\nmegatron-core: not available ({megatron})" if megatron else ""))
    times = print_table(rows, [("tp", "TP", "{}"), ("sp", "SP", "{}")]
                        + [(f"{n}_ms", f"{headers[n]} ms", "{:.1f}") for n in names]
                        + [(f"ours_vs_{n}", f"ours/{headers[n]}", "{:.2f}") for n in names[1:]]
                        + [("loss_err", "max loss err", "{:.1e}")])
    print("\nSaved activations per rank, MiB: all, and the norm/dropout region")
    saved = print_table(rows, [("tp", "TP", "{}"), ("sp", "SP", "{}")]
                        + [c for n in names for c in ((f"{n}_mib", f"{headers[n]} all", "{:.2f}"),
                                                       (f"{n}_norm_mib", f"{headers[n]} norm", "{:.2f}"))])
    write_json(a.out, {"machine": machine(), "load_average": os.getloadavg(), "shape": shape, "args": vars(a),
                       "megatron": megatron or _megatron_version(), "rows": rows, "raw": raw,
                       "table": times + "\n\n" + saved})


def _megatron_version():
    return f"megatron-core {importlib.metadata.version('megatron-core')}"


if __name__ == "__main__":
    main()
