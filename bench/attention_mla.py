"""Multi-head latent attention against GQA at equal attention parameters (bench.attention's third table).

The MLA shape is DeepSeek-V3's scaled to the GQA layer's hidden size h: q_lora_rank = 1536/7168·h and kv_lora_rank
= 512/7168·h (rounded to multiples of 32), its head widths kept (q·k 128 + 64 RoPE, v 128), and as many heads as
make its weights (models.flops.attention_params: down-, up- and output projections) closest to the GQA layer's. Per
layer and token, both counted by the same rules as the training log and the planner:
  FLOPs      training FLOPs (forward + backward) of the projections (6 · weights) and the core over a causal
             sequence of S tokens counted as models.flops counts it (6 · heads · (q·k + v width) · S, full square)
  KV cache   bytes per token an inference cache keeps (bf16): GQA 2·kv_heads·d; MLA the latent and the shared RoPE
             key, kv_lora_rank + 64 (DeepSeek-V2, arXiv:2405.04434 §2.1.2: the up-projections absorbed)
  saved      bytes per token the attention saves for backward in training (bench.plan.activations, bf16, tp 1)
  modelled   fwd + bwd ms of one layer's attention (its GEMMs and the flash core) at S tokens on the profile
             (bench.plan's step-time pieces: tile-wave GEMM rates, measured attention rates by length)
Measured (CPU, one thread, fp32, batch 1): the two attention modules (models.block.Attention, models.mla.MLAttention)
of the small shape --heads/--kv-heads/--head-dim, fwd + bwd at the largest --seq, with the bytes autograd saves.
"""
import torch
import torch.distributed as dist

from models.block import Attention
from models.config import GPTConfig
from models.flops import attention_params, attention_widths
from models.mla import MLAttention
from tp import testing

from .common import round_robin_times, step_memory
from .plan import activations
from .plan.attention_time import attention_times
from .plan.gemm import gemm_time
from .plan.hardware import CLUSTERS
from .plan.software import OURS
from .plan.step_time import Plan, attention_gemms

DEEPSEEK_RATIOS = (1536 / 7168, 512 / 7168)  # q_lora_rank / h, kv_lora_rank / h (DeepSeek-V3's config.json)
NOPE, ROPE, V = 128, 64, 128  # DeepSeek-V3's head widths


def gqa_config(hidden, heads, kv_heads, head_dim, *, seq):
    return GPTConfig(vocab_size=256, hidden_size=hidden, num_layers=1, num_heads=heads, num_kv_heads=kv_heads,
                     head_dim=head_dim, ffn_hidden_size=hidden, max_seq_len=seq)


def mla_config(gqa, *, widths=(NOPE, ROPE, V)):
    """DeepSeek-V3's MLA scaled to `gqa`'s hidden size, its heads chosen so that the attention weights are closest
    to `gqa`'s (the module docstring); `widths`: (nope, rope, v) per head."""
    h, (nope, rope, v) = gqa.hidden_size, widths
    q_lora, kv_lora = (max(32, round(r * h / 32) * 32) for r in DEEPSEEK_RATIOS)
    shape = dict(vocab_size=256, hidden_size=h, num_layers=1, ffn_hidden_size=h, max_seq_len=gqa.max_seq_len,
                 multi_latent_attention=True, q_lora_rank=q_lora, kv_lora_rank=kv_lora, qk_nope_head_dim=nope,
                 qk_rope_head_dim=rope, v_head_dim=v)
    target = attention_params(gqa)
    return min((GPTConfig(**shape, num_heads=n) for n in range(1, 4 * gqa.num_heads + 1)),
               key=lambda c: abs(attention_params(c) - target))


