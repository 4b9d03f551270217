"""`tp.parallelize`: put the package's layers into an existing model, in place, following a plan.

    tp.init_mesh(tp=2)
    model = AutoModelForCausalLM.from_pretrained(name)   # the same weights on every rank
    tp.parallelize(model)                                 # the family's plan: attention and MLP linears sharded
    print(tp.describe(model))
    ...                                                   # train
    model.save_pretrained(path)                           # every tp rank calls it: gathered, tp rank 0 writes

A plan maps module-name patterns (`*` matches within one dotted component, as in torch's parallelize_module) to
styles:
  colwise                  nn.Linear / HF Conv1D -> ColumnParallelLinear; output [..., out/tp] (local heads)
  colwise_gather_output    -> ColumnParallelLinear(gather_output=True); output [..., out]
  rowwise                  -> RowParallelLinear; input [..., in/tp], output all-reduced
  rowwise_split_input      -> RowParallelLinear(input_is_parallel=False); input [..., in], split here
  vocab                    nn.Embedding -> VocabParallelEmbedding
  replicated_with_grad_allreduce   parameters stay whole, their grads are summed over tp inside backward (norms
                           that see only this rank's heads: Qwen3's q_norm/k_norm)
  replicated_with_tail_grad_allreduce   the layer stays whole; in backward the gradient of its output's last
                           features (config.qk_rope_head_dim: MLA's RoPE key, which every head reads, so each rank's
                           gradient holds its heads' share) is summed over tp; the features before them feed a
                           colwise layer (through a norm), whose input gradient arrives summed already
  replicate                left as it is
  moe_experts              HF's fused experts module (mlp.experts) -> tp.moe.ParallelExperts: its experts split over
                           the mesh's ep (and their FFN over etp), each tp rank dispatching 1/tp of the tokens
HF's names embedding_rowwise, colwise_rep, rowwise_rep and mla_kv_a_proj (DeepSeek-V2's kv down-projection) read as
vocab, colwise_gather_output, rowwise_split_input, replicated_with_tail_grad_allreduce;
moe_tp_experts and ep_dispatch_experts (its tp and ep plans) as moe_experts. Entries naming the experts' parameters
(HF's packed_colwise / grouped_gemm / rowwise on mlp.experts.gate_up_proj, down_proj) are what moe_experts does.

Every check runs before the first module is replaced, so a plan that cannot be right raises ValueError on every rank
(all ranks hold the same model and plan) and leaves the model as it was.
"""
import fnmatch
import functools
import types
import warnings

import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import hf
from .cross_entropy import vocab_parallel_cross_entropy
from .embedding import VocabParallelEmbedding
from .layers import ColumnParallelLinear, RowParallelLinear
from .mesh import resolve_group
from .moe import ParallelExperts
from .parallelize_hooks import HeadsRngFork, SharedInputCopy, TailGradSum, sum_grads_in_backward
from .state_dict import fsdp_sharded, full_state_dict

GATHER_OUTPUT = {"colwise": False, "colwise_gather_output": True}
INPUT_IS_PARALLEL = {"rowwise": True, "rowwise_split_input": False}
TAIL_GRAD = "replicated_with_tail_grad_allreduce"
REPLICATED = ("replicate", "replicated_with_grad_allreduce", TAIL_GRAD)  # the styles that keep the module whole
STYLES = (*GATHER_OUTPUT, *INPUT_IS_PARALLEL, "vocab", *REPLICATED, "moe_experts")
ALIASES = {"embedding_rowwise": "vocab", "colwise_rep": "colwise_gather_output", "rowwise_rep": "rowwise_split_input",
           "moe_tp_experts": "moe_experts", "ep_dispatch_experts": "moe_experts", "mla_kv_a_proj": TAIL_GRAD}
EXPERT_PARAMETER_STYLES = ("packed_colwise", "grouped_gemm", "rowwise", "colwise")  # on mlp.experts.<weight>
_RECORD = "_tp_parallelize_record"


