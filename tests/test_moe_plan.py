"""bench.plan for mixtures of experts: the memory model's expert counts by hand, the all-to-all over NVLink inside a
node and the NIC across, the ep / etp search with --fix, the JSON's ep, etp, active_params and total_params (the
published totals of Mixtral and Qwen3-MoE), MoE models from --num-experts and --hf-config, bad requests in one
line. (The memory model against the job's logged bytes: tests/test_moe_train.py.)"""
import json
import math
from dataclasses import replace

import pytest
import torch

import models
import tp
from bench.plan import cli as plan
from bench.plan import hardware as rl
from bench.plan import memory, moe_time
from bench.plan import step_time as pm
from tests.helpers import quiet
from tp.testing import distributed

MOE = models.GPTConfig(vocab_size=256, hidden_size=64, num_layers=4, num_heads=8, num_kv_heads=4, ffn_hidden_size=128,
                       num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=48, moe_layer_freq=[0, 1, 1, 1],
                       moe_shared_expert_size=32)
UNIT = rl.Cluster("unit", rl.Hardware("unit", flops=1.0, hbm=1.0, link=8.0, source="test", gpus_per_node=8,
                                     inter_node=1.0),
                  memory=1e30, reserved=0.0, gemm_efficiency=1.0, comm_efficiency=1.0,
                  attention_efficiency=1.0, op_overhead=0.0, source="test")