def compared_row(name, config, seq, cluster):
    """The modelled comparison of one attention (the module docstring)."""
    qk, v = attention_widths(config)
    plan = Plan(tp=1, cp=1, pp=1, virtual_stages=1, dp=1, micro_batch_size=1)
    e = 2
    gemms = sum(gemm_time(g, cluster, e) for g in attention_gemms(config, plan, seq))
    core = sum(attention_times(config, plan, seq, cluster, OURS, e))
    if config.multi_latent_attention:
        cache = e * (config.kv_lora_rank + config.qk_rope_head_dim)
        shape = f"q {config.q_lora_rank} kv {config.kv_lora_rank}+{config.qk_rope_head_dim}, {config.num_heads} " \
                f"heads {qk}/{v}"
    else:
        cache = e * 2 * config.num_kv_heads * config.head_dim
        shape = f"{config.num_heads}/{config.num_kv_heads} heads of {config.head_dim}"
    saved = activations.attention_activation_bytes(config, tp=1, tokens=seq, rows=seq, precision="bf16")
    saved += 4 * seq * config.num_heads  # the log-sum-exp
    return {"attention": name, "hidden": config.hidden_size, "shape": shape, "params_m": attention_params(config) / 1e6,
            "gflops_per_token": (6 * attention_params(config) + 6 * config.num_heads * (qk + v) * seq) / 1e9,
            "kv_cache_bytes": cache, "saved_kib_per_token": saved / seq / 1024, "seq": seq,
            "modelled_ms": 1e3 * (gemms + core), "hardware": cluster.name}


def modelled(hidden, heads, kv_heads, head_dim, seq, hardware="h100-sxm"):
    gqa = gqa_config(hidden, heads, kv_heads, head_dim, seq=seq)
    return [compared_row(name, c, seq, CLUSTERS[hardware]) for name, c in (("GQA", gqa), ("MLA", mla_config(gqa)))]


def _measure_rank(hidden, heads, kv_heads, head_dim, seq, iters, warmup):
    """On one spawned rank: {name: [seconds, saved bytes]} of fwd + bwd of each attention module (fp32, 1 thread)."""
    torch.set_num_threads(1)
    group = dist.group.WORLD
    gqa = gqa_config(hidden, heads, kv_heads, head_dim, seq=seq)
    mla = mla_config(gqa, widths=(head_dim // 2, head_dim // 2, head_dim))  # widths as the GQA head's
    modules = {"GQA": Attention(gqa, group=group, cp_group=group), "MLA": MLAttention(mla, group=group,
                                                                                       cp_group=group)}
    x = torch.randn(seq, 1, hidden, generator=torch.Generator().manual_seed(0), requires_grad=True)

    def step(name):
        modules[name](x).sum().backward()

    times = round_robin_times({name: (lambda name=name: step(name)) for name in modules}, iters=iters,
                              warmup=warmup, sync=lambda: None)
    return {name: [times[name], step_memory(lambda name=name: step(name))[0],
                   attention_params(mla if name == "MLA" else gqa)] for name in modules}


def measured(hidden, heads, kv_heads, head_dim, seq, iters, warmup):
    result = testing.run(_measure_rank, world_size=1, timeout=600, hidden=hidden, heads=heads, kv_heads=kv_heads,
                         head_dim=head_dim, seq=seq, iters=iters, warmup=warmup)[0]
    return [{"attention": name, "hidden": hidden, "seq": seq, "params_m": params / 1e6, "ms": 1e3 * seconds,
             "saved_kib_per_token": saved / seq / 1024} for name, (seconds, saved, params) in result.items()]


MODEL_COLUMNS = [
    ("attention", "attention", "{}"), ("hidden", "h", "{}"), ("shape", "shape", "{}"),
    ("params_m", "params M", "{:.2f}"), ("gflops_per_token", "GFLOP/token", "{:.3f}"),
    ("kv_cache_bytes", "KV cache B/token", "{:,}"), ("saved_kib_per_token", "saved KiB/token", "{:.1f}"),
    ("seq", "S", "{}"), ("modelled_ms", "modelled ms", "{:.3f}")]
MEASURED_COLUMNS = [
    ("attention", "attention", "{}"), ("hidden", "h", "{}"), ("seq", "s", "{}"), ("params_m", "params M", "{:.3f}"),
    ("ms", "fwd+bwd ms", "{:.2f}"), ("saved_kib_per_token", "saved KiB/token", "{:.2f}")]