def parallelize(module: nn.Module, plan: dict[str, str] | None = None, *, group: dist.ProcessGroup | None = None,
                sequence_parallel: bool = False) -> nn.Module:
    """Replace `module`'s layers by tensor-parallel ones following `plan` (default: `tp.default_plan(module)`), in
    place, on the current mesh's tp group (or `group`); returns `module`.

    Weights are sharded from the module's own (same dtype and device), so every rank must hold the same weights.
    The attention modules whose heads become local get their local head counts; kv heads fewer than tp are held by
    tp / kv ranks each, in the families that allow it. Raises ValueError, before changing anything, for a split
    that cannot be right: heads not divisible by tp, an unknown style, a pattern matching nothing, a module of the
    wrong kind, a tied weight sharded on one side only.
    """
    _check_arguments(plan, sequence_parallel)
    if hasattr(module, _RECORD):
        raise ValueError(f"{type(module).__name__} is already parallelized (tp.describe shows how)")
    if (name := fsdp_sharded(module)) is not None:
        raise ValueError(f"tp.parallelize: {name} is already a DTensor (FSDP2's fully_shard?): parallelize first, "
                         "then fully_shard")
    group = resolve_group(group)
    family = hf.family_of(module)
    if family is not None and not family.checked:
        warnings.warn(f"tp.parallelize: model_type {hf.model_type(module)!r} is not among the families tp checked "
                      f"({', '.join(hf.FAMILIES)}); its plan is applied with Hugging Face's semantics", stacklevel=2)
    styles = _match(module, hf.default_plan(module) if plan is None else plan, strict=plan is not None)
    modules = dict(module.named_modules())
    for name, style in styles.items():
        _check_kind(name, modules[name], style)
    tp_size = dist.get_world_size(group)
    options, local_heads = hf.shard_options(module, modules, styles, family, tp_size)
    if family is not None:
        _check_local_outputs_consumed(module, modules, styles)
    ties = _ties(modules, styles, options)
    tails = {name: hf.shared_tail_width(module, modules[name], family, name) for name, style in styles.items()
             if style == TAIL_GRAD}
    vocab_parallel_logits = _vocab_parallel_output(module, modules, styles)
    built = {}
    for name, style in styles.items():
        try:
            built[name] = _build(modules[name], style, group, options.get(name, {}))
        except ValueError as e:
            raise ValueError(f"{name} ({style}): {e}") from None
    shared_input = SharedInputCopy(group)

    # Nothing above touched the model; nothing below raises.
    record = []
    for name, style in styles.items():
        new = built[name]
        if new is not None:
            parent, _, leaf = name.rpartition(".")
            setattr(modules[parent], leaf, new)
            if isinstance(new, ColumnParallelLinear):
                new.register_forward_pre_hook(functools.partial(shared_input, name))
        elif style == "replicated_with_grad_allreduce":
            sum_grads_in_backward(modules[name], group)
        elif style == TAIL_GRAD:
            modules[name].register_forward_hook(TailGradSum(tails[name], group))
        record.append((name, style, _detail(new, style, ties.get(name), tails.get(name))))
    for linear, embedding in ties.items():
        built[linear].weight = built[embedding].weight
    for name, (heads, kv_heads, replicas) in local_heads.items():
        family.localize(modules[name], heads, kv_heads)
        HeadsRngFork(modules[name], built.get(f"{name}.{family.out}"))
        spread = f" (each kv head on {replicas} ranks)" if replicas > 1 else ""
        record.append((name, "heads", f"{heads} heads, {kv_heads} kv heads per rank{spread}"))
    if vocab_parallel_logits:
        module.loss_function = _vocab_parallel_causal_lm_loss(group)
        record.append(("loss_function", "loss", "vocab-parallel cross-entropy on the local logits [..., V/tp]"))
        if hasattr(module, "generate"):  # it would pick tokens from this rank's slice of the vocabulary
            module.generate = _generate_refused
            record.append(("generate", "refused", "needs full logits: 'colwise_gather_output' on the output layer"))
    if hasattr(module, "save_pretrained"):  # the state dict holds this rank's shards under the dense names
        module.save_pretrained = types.MethodType(_save_pretrained_gathered, module)  # (rebound by deepcopy)
        record.append(("save_pretrained", "gathered", "writes the dense model: shards gathered, tp rank 0 writes"))
    module.register_forward_pre_hook(shared_input.clear)
    module.register_forward_hook(shared_input.clear, always_call=True)
    source = "plan=" if plan is not None else hf.plan_source(module)
    setattr(module, _RECORD, {"tp": tp_size, "tp_rank": dist.get_rank(group), "plan": source,
                               "entries": sorted(record)})
    return module


