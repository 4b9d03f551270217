"""Pipeline schedules against the un-pipelined model: loss and every gradient, GPipe and 1F1B, at pp = 2 and 4
(with tp and SP inside the stages, uneven layer splits, tied embeddings across stages), and 1F1B's memory bound."""
import pytest
import torch
import torch.distributed as dist

import models
import tp
from models.hf import hf_state_dict
from models.pipeline import PipelineRunner, allreduce_tied_embedding_grads, build_stage, stage_layers
from tp.testing import distributed

VOCAB, SEQ, MICRO, NUM_MICRO = 50, 8, 2, 4


def micro_batches(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (MICRO, SEQ), generator=g), torch.randint(0, VOCAB, (MICRO, SEQ), generator=g))
            for _ in range(NUM_MICRO)]


def test_stage_layers_split_evenly_first_stages_take_the_rest():
    assert [stage_layers(5, 2, s) for s in range(2)] == [(0, 3), (3, 5)]
    assert [stage_layers(6, 4, s) for s in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 6)]
    with pytest.raises(ValueError, match=r"pp=4 pipeline stages need at least 4 layers, the model has num_layers=3"):
        stage_layers(3, 4, 0)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("tp_size,pp_size,sequence_parallel", [(1, 2, False), (1, 4, False), (2, 2, True)])
@distributed(world_size=4)
def test_schedule_equals_the_unpipelined_model(schedule, tp_size, pp_size, sequence_parallel):
    mesh = tp.init_mesh(tp=tp_size, pp=pp_size)
    config = models.GPTConfig(vocab_size=VOCAB, hidden_size=16, num_layers=5, num_heads=4, num_kv_heads=2,
                              ffn_hidden_size=24, tie_embeddings=True, sequence_parallel=sequence_parallel)
    batches = micro_batches()
    torch.manual_seed(0)
    stage = build_stage(config, mesh)
    stats = PipelineRunner(stage, mesh, micro_batch_size=MICRO, seq_len=SEQ).run(batches, schedule)
    allreduce_tied_embedding_grads(stage, mesh)

    solo = dist.new_group([dist.get_rank()], use_local_synchronization=True)
    torch.manual_seed(0)
    reference = models.GPT(config.replace(sequence_parallel=False), group=solo)
    loss = sum(reference(x, y) for x, y in batches) / NUM_MICRO
    loss.backward()
    assert abs(stats.loss - loss.item()) <= 1e-5 * loss.item(), (stats.loss, loss.item())
    ours, expected = hf_state_dict(stage, grads=True), hf_state_dict(reference, solo, grads=True)
    assert ours and set(ours) <= set(expected)
    for name, grad in ours.items():
        err = (grad - expected[name]).abs().max().item()
        assert err <= 1e-5, f"{name}: grad err {err}"
    names = [None] * pp_size
    dist.all_gather_object(names, sorted(ours), group=mesh.pp_group)
    assert set().union(*map(set, names)) == set(expected)  # the stages hold every parameter between them
    forwards = [k for kind, k in stats.order if kind == "F"]
    assert forwards == list(range(NUM_MICRO)) and len(stats.order) == 2 * NUM_MICRO
    if schedule == "gpipe":
        assert stats.max_alive == NUM_MICRO and stats.order[NUM_MICRO - 1] == ("F", NUM_MICRO - 1)
    else:  # warm-up p-i-1 forwards, then one forward one backward: at most p-i micro-batches alive
        warmup = min(pp_size - mesh.pp_rank - 1, NUM_MICRO)
        assert stats.max_alive == min(pp_size - mesh.pp_rank, NUM_MICRO) <= pp_size
        assert [kind for kind, _ in stats.order[:warmup + 2]] == ["F"] * (warmup + 1) + ["B"]
    assert 0.0 <= stats.bubble < 1.0


@distributed(world_size=2)
def test_micro_batches_of_another_shape_or_count_raise_on_every_stage():
    """A micro-batch the runner was not built for (or stages given different counts) is refused on every stage
    before any send: the receiving buffers have the built shape, so it would compute on garbage or hang."""
    mesh = tp.init_mesh(tp=1, pp=2)
    config = models.GPTConfig(vocab_size=VOCAB, hidden_size=16, num_layers=2, num_heads=4, ffn_hidden_size=24)
    torch.manual_seed(0)
    runner = PipelineRunner(build_stage(config, mesh), mesh, micro_batch_size=MICRO, seq_len=SEQ)
    smaller = [(x[:1], y[:1]) for x, y in micro_batches()]
    with pytest.raises(ValueError, match=r"micro-batch 0: tokens shape \(1, 8\) != \[micro_batch_size, seq_len\] "
                                         r"\(2, 8\)"):
        runner.run(smaller)
    fewer = micro_batches()[:NUM_MICRO - mesh.pp_rank]
    with pytest.raises(ValueError, match=r"stages were given different numbers of micro-batches: 3 to 4"):
        runner.run(fewer)
    assert runner.run(micro_batches()).loss > 0  # and the runner still works
