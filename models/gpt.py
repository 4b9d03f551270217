"""GPT: vocab-parallel embedding -> transformer blocks -> final norm -> vocab-parallel output layer and loss.

`model(tokens)` with tokens [b, s] returns the full-vocabulary logits [b, s, vocab_size] (gathered over tp, the
padding columns dropped); `model(tokens, targets)` returns the mean cross-entropy through the vocab-parallel loss,
the same scalar on every tp rank, without ever gathering the logits. Internally activations are [s, b, h].

Context parallelism (`cp_group`, by default the mesh's): every rank of a cp group passes the full [b, s] tokens (and
targets); the model keeps its load-balanced share (tp.cp_shard: s/cp tokens), positions follow each token's global
position, attention covers the whole sequence, `model(tokens)` returns the full logits (tp.cp_unshard) and
`model(tokens, targets)` the global mean over the non-ignored tokens of the whole sequence, equal on every rank of
tp×cp. Each cp rank's backward then yields its share of the gradient: the sum over the cp group (not the mean) is the
gradient of that loss, so data parallelism reduces over dp×cp summing over cp (models.training.model.wrap_data_parallel
does).

Documents (a window packing several): `model(tokens, targets, document_ids=ids)` with ids [b, s] (equal ids: one
document) keeps attention inside each document and restarts the positions at each document's first token, so the
window computes what its documents compute one by one; `position_ids` [b, s] gives the positions instead (documents
without position resets, or positions alone). Both describe the whole window on every rank (every pipeline stage
and cp rank), as the tokens do.

Initialisation is TP- and PP-invariant: the embedding, every block and the output layer draw their full master
weights from their own seed, derived from one draw of the CPU generator, so `torch.manual_seed(s); GPT(cfg)`
holds at any tp the slices of the TP=1 weights, and a pipeline stage holding layers i..j holds exactly those layers
of the one-stage model. It is device-invariant too: the weights are drawn on the CPU and moved to the default device,
so a GPU run starts from a CPU run's weights.
"""
import contextlib
import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

import tp
from tp.dropout import CounterDropout
from tp.mesh import SharedGroup, resolve_cp_group, resolve_group
from tp.random import derive_seed

from .block import (
    Norm,
    TransformerBlock,
    document_positions,
    dropout_module,
    dropout_positions,
    normal_init,
    sample_ids_or_drawn,
    token_positions,
    token_rows,
)
from .config import GPTConfig
from .mtp import MTPLayer, shifted, with_mtp_loss
from .recompute import recompute_groups

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from .generation import KVCache