def _check_arguments(plan, sequence_parallel):
    if sequence_parallel:
        raise ValueError("sequence_parallel=True is not supported by tp.parallelize: Hugging Face models keep "
                         "activations batch-first [b, s, h] and their attention takes the sequence length from its "
                         "input, so sequence-sharded norms would need each family's attention rewritten")
    if plan is not None and not isinstance(plan, dict):
        raise ValueError(f"plan={plan!r} must be a dict {{module name pattern: style}} (or None: the family's default "
                         "plan)")


def describe(module: nn.Module) -> str:
    """What `tp.parallelize` did to `module`: one line per sharded or patched module, with its style."""
    record = getattr(module, _RECORD, None)
    if record is None:
        inside = [(name, sub) for name, sub in module.named_modules() if getattr(sub, _RECORD, None) is not None]
        if not inside:
            return f"{type(module).__name__}: not parallelized by tp.parallelize"
        return f"{type(module).__name__}: parallelized inside: " + "\n".join(
            f"{name}: {describe(sub)}" for name, sub in inside)
    width, style_width = (max(len(entry[i]) for entry in record["entries"]) for i in (0, 1))
    lines = [f"{type(module).__name__} over tp = {record['tp']} ranks, plan: {record['plan']}"]
    lines += [f"  {name:<{width}}  {style:<{style_width}}  {detail}" for name, style, detail in record["entries"]]
    return "\n".join(lines)


def _matches(pattern, name):
    atoms, parts = pattern.split("."), name.split(".")
    return len(atoms) == len(parts) and all(fnmatch.fnmatchcase(p, a) for a, p in zip(atoms, parts))


def _match(module, plan, *, strict):
    """{module name: style} for every module a pattern matches (a default plan may name optional modules)."""
    names = [name for name, _ in module.named_modules()]
    experts_weights = {f"{name}.{w}" for name, sub in module.named_modules() if _is_hf_experts(sub)
                       for w in ParallelExperts.names}
    styles, matched_by = {}, {}
    for pattern, style in plan.items():
        if style in EXPERT_PARAMETER_STYLES and any(_matches(pattern, w) for w in experts_weights):
            continue  # an HF plan's entry for the experts' own weights: moe_experts on their module shards them
        style = ALIASES.get(style, style)
        if style not in STYLES:
            raise ValueError(f"unknown style {style!r} for {pattern!r}; tp.parallelize supports {', '.join(STYLES)} "
                             f"(and HF's {', '.join(ALIASES)})")
        hits = [name for name in names if _matches(pattern, name)]
        if not hits and strict:
            raise ValueError(f"plan pattern {pattern!r} matches no module of {type(module).__name__}")
        for name in hits:
            if styles.setdefault(name, style) != style:
                raise ValueError(f"{name} matches {matched_by[name]!r} ({styles[name]}) and {pattern!r} ({style})")
            matched_by.setdefault(name, pattern)
    if not styles:
        raise ValueError(f"the plan matches no module of {type(module).__name__}")
    return styles


def _is_hf_experts(module):  # transformers' fused experts (Mixtral, Qwen2/3-MoE, OLMoE, ...): two 3-D weights
    weights = [getattr(module, w, None) for w in ParallelExperts.names]
    return all(isinstance(w, nn.Parameter) and w.dim() == 3 for w in weights) and not isinstance(module,
                                                                                                  ParallelExperts)


def _is_conv1d(module):  # transformers' Conv1D (GPT-2): a linear layer with its weight stored [in, out]
    return type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers.")


def _is_scaled_embedding(module):  # transformers' *ScaledWordEmbedding (Gemma's): nn.Embedding times embed_scale
    return (isinstance(module, nn.Embedding) and type(module).__name__.endswith("ScaledWordEmbedding")
            and type(module).__module__.startswith("transformers.") and hasattr(module, "embed_scale"))


