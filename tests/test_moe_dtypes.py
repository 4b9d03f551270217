"""Buffers that need their dtype keep it under mixed precision: the sigmoid router's fp32 selection bias and fp64
loads, through every dp mode of the job (models.training.data_parallel.MODES) at bf16, dp·cp 1 and 2."""
import pytest
import torch
import torch.distributed as dist

import models
import tp
from models.training.data_parallel import MODES, wrap_data_parallel
from tp.testing import distributed

VOCAB, SEQ, BATCH, TOPK, RATE = 50, 16, 2, 2, 1e-3
CONFIG = dict(vocab_size=VOCAB, hidden_size=16, num_layers=1, num_heads=4, num_kv_heads=2, ffn_hidden_size=24,
              max_seq_len=32, num_experts=4, moe_router_topk=TOPK, moe_ffn_hidden_size=8,
              moe_router_score="sigmoid")


@pytest.mark.parametrize("split", [dict(tp=2), dict(dp=2)], ids=["dp1", "dp2"])
@pytest.mark.parametrize("mode", list(MODES))
@distributed(world_size=2)
def test_bf16_keeps_the_selection_bias_fp32_and_it_moves_by_the_update(mode, split):
    """From a bias of 0.6 (where a bf16 bias could not move by 1e-3: half its ulp is 2e-3), one bf16 step of the job's
    wrapping: the loads count every routed slot (fp64), the bias stays fp32 and moves by exactly rate · sign(mean -
    load) in fp32."""
    torch.set_default_dtype(torch.float32)
    mesh = tp.init_mesh(**split)
    torch.manual_seed(0)
    stage = models.GPT(models.GPTConfig(**CONFIG))
    (router,) = [m for m in stage.modules() if isinstance(m, tp.moe.TopKRouter)]
    router.expert_bias.fill_(0.6)
    module = wrap_data_parallel(stage, mesh, mode, "bf16")
    g = torch.Generator().manual_seed(1)
    X = torch.randint(0, VOCAB, (mesh.dp_size * BATCH, SEQ), generator=g)
    Y = torch.randint(0, VOCAB, X.shape, generator=g)
    module(X.chunk(mesh.dp_size)[mesh.dp_rank], Y.chunk(mesh.dp_size)[mesh.dp_rank]).float().backward()
    assert router.expert_bias.dtype == torch.float32 and router.expert_load.dtype == torch.float64
    loads = router.expert_load.clone()
    dist.all_reduce(loads)  # (every rank routes its own tokens: tp shares, dp batches)
    assert loads.sum().item() == mesh.dp_size * BATCH * SEQ * TOPK
    tp.moe.update_expert_bias(stage, RATE, group=mesh.group("tp-cp-dp"))
    step = RATE * torch.sign(loads.mean() - loads)
    assert step.any()
    assert torch.equal(router.expert_bias, torch.full_like(router.expert_bias, 0.6) + step.float())