def test_expert_parameters_per_rank_by_hand():
    """An MoE layer on one rank: the router [E, h], E/ep experts of 3·h·F/etp (SwiGLU), the shared expert's 3·h·S/tp;
    the dense first layer unchanged; the experts' optimizer state over edp = tp·dp/(ep·etp) under zero1."""
    h, f, s = 64, 48, 32
    dense = sum(math.prod(x) for _, x in memory.layer_parameter_shapes(MOE, 2, 0))
    assert dense == sum(math.prod(x) for _, x in memory.layer_parameter_shapes(MOE.replace(num_experts=0), 2, 0))
    for ep, etp in ((1, 2), (4, 1), (2, 2), (8, 1)):
        shapes = dict(memory.layer_parameter_shapes(MOE, 2, 1, ep=ep, etp=etp))
        assert shapes["mlp.router.weight"] == (8, h)
        assert math.prod(shapes["mlp.experts.fc1"]) + math.prod(shapes["mlp.experts.fc2"]) == 8 // ep * 3 * h * f // etp
        assert math.prod(shapes["mlp.shared.fc1.weight"]) + math.prod(shapes["mlp.shared.fc2.weight"]) == 3 * h * s // 2
    args = dict(tp=2, pp=1, stage=0, virtual_stages=1, dp_mode="zero1", precision="bf16", shards=4)
    one, eight = memory.parameter_memory(MOE, **args), memory.parameter_memory(MOE, **args, ep=8, etp=1)
    experts = 3 * (8 * 3 * h * f // 2)  # three MoE layers' experts at ep 1, etp = tp = 2
    assert one[0] - eight[0] == 2 * (experts - 3 * 3 * h * f)  # bf16 params: 8 experts F/2 wide -> 1 whole
    with pytest.raises(ValueError, match=r"ep=3 \* etp=1 = 3 does not divide tp\*cp\*dp = 2\*1\*4 = 8"):
        memory.estimate(MOE, tp=2, pp=1, dp=4, micro_batch_size=1, seq_len=16, sequence_parallel=False,
                        recompute="none", dp_mode="zero1", precision="bf16", ep=3, etp=1)
    with pytest.raises(ValueError, match=r"num_experts=8 is not divisible by ep=16"):
        memory.estimate(MOE, tp=2, pp=1, dp=16, micro_batch_size=1, seq_len=16, sequence_parallel=False,
                        recompute="none", dp_mode="zero1", precision="bf16", ep=16, etp=2)


def test_the_all_to_all_bytes_per_link_by_hand():
    """One dispatch of 64 tokens (h 64, k 2, bf16) from one rank: slots·h·e·(ep − 1)/ep leave it, the in-node share
    over NVLink and the rest over the NIC; the ep group's ranks are etp apart, so a node of 8 holds 8/etp of them.
    DeepEP sends a token once per remote node (n − 1)(1 − (1 − 1/n)^k) times and forwards it over NVLink there;
    allgather gathers (ep·etp − 1)·r·h."""
    T, e, h = 64, 2, 64
    one = e * h * T  # one copy of each token: e·h·T at tp = 1
    cases = [  # (ep, etp, tp, dispatcher, NVLink bytes, NIC bytes)
        (8, 1, 1, "alltoall", one * 2 * 7 / 8, 0.0),  # one node: 7 of 8 peers there
        (16, 1, 1, "alltoall", one * 2 * 7 / 16, one * 2 * 8 / 16),  # two nodes of 8: 7 peers near, 8 far
        (8, 2, 2, "alltoall", one * 2 * 3 / 8, one * 2 * 4 / 8),  # etp 2: 4 ep ranks a node, 2 nodes
        (16, 1, 1, "deepep", one * 2 * 15 / 16, one * (1 - (1 - 1 / 2) ** 2)),  # 0.75 copies cross the NIC
        (8, 1, 1, "deepep", one * 2 * 7 / 8, 0.0),  # within a node as alltoall
        (4, 1, 1, "allgather", e * 3 * T * h, 0.0),
        (16, 1, 1, "allgather", 0.0, e * 15 * T * h),  # a ring over two nodes: the NIC hop sets the pace
    ]
    for ep, etp, tp_size, dispatcher, nvlink, nic in cases:
        p = pm.Plan(tp_size, 1, 1, 1, 16 // tp_size, 1, ep=ep, etp=etp, dispatcher=dispatcher)
        got = moe_time.a2a_bytes(MOE, p, T, 8, e, dispatcher)
        assert got == (pytest.approx(nvlink), pytest.approx(nic)), (ep, etp, dispatcher, got)
    assert moe_time.a2a_bytes(MOE, pm.Plan(1, 1, 1, 1, 8, 1), T, 8, e) == (0.0, 0.0)
    # the time: both links at once, the busiest rank's share (imbalance), dispatch + combine
    p = pm.Plan(1, 1, 1, 1, 16, 1, ep=16, etp=1)
    imbalance = 1 + math.sqrt(2 * math.log(16) * (15 / 16) / (2 * T))
    assert moe_time.imbalance(MOE, p, T) == pytest.approx(imbalance)
    assert moe_time.a2a_time(MOE, p, T, UNIT, e) == pytest.approx(2 * max(one * 14 / 16 / 8, one * 16 / 16) * imbalance)


def test_each_dispatchers_volume_is_tp_moes_sent_bytes():
    """Within a node at etp = 1, four passes (dispatch and combine, forward and backward) move what tp.moe's
    TokenDispatcher.sent_bytes says per token (allgather: less the routing metadata, 16 B per slot per peer)."""
    from tp.moe import DISPATCHERS

    T, e, h, k = 64, 2, 64, 2
    for name, dispatcher in DISPATCHERS.items():
        for ep in (2, 4, 8):
            p = pm.Plan(1, 1, 1, 1, 8, 1, ep=ep, etp=1, dispatcher=name)
            nvlink, nic = moe_time.a2a_bytes(MOE, p, T, 8, e, name)
            metadata = (ep - 1) * k * 16 if name == "allgather" else 0
            assert nic == 0 and 4 * nvlink / T == pytest.approx(dispatcher.sent_bytes(ep, h, k, e) - metadata)


def test_the_moe_layer_overhead_by_hand():
    """Permutation and router bytes, the host's launches after the sync, the imbalance, the experts' grouped GEMM."""
    T, e, h, E, k = 64, 2, 64, 8, 2
    p = pm.Plan(1, 1, 1, 1, 8, 1, ep=8, etp=1)  # one local expert: no chunk sort
    copies = T * k
    permute = 2 * e * copies * h + 4 * copies + e * T * h + 2 * e * copies * h
    router = 5 * 4 * T * E
    assert moe_time.elementwise_bytes(MOE, p, T, e) == permute + router
    p4 = replace(p, ep=4)  # two local experts: received chunks sorted by expert and back
    assert moe_time.elementwise_bytes(MOE, p4, T, e) == permute + router + 2 * 2 * e * copies * h
    cluster = replace(UNIT, launch_overhead=5e-6)
    software = replace(pm.OURS, moe_launches=(12, 2))  # 12 + 2 per local expert, 2 local experts at ep 4
    assert moe_time.host_time(MOE, p4, cluster, software, (1e-5, 2e-4)) == (pytest.approx(16 * 5e-6 - 1e-5), 0.0)
    assert moe_time.host_time(MOE, p4, cluster, software, (1.0, 1.0)) == (0.0, 0.0)  # hidden behind the GPU
    gemms, groups = moe_time.expert_gemms(MOE, p4, T)  # each of 2 groups: the busiest rank's slots / 2
    rows = math.ceil(copies * moe_time.imbalance(MOE, p4, T) / 2)
    assert groups == 2 and {(g.m, g.k, g.n) for g in gemms if g.phase == "fwd"} == {(rows, h, 2 * 48), (rows, 48, h)}


def test_the_moe_costs_appear_in_the_step():
    """The step's breakdown: dispatch per MoE layer forward and backward (3 MoE layers), the host's exposed launches
    (none on a profile without launch overhead)."""
    moe16 = MOE.replace(num_experts=16)
    p = pm.Plan(1, 1, 1, 1, 16, 1, ep=16, etp=1)
    out = pm.step_time(moe16, p, seq_len=32, global_batch_size=16, cluster=replace(UNIT, cores=None))
    assert out["breakdown"]["ep_a2a"] == pytest.approx(3 * 2 * moe_time.a2a_time(moe16, p, 32, UNIT, 2))
    assert out["breakdown"]["moe_host"] == 0.0
    overlapped = pm.step_time(moe16, p, seq_len=32, global_batch_size=16, cluster=replace(UNIT, cores=None),
                              software=replace(pm.OURS, ep_overlap=True))
    assert overlapped["breakdown"]["ep_a2a"] < out["breakdown"]["ep_a2a"]


def _run(capsys, *argv):
    code = plan.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_search_covers_ep_and_etp_and_reports_active_and_total_parameters(capsys):
    flags = ["--gpus", "8", "--hidden", "64", "--layers", "4", "--heads", "8", "--ffn", "128", "--vocab", "256",
             "--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48", "--seq-len", "64",
             "--global-batch-size", "16", "--json", "--top", "0"]
    code, out, err = _run(capsys, *flags, "--fix", "pp=1,recompute=none,mbs=2,sp=off")
    plans = json.loads(out)["plans"]
    assert code == 0 and not quiet(err)
    splits = {(p["tp"], p["ep"], p["etp"]) for p in plans}
    assert {(1, 8, 1), (2, 4, 2), (2, 8, 1), (4, 2, 4), (1, 1, 1)} <= splits
    assert all((p["tp"] * p["cp"] * p["dp"]) % (p["ep"] * p["etp"]) == 0 and p["etp"] in (1, p["tp"]) for p in plans)
    config = models.GPTConfig(vocab_size=256, hidden_size=64, num_layers=4, num_heads=8, ffn_hidden_size=128,
                              num_experts=8, moe_ffn_hidden_size=48, max_seq_len=64)
    total = sum(math.prod(s) for _, s in memory.stage_parameter_shapes(config, 1))
    assert plans[0]["total_params"] == total and plans[0]["active_params"] == total - 4 * 6 * 3 * 64 * 48
    code, out, _ = _run(capsys, *flags, "--fix", "ep=4,etp=1,pp=1,mbs=2")
    assert code == 0 and all((p["ep"], p["etp"]) == (4, 1) for p in json.loads(out)["plans"])
    code, out, _ = _run(capsys, *flags[:-3], "--fix", "pp=1,mbs=2,recompute=none")  # the table names ep and etp
    assert code == 0 and "| ep | etp |" in out and "8 experts top-2" in out


@pytest.mark.parametrize("model,active,total", [("mixtral-8x7b", 12.88e9, 46.70e9), ("mixtral-8x22b", 39.16e9,
                                                                                           140.63e9),
                                                ("qwen3-30b-a3b", 3.35e9, 30.53e9)])
def test_published_moe_shapes_have_their_published_sizes(model, active, total):
    """Mixtral 8x7B: 12.9B active of 46.7B; 8x22B: 39B of 141B (Mistral AI's model cards); Qwen3-30B-A3B: 3.3B of
    30.5B (Qwen's model card)."""
    from bench.plan.search import parameter_counts

    counts = parameter_counts(models.GPTConfig(**models.config.MODELS[model]))
    assert counts == (pytest.approx(active, rel=1e-3), pytest.approx(total, rel=1e-3))


def test_hf_moe_config_plans(capsys, tmp_path):
    """--hf-config of a Mixtral config.json plans its experts."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(model_type="mixtral", vocab_size=256, hidden_size=64, intermediate_size=96,
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                    num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128)))
    code, out, _ = _run(capsys, "--gpus", "4", "--hf-config", str(path), "--seq-len", "64", "--global-batch-size",
                        "8", "--json", "--fix", "pp=1,mbs=1,recompute=none,ep=4")
    plans = json.loads(out)["plans"]
    assert code == 0 and plans and all(p["ep"] == 4 for p in plans)
    assert plans[0]["active_params"] < plans[0]["total_params"]


@pytest.mark.parametrize("argv,message", [
    (["--model", "mixtral-8x7b", "--num-experts", "8"], "--num-experts and --moe-ffn-hidden-size go with --hidden"),
    (["--hidden", "64", "--layers", "2", "--heads", "4", "--num-experts", "4", "--moe-router-topk", "5"],
     "--moe-router-topk 5 > --num-experts 4"),
    (["--model", "tiny", "--fix", "ep=0"], "ep must be >= 1"),
])
def test_bad_moe_requests_are_one_line(argv, message, capsys):
    """Usage errors exit 2 (argparse), a bad --fix value returns 1: one line naming the value."""
    try:
        code = plan.main(["--gpus", "8", "--seq-len", "64", "--global-batch-size", "16", *argv])
    except SystemExit as e:
        code = e.code
    assert code in (1, 2) and message in capsys.readouterr().err.strip().splitlines()[-1]


VIEWS = {"view", "_unsafe_view", "t", "transpose", "unsqueeze", "squeeze", "permute", "split", "split_with_sizes",
         "slice", "detach", "expand", "alias", "select", "as_strided", "reshape", "unbind", "narrow", "lift_fresh"}


@distributed(world_size=1)
def test_our_moe_layer_launches_what_the_software_says():
    """OURS.moe_launches counts the kernels tp.moe's MoE layer launches from its dispatch (the argsort by expert) on:
    22 at ep 1, counted here op by op (views launch nothing), plus the count table's gather and host copy and the
    two all-to-alls at ep > 1."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Launches(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ not in VIEWS:
                self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    tp.init_mesh()
    cfg = models.GPTConfig(**models.config.MODELS["tiny-moe"])
    mlp = models.GPT(cfg).layers[1].mlp
    counted = Launches()
    with counted:
        mlp(torch.randn(2, 16, cfg.hidden_size))
    after_sync = counted.names[counted.names.index("sort"):]
    assert pm.OURS.moe_launches == (len(after_sync) + 4, 0) == (26, 0), after_sync


def test_software_and_moe_fix_keys_on_the_cli(capsys):
    """--software megatron-core with --fix dispatcher=deepep,recompute=layernorm+moe_act,grad_reduce=bf16 plans
    exactly that; this package implements no DeepEP and reduces in fp32: one line each."""
    flags = ["--gpus", "16", "--hidden", "64", "--layers", "4", "--heads", "8", "--ffn", "128", "--vocab", "256",
             "--num-experts", "16", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48", "--seq-len", "64",
             "--global-batch-size", "16", "--json", "--top", "0"]
    fix = "pp=1,mbs=1,sp=off,ep=16,etp=1,dispatcher=deepep,recompute=layernorm+moe_act,grad_reduce=bf16"
    code, out, err = _run(capsys, *flags, "--software", "megatron-core", "--fix", fix)
    plans = json.loads(out)["plans"]
    assert code == 0 and plans and not quiet(err)
    assert {(p["dispatcher"], p["recompute"]) for p in plans} == {("deepep", "layernorm+moe_act")}
    code, _, err = _run(capsys, *flags, "--fix", "dispatcher=deepep")
    assert code == 1 and "--software ours implements alltoall, allgather" in err
    code, _, err = _run(capsys, *flags, "--fix", "grad_reduce=bf16")
    assert code == 1 and "--software ours reduces gradients in fp32" in err
    for software, mode, runs in (("megatron-core", "fsdp", "ddp, zero1"), ("torchtitan", "zero1", "ddp, fsdp")):
        code, _, err = _run(capsys, *flags, "--software", software, "--fix", f"dp_mode={mode}")  # (it blamed the
        # sizes' divisions)
        assert code == 1 and err.strip().splitlines() == [
            f"error: --fix dp_mode={mode}: --software {software} does not run it (it runs {runs})"], err