def _check_kind(name, module, style):
    if style in GATHER_OUTPUT or style in INPUT_IS_PARALLEL:
        ok, wanted = type(module) is nn.Linear or _is_conv1d(module), "nn.Linear (or transformers' Conv1D)"
    elif style == "vocab":
        ok = type(module) is nn.Embedding or _is_scaled_embedding(module)
        wanted = "nn.Embedding (or transformers' ScaledWordEmbedding)"
    elif style == "replicated_with_grad_allreduce":
        ok, wanted = any(True for _ in module.parameters(recurse=False)), "parameters of its own"
    elif style == TAIL_GRAD:
        ok, wanted = type(module) is nn.Linear, "nn.Linear"
    elif style == "moe_experts":
        ok, wanted = _is_hf_experts(module), "transformers' fused experts (gate_up_proj, down_proj [E, .., ..])"
    else:
        ok, wanted = True, ""
    if not ok:
        hf_name = next((f" (HF's {alias!r})" for alias, ours in ALIASES.items() if ours == style), "")
        raise ValueError(f"{name or 'the root module'} is {type(module).__name__}; style {style!r}{hf_name} needs "
                         f"{wanted}")
    if not name and style != "replicate":
        raise ValueError(f"the root module cannot be replaced in place (style {style!r} on pattern '')")


def _check_local_outputs_consumed(module, modules, styles):
    """In an HF model, a 'colwise' layer's local output [..., out/tp] must reach a 'rowwise' layer beside it (its
    MLP's or attention's); the output layer's local logits go to the vocab-parallel loss."""
    output = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
    for name, style in styles.items():
        if style != "colwise" or modules[name] is output:
            continue
        parent = name.rpartition(".")[0]
        siblings = [n for n, s in styles.items() if s == "rowwise" and n.rpartition(".")[0] == parent]
        if not siblings:
            raise ValueError(f"{name} is 'colwise' (output [..., out/tp]) but no layer beside it in "
                             f"{parent or 'the root module'} is 'rowwise' to take that shard: shard its partner "
                             "'rowwise', or use 'colwise_gather_output'")


def _ties(modules, styles, options):
    """{linear: embedding} for weights shared by a 'vocab' embedding and a plain colwise linear (the same rows on
    each rank: re-tied after sharding); any other parameter shared with a sharded module is refused."""
    owners = {}
    for name, m in modules.items():
        for p in m.parameters(recurse=False):
            owners.setdefault(id(p), []).append(name)
    ties = {}
    for name, style in styles.items():
        if style in REPLICATED:
            continue
        for pname, p in modules[name].named_parameters(recurse=False):
            others = [o for o in owners[id(p)] if o != name]
            if not others:
                continue
            embedding, linear = (name, others[0]) if style == "vocab" else (others[0], name)
            if (len(others) > 1 or styles.get(embedding) != "vocab" or styles.get(linear) not in GATHER_OUTPUT
                    or options.get(linear)):
                raise ValueError(f"{name}.{pname} is tied to {', '.join(others)}: a tied weight can be sharded only "
                                 "as a 'vocab' embedding together with its colwise output layer")
            ties[linear] = embedding
    return ties


def _vocab_parallel_output(module, modules, styles):
    """Whether the model's output layer gives vocab-parallel logits; then HF's loss must take them (checked here)."""
    output = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
    name = next((n for n, m in modules.items() if m is output), None) if output is not None else None
    if name is None or styles.get(name) != "colwise":
        return False
    if hasattr(module, "loss_function"):
        from transformers.loss.loss_utils import ForCausalLMLoss

        if module.loss_function is not ForCausalLMLoss:
            raise ValueError(f"{name} 'colwise' gives vocab-parallel logits, which only a causal-LM loss is replaced "
                             f"for; {type(module).__name__}'s loss is {module.loss_function.__name__}: use "
                             "'colwise_gather_output'")
    return True