@contextlib.contextmanager
def _seeded(base, index):
    """Draw a module's init from its own stream: the same weights whichever stage builds it. Only the CPU generator
    is reseeded (and restored): the draws are on the CPU (see GPT.__init__), and the GPUs' generators stay as they
    were."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(derive_seed(base, index))
        yield


class GPT(nn.Module):
    """Decoder-only transformer on the tensor-parallel layers (or one pipeline stage of it).

    `layers=(start, stop)`, `pre_process` (embedding) and `post_process` (final norm, output layer, loss) build
    a pipeline stage; the defaults build the whole model.
    """

    group, cp_group = SharedGroup(), SharedGroup()  # deep copies (EMA, reference models) share the groups

    def __init__(self, config: GPTConfig, *, group: dist.ProcessGroup | None = None,
                 cp_group: dist.ProcessGroup | None = None, layers: tuple[int, int] | None = None,
                 pre_process: bool = True, post_process: bool = True, _init: bool = True) -> None:
        super().__init__()
        device = torch.get_default_device()  # built and drawn on the CPU, then moved: the weights of any device
        with torch.device("cpu"):
            self._build(config, group, cp_group, layers, pre_process, post_process, _init)
        if device.type != "cpu":
            self.to(device)

    def _build(self, config, group, cp_group, layers, pre_process, post_process, _init):
        self.config, self.group, self.cp_group = config, resolve_group(group), resolve_cp_group(cp_group)
        self.tp_size = dist.get_world_size(self.group)
        self.cp_size = 1 if self.cp_group is None else dist.get_world_size(self.cp_group)
        config.check_tp(self.tp_size)
        config.check_cp(self.cp_size, self.tp_size)
        self.padded_vocab_size = config.padded_vocab_size(self.tp_size)
        self.layer_range = layers or (0, config.num_layers)
        if not 0 <= self.layer_range[0] <= self.layer_range[1] <= config.num_layers:
            raise ValueError(f"layers={layers} must lie within [0, {config.num_layers}]")
        self.pre_process, self.post_process = pre_process, post_process
        sp, h = config.sequence_parallel, config.hidden_size
        # the model's seed, from the CPU generator (that `torch.manual_seed` sets), whatever the default device
        base = int(torch.randint(0, 2**62, (1,), generator=torch.default_generator).item()) if _init else 0
        if pre_process:
            self.embedding = tp.VocabParallelEmbedding(self.padded_vocab_size, h, sequence_parallel=sp,
                                                       group=self.group, _init=False)
            if _init:
                with _seeded(base, 0):
                    self.embedding.load_master(self._padded_vocab_master())
            self.position_embedding = None
            if config.position == "learned":
                with _seeded(base, 1):
                    self.position_embedding = nn.Embedding(config.max_seq_len, h)
                    normal_init(config.init_std)(self.position_embedding.weight)
                self.position_embedding.weight.sequence_parallel = sp and not config.sequence_parallel_grad_sync
        self.layers = nn.ModuleList()
        for i in range(*self.layer_range):
            with _seeded(base, 2 + i) if _init else contextlib.nullcontext():
                self.layers.append(TransformerBlock(config, group=self.group, cp_group=self.cp_group, layer=i,
                                                    moe=config.is_moe_layer(i), _init=_init))
        self._group_recomputed_blocks()
        if post_process:
            self.final_norm = Norm(config.norm, h, config.norm_eps, sequence_parallel=sp,
                                   grad_sync=config.sequence_parallel_grad_sync, group=self.group)
            self.output = tp.ColumnParallelLinear(h, self.padded_vocab_size, bias=False, sequence_parallel=sp,
                                                  group=self.group, _init=False)
            if config.mtp_num_layers and not pre_process:  # MTP's copy of the first stage's (models/stages.py)
                self.embedding = tp.VocabParallelEmbedding(self.padded_vocab_size, h, sequence_parallel=sp,
                                                           group=self.group, _init=False)
                if _init:
                    with _seeded(base, 0):
                        self.embedding.load_master(self._padded_vocab_master())
            if config.tie_embeddings and hasattr(self, "embedding"):
                self.output.weight = self.embedding.weight
            elif _init:  # a last stage without the embedding starts from the same tied weights as the first
                with _seeded(base, 0 if config.tie_embeddings else 2 + config.num_layers):
                    self.output.load_master(self._padded_vocab_master())
            self.mtp = nn.ModuleList(self._mtp_layer(k, base, _init) for k in range(config.mtp_num_layers))

    def _mtp_layer(self, depth, base, _init):
        """MTP depth `depth` + 1 (models/mtp.py), drawn from its own seed; its block is layer num_layers + depth."""
        c, layer = self.config, self.config.num_layers + depth
        with _seeded(base, 3 + layer) if _init else contextlib.nullcontext():
            block = TransformerBlock(c, group=self.group, cp_group=self.cp_group, layer=layer,
                                     moe=c.is_moe_layer(c.num_layers - 1), _init=_init)
            return MTPLayer(c, block, group=self.group, _init=_init)

    def _group_recomputed_blocks(self):
        """Full recomputation's groups of this chunk's blocks (config.recompute_method, recompute_num_layers): a
        block alone recomputes itself (TransformerBlock.recompute_whole); longer groups run here from their input."""
        c = self.config
        groups = recompute_groups(len(self.layers), c.recompute_method, c.recompute_num_layers) \
            if "block" in c.recompute_parts else []
        for i, block in enumerate(self.layers):
            block.recompute_whole = any(group == range(i, i + 1) for group in groups)
        self.recompute_groups = [group for group in groups if len(group) > 1]

    def _run_blocks(self, x, start, stop, document_ids, position_ids, sample_ids):
        for layer in self.layers[start:stop]:
            x = layer(x, document_ids=document_ids, position_ids=position_ids, sample_ids=sample_ids)
        return x

    def _blocks(self, x, document_ids, position_ids, sample_ids, cache):
        """The blocks of this stage on x, the recomputed groups each from its input (masks redrawn)."""
        if cache is not None or not self.recompute_groups or not torch.is_grad_enabled():
            for i, layer in enumerate(self.layers):
                x = layer(x, document_ids=document_ids, position_ids=position_ids, sample_ids=sample_ids,
                          cache=None if cache is None else cache.layer(i))
            return x
        starts, i = {group.start: group.stop for group in self.recompute_groups}, 0
        while i < len(self.layers):
            stop = starts.get(i, i + 1)
            run = (x, i, stop, document_ids, position_ids, sample_ids)
            x = checkpoint(self._run_blocks, *run, use_reentrant=False, preserve_rng_state=False) if i in starts \
                else self._run_blocks(*run)
            i = stop
        return x

    def _padded_vocab_master(self):
        """[padded V, h]: the real rows drawn (as many draws at any tp), zero rows for the padding."""
        c = self.config
        master = normal_init(c.init_std)(torch.empty(c.vocab_size, c.hidden_size))
        return torch.cat([master, master.new_zeros(self.padded_vocab_size - c.vocab_size, c.hidden_size)])

    def embed(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None,
              sample_ids: torch.Tensor | None = None) -> torch.Tensor:  # [b, s] -> [s(/cp)(/tp), b, h]
        c = self.config
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
        seq = tokens.shape[1]
        if seq > c.max_seq_len:
            raise ValueError(f"sequence length {seq} exceeds max_seq_len={c.max_seq_len}")
        if c.sliding_window and seq > c.sliding_window:
            raise ValueError(f"sequence length {seq} exceeds sliding_window={c.sliding_window} (attention within a "
                             "sliding window is not implemented: sequences up to it run as full attention)")
        if self.cp_size > 1:
            c.check_seq_len(seq, tp=self.tp_size, cp=self.cp_size)
        # (the padded embedding rows exist, but are not tokens; on a GPU a device assert: no host sync)
        tp.debug.check_range(tokens, c.vocab_size,
                             lambda bad: f"token id {bad} is outside the vocabulary [0, {c.vocab_size})")
        if self.cp_size > 1:
            if tp.is_debug():  # (a sampler over the global rank, or tokens already sharded, would pass silently)
                tp.debug.check(tokens, self.cp_group, "the tokens of GPT (every cp rank passes the full [b, s])",
                               replicated=True, group_name="cp")
            tokens = tp.cp_shard(tokens, 1, group=self.cp_group)  # [b, s/cp]: this rank's load-balanced share
        x = self.embedding(tokens.t())  # [s(/cp)(/tp), b, h]
        positions = token_positions(x.shape[0], sequence_parallel=c.sequence_parallel, tp_group=self.group,
                                    cp_group=self.cp_group, device=x.device)  # None without cp
        if self.position_embedding is not None:
            weight = self.position_embedding.weight
            if c.sequence_parallel and c.sequence_parallel_grad_sync:  # the others' rows get their grads elsewhere
                weight, = tp.sync_grads_over_tp(weight, group=self.group)
            if position_ids is not None:  # this rank's rows' [b, rows] -> [rows, b, h]
                rows = token_rows(position_ids, sequence_parallel=c.sequence_parallel, tp_group=self.group,
                                  cp_group=self.cp_group)
                x = x + weight[rows].transpose(0, 1)
            elif positions is not None:
                x = x + weight[positions[0]].unsqueeze(1)
            elif c.sequence_parallel:  # this rank's positions
                chunk = seq // self.tp_size
                first = dist.get_rank(self.group) * chunk
                x = x + weight[first:first + chunk].unsqueeze(1)
            else:
                x = x + weight[:seq].unsqueeze(1)
        if not (c.dropout and self.training):
            return x
        rows = dropout_positions(x.shape[0], sequence_parallel=c.sequence_parallel, tp_group=self.group,
                                 cp_group=self.cp_group, device=x.device)
        samples = sample_ids_or_drawn(sample_ids, x.shape[1], x.device)
        return CounterDropout(c.dropout, c.dropout_seed, dropout_module(None, 0), samples).add(x, positions=rows)

    def head(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        # [s(/cp)(/tp), b, h] -> loss, or logits [b, s, vocab_size]
        return self._loss_or_logits(self.output(self.final_norm(x)), targets)  # [s(/cp), b, V/tp] (SP: gathered)

    def _loss_or_logits(self, logits, targets):
        if targets is None:
            logits = tp.gather_from_tp_region(logits, self.group)[..., :self.config.vocab_size]  # [s(/cp), b, V]
            if self.cp_size > 1:
                logits = tp.cp_unshard(logits, 0, group=self.cp_group)  # [s, b, V]
            return logits.transpose(0, 1)  # [b, s, V]
        if self.cp_size == 1:
            return tp.vocab_parallel_cross_entropy(logits, targets.t(), vocab_size=self.config.vocab_size,
                                                   group=self.group)
        return self._context_parallel_loss(logits, tp.cp_shard(targets, 1, group=self.cp_group).t())

    def _context_parallel_loss(self, logits, targets, ignore_index=-100):  # [s/cp, b, V/tp], [s/cp, b]
        """The mean over the non-ignored tokens of the whole sequence: this rank's sum and count summed over the cp
        group (one all-reduce; backward: identity, each rank's graph yields its share of the gradient). Finite when
        this rank's tokens are all ignored; NaN with zero gradients, as F.cross_entropy, when every token is."""
        total = tp.vocab_parallel_cross_entropy(logits, targets, vocab_size=self.config.vocab_size,
                                                ignore_index=ignore_index, reduction="sum", group=self.group)
        count = (targets != ignore_index).sum().to(total.dtype)
        total, count = tp.reduce_from_tp_region(torch.stack([total, count]), self.cp_group).unbind()
        return total / count.clamp(min=1) + torch.where(count == 0, float("nan"), 0.0)  # (no host sync)

    def _check_targets(self, tokens, targets, hidden):
        """targets must be [b, s] like the tokens (or the [b, s] of a later stage's hidden [s(/tp), b, h])."""
        if self.pre_process:
            if tuple(targets.shape) != tuple(tokens.shape):
                raise ValueError(f"targets shape {tuple(targets.shape)} != tokens shape {tuple(tokens.shape)} "
                                 "(both [batch, seq])")
            return
        seq = hidden.shape[0] * (self.tp_size if self.config.sequence_parallel else 1) * self.cp_size
        if tuple(targets.shape) != (hidden.shape[1], seq):
            raise ValueError(f"targets shape {tuple(targets.shape)} != [batch, seq] {(hidden.shape[1], seq)} of this "
                             f"stage's input hidden {tuple(hidden.shape)} ([seq(/tp), batch, hidden])")

    def _check_documents(self, tokens, hidden, document_ids, position_ids, sample_ids=None):
        """document_ids and position_ids must be integer [b, s] like the window's tokens, positions in
        [0, max_seq_len) (tp.debug.check_range: no host sync on a GPU); sample_ids integer [b]."""
        if self.pre_process:
            shape = tuple(tokens.shape)
        else:
            shape = (hidden.shape[1], hidden.shape[0] * (self.tp_size if self.config.sequence_parallel else 1)
                     * self.cp_size)
        for name, ids, want in (("document_ids", document_ids, shape), ("position_ids", position_ids, shape),
                                ("sample_ids", sample_ids, shape[:1])):
            if ids is None:
                continue
            if tuple(ids.shape) != want or ids.dtype.is_floating_point or ids.dtype.is_complex \
                    or ids.dtype == torch.bool:
                what = "the tokens' shape [batch, seq]" if len(want) == 2 else "shape [batch]"
                raise ValueError(f"{name} must be integers of {what} {want}, got {ids.dtype} {tuple(ids.shape)}")
        if position_ids is not None:
            limit = self.config.max_seq_len
            tp.debug.check_range(position_ids, limit,
                                 lambda bad: f"position id {bad} is outside [0, max_seq_len={limit})")

    def forward(self, tokens: torch.Tensor | None = None, targets: torch.Tensor | None = None, *,
                hidden: torch.Tensor | None = None, document_ids: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache: "KVCache | None" = None,
                sample_ids: torch.Tensor | None = None, mtp_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [b, s] (first stage) or hidden [s(/tp), b, h] (later stages) -> loss / logits (last stage) or
        hidden. document_ids [b, s]: attention inside each document, positions restarting at each (unless
        position_ids [b, s] gives them); every stage takes them. `cache` (generation, models/generation.py): the
        tokens follow the cached ones, whose keys and values each layer reads, and to which it adds these.
        sample_ids [b] (integers): each sample's global index in the run, which with config.dropout_seed keys the
        dropout masks (every stage takes them); in training without them, each forward draws a random start from
        the default CPU generator (seed every rank of a tp/cp group alike). With multi-token prediction
        (config.mtp_num_layers) the training loss's gradient includes the MTP loss's (models/mtp.py), its value the
        LM loss alone; a last stage without the embedding reads the window's tokens from `mtp_tokens` [b, s]."""
        if targets is not None and self.post_process:
            self._check_targets(tokens, targets, hidden)  # every rank, before any collective
        if cache is not None:  # the positions after the cached tokens
            position_ids = cache.position_ids(tokens)
        self._check_documents(tokens, hidden, document_ids, position_ids, sample_ids)
        if self.cp_size > 1 and tp.is_debug():  # (ids differing across the cp group would mask silently wrong)
            for name, ids in (("document_ids", document_ids), ("position_ids", position_ids)):
                if ids is not None:
                    tp.debug.check(ids, self.cp_group, f"the {name} of GPT (every cp rank passes the whole window's)",
                                   replicated=True, group_name="cp")
        if position_ids is None and document_ids is not None:
            position_ids = document_positions(document_ids)
        c = self.config
        if self.training and cache is None and (c.dropout or c.attention_dropout):  # one draw for every layer
            batch = tokens.shape[0] if self.pre_process else hidden.shape[1]
            sample_ids = sample_ids_or_drawn(sample_ids, batch, (tokens if self.pre_process else hidden).device)
        x = self.embed(tokens, position_ids, sample_ids) if self.pre_process else hidden
        x = self._blocks(x, document_ids, position_ids, sample_ids, cache)
        if cache is not None:
            cache.advance(x.shape[0])
        if not self.post_process:
            return x
        self.last_mtp_loss = None
        if targets is None or not self.mtp or not (self.training and torch.is_grad_enabled()):
            return self.head(x, targets)
        inputs = dict(document_ids=document_ids, position_ids=position_ids, sample_ids=sample_ids)
        loss, *mtp = self._losses_with_mtp(x, tokens if tokens is not None else mtp_tokens, targets, inputs)
        self.last_mtp_loss = (sum(mtp) / len(mtp)).detach().float()
        return with_mtp_loss(loss, sum(mtp) / len(mtp), c.mtp_loss_scaling_factor)

    def _losses_with_mtp(self, x, tokens, targets, inputs):
        """[the LM loss, each MTP depth's loss] (models/mtp.py) from the main model's last hidden x: the output layer
        applied once to every depth's hidden, side by side in the batch (its weight used once per backward)."""
        if tokens is None:
            raise ValueError("multi-token prediction on a last pipeline stage needs the window's tokens: pass "
                             "mtp_tokens= (the first stage's tokens [b, s])")
        normed, goals = [self.final_norm(x)], [targets]
        for depth, layer in enumerate(self.mtp, 1):
            ahead, goal = shifted(tokens, targets, depth, inputs["document_ids"])
            if self.cp_size > 1:
                ahead = tp.cp_shard(ahead, 1, group=self.cp_group)
            x = layer(x, self.embedding(ahead.t()), **inputs)
            normed.append(layer.final_norm(x))
            goals.append(goal)
        logits = self.output(torch.cat(normed, dim=1))  # [s(/cp), (1 + D)·b, V/tp]
        return [self._loss_or_logits(part, goal) for part, goal in zip(logits.chunk(len(goals), dim=1), goals)]

    def mtp_loss(self) -> torch.Tensor | None:
        """The last training forward's multi-token-prediction loss, the mean over the depths (without
        mtp_loss_scaling_factor; equal on every rank of the last stage), for logging; None without MTP."""
        return getattr(self, "last_mtp_loss", None)  # (None too after an evaluation forward)

    @torch.no_grad()
    def generate(self, tokens: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, eos_token_id: int | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """tokens [b, s] -> [b, s + n] ids: the prompt, then n <= max_new_tokens new tokens (fewer only when every
        sequence has reached `eos_token_id`; a finished one is padded with it). Greedy at temperature 0, else sampled
        from softmax(logits / temperature) restricted to the `top_k` likeliest tokens and the smallest set whose
        probability reaches `top_p`, drawing from `generator` (seed it the same on every tp rank). A prefill pass,
        then one token per step through a KV cache of this rank's heads (models/generation.py); the whole model on
        this rank (no pipeline stage), no context or sequence parallelism."""
        from .generation import generate

        return generate(self, tokens, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                        eos_token_id=eos_token_id, generator=generator)

    def moe_aux_losses(self) -> dict[str, torch.Tensor]:
        """The last forward's mixture-of-experts losses summed over this stage's MoE layers (fp32 scalars, equal on
        every rank of the stage, "sequence" on the ranks of its micro-batch; zeros without them), for logging:
        "load_balancing", "z", "sequence" (DeepSeek-V3's sequence-wise loss). Their gradient joined backward already
        (tp.moe.losses); the loss `forward` returns is the LM loss alone."""
        values = tp.moe.aux_losses(self)
        zero = torch.zeros((), device=next(self.parameters()).device)
        return {key: sum((getattr(v, key) for v in values), zero) for key in ("load_balancing", "z", "sequence")}

    def set_moe_aux_loss_scale(self, scale: float) -> None:
        """Scale the MoE aux losses' gradient as the LM loss is scaled before backward (1 / accumulated
        micro-batches, times a loss scale); the data-parallel averaging is accounted for already."""
        tp.moe.set_aux_loss_scale(self, scale)

    def compile_blocks(self, **options: Any) -> None:
        """torch.compile each transformer block in place, as torchtitan does: one compiled graph per block, reused
        by every layer of the same structure, and the embedding, the loss and the pipeline's transfers left eager.
        With `fullgraph=True` (a graph break raises), mixture-of-experts blocks too (under tp.moe.dynamic_shapes:
        the dispatch's row counts are data-dependent sizes). The parameters' names do not change (checkpoints and
        data parallelism see the same module); compile before wrapping for data parallelism."""
        for i, block in zip(range(*self.layer_range), self.layers):
            block.compile(**{"fullgraph": True} | options)
            if self.config.is_moe_layer(i):  # (nn.Module.compile's compiled call: the setting scoped to it)
                block._compiled_call_impl = tp.moe.dynamic_shapes()(block._compiled_call_impl)

    def activation_shape(self, micro_batch_size: int, seq_len: int) -> tuple[int, int, int]:
        """[s(/cp)(/tp), b, h]: this rank's share of the activation between pipeline stages for a micro-batch of
        [micro_batch_size, seq_len] tokens (tp.pipeline.PipelineStage)."""
        share = self.cp_size * (self.tp_size if self.config.sequence_parallel else 1)
        return (seq_len // share, micro_batch_size, self.config.hidden_size)

    @classmethod
    def from_hf(cls, hf_model_or_path: "PreTrainedModel | str | os.PathLike", *, group: dist.ProcessGroup | None = None,
                cp_group: dist.ProcessGroup | None = None, dtype: torch.dtype | None = None,
                stage: dict[str, Any] | None = None, **overrides: Any) -> "GPT":
        """Build from a Hugging Face Llama/Mistral/Qwen2/GPT-2 model or a directory saved with save_pretrained,
        each rank reading only its shards. `overrides` replace GPTConfig fields (e.g. sequence_parallel=True);
        `stage` (dict of layers, pre_process, post_process) builds one pipeline stage. A model tp.parallelize split
        (or FSDP2 sharded) is read through tp.full_state_dict: a collective, which every rank of its groups calls."""
        from .hf import load_hf

        stage = stage if cp_group is None else {**(stage or {}), "cp_group": cp_group}
        return load_hf(cls, hf_model_or_path, group=group, dtype=dtype, stage=stage, **overrides)

    def save_hf(self, path: str | os.PathLike, *, pp_group: dist.ProcessGroup | None = None,
                dp_group: dist.ProcessGroup | None = None) -> None:
        """Write a directory `transformers.AutoModelForCausalLM.from_pretrained` loads (gathered on tp rank 0; with
        `pp_group`, one safetensors file per pipeline stage and an index; with `dp_group`, replica 0 writes; under
        cp, cp rank 0: the others hold the same weights)."""
        from .hf import save_hf

        if self.cp_size > 1 and dist.get_rank(self.cp_group) != 0:
            dp_group = self.cp_group  # (a group in which this rank is not 0: it gathers with the others, never writes)
        save_hf(self, path, group=self.group, pp_group=pp_group, dp_group=dp_group)