def _as_linear(module):
    """nn.Linear as it is; HF's Conv1D (weight [in, out]) as the nn.Linear it computes."""
    if not _is_conv1d(module):
        return module
    return types.SimpleNamespace(in_features=module.nx, out_features=module.nf, weight=module.weight.t(),
                                 bias=module.bias)


def _build(module, style, group, options):
    """The replacement module (None when the module stays), with the original's requires_grad and mode."""
    if style in GATHER_OUTPUT:
        new = ColumnParallelLinear.from_linear(_as_linear(module), gather_output=GATHER_OUTPUT[style], group=group,
                                               disable_grad_reduce=True, **options)
    elif style in INPUT_IS_PARALLEL:
        new = RowParallelLinear.from_linear(_as_linear(module), input_is_parallel=INPUT_IS_PARALLEL[style],
                                            group=group, **options)
    elif style == "moe_experts":
        return ParallelExperts.from_hf(module, group=group)
    elif style == "vocab":
        new = VocabParallelEmbedding.from_embedding(module, group=group)
        if _is_scaled_embedding(module):
            new.register_buffer("embed_scale", module.embed_scale.clone(), persistent=False)
            new.register_forward_hook(lambda mod, args, out: out * mod.embed_scale.to(out.dtype))
    else:
        return None
    if _is_conv1d(module):  # full_state_dict writes its weight back as [in, out], from whichever module it is called
        new._tp_from_conv1d = True
    for pname, p in new.named_parameters(recurse=False):
        p.requires_grad_(getattr(module, pname).requires_grad)
    return new.train(module.training)


def _detail(new, style, tied_to, tail):
    if isinstance(new, ParallelExperts):
        return (f"ParallelExperts, experts {new.expert_range.start}..{new.expert_range.stop - 1} of {new.num_experts} "
                f"(ep={new.ep_size}), F {new.local_ffn} of {new.ffn_hidden_size} (etp={new.etp_size})")
    if isinstance(new, VocabParallelEmbedding):
        scaled = ", output times embed_scale" if hasattr(new, "embed_scale") else ""
        return f"VocabParallelEmbedding, rows [{new.vocab_start}, {new.vocab_end}) of {new.num_embeddings}{scaled}"
    if style == TAIL_GRAD:
        return f"unchanged; the gradient of its output's last {tail} features summed over tp in backward"
    if new is None:
        return "grads summed over tp in backward" if style == "replicated_with_grad_allreduce" else "unchanged"
    fused = f", parts {new.parts}" if new.stride > 1 else ""
    fused += f", part_replicas {new.part_replicas}" if new.replicated else ""
    tie = f", weight tied to {tied_to}" if tied_to else ""
    return f"{type(new).__name__}, local weight {'x'.join(map(str, new.weight.shape))}{fused}{tie}"


def _vocab_parallel_causal_lm_loss(group):
    def loss_function(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None,
                      **kwargs):
        """HF's ForCausalLMLoss on vocab-parallel logits [b, s, V/tp]: the full-vocab logits are never gathered."""
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        reduction = "mean" if num_items_in_batch is None else "sum"
        loss = vocab_parallel_cross_entropy(logits, shift_labels.to(logits.device), ignore_index=ignore_index,
                                            reduction=reduction, vocab_size=vocab_size, group=group)
        return loss if num_items_in_batch is None else loss / num_items_in_batch

    return loss_function


def _save_pretrained_gathered(module, save_directory, *args, **kwargs):
    """Hugging Face's save_pretrained of the dense model: every tp rank calls it (the shards are gathered), tp rank
    0 writes (with data parallelism, pass is_main_process= as usual)."""
    if kwargs.get("state_dict") is not None:
        raise ValueError("save_pretrained(state_dict=...) on a tp.parallelize'd model: the dense state dict is "
                         "gathered here (tp.full_state_dict); pass none")
    state = full_state_dict(module)
    if getattr(module, _RECORD)["tp_rank"] == 0:
        type(module).save_pretrained(module, save_directory, *args, **(kwargs | {"state_dict": state}))


def _generate_refused(*args, **kwargs):
    raise RuntimeError("generate() needs full-vocabulary logits, and this model's output layer is vocab-parallel "
                       "('colwise'): parallelize it with 'colwise_gather_output' on the output layer to generate")
