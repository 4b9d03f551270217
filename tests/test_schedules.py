"""Pipeline schedules as data (tp.pipeline.schedules) and their simulator (bench.schedule), no processes: every
generator is deadlock-free and dependency-ordered over a grid of (p, m, V), reproduces the closed forms for unit
costs, and bad sizes are refused in one line; the simulator finds hand-made deadlocks and out-of-order actions."""
import json

import pytest

from tp.pipeline.schedules import Action, Schedule, ScheduleError, build, check_actions, pair_order, simulate

GRID = [(name, p, m, 1) for name in ("gpipe", "1f1b", "zb") for p in range(1, 6) for m in range(1, 10)]
GRID += [("interleaved", p, m, v) for p in range(2, 5) for m in range(p, 3 * p + 1, p) for v in range(2, 5)]


@pytest.mark.parametrize("name,p,m,v", GRID)
def test_every_schedule_in_the_grid_is_complete_ordered_and_deadlock_free(name, p, m, v):
    schedule = build(name, p, m, v)
    check_actions(schedule)  # each rank: F, then BW or B then W, of every chunk and micro-batch, once
    for costs in ((1, 1, 1), (1, 2, 1), (1.0, 1.7, 0.3)):
        timeline = simulate(schedule, costs)  # raises on a deadlock
        # every action starts after its inputs were sent and after the rank's previous action
        for r, intervals in enumerate(timeline.intervals):
            assert [a for *_, a in intervals] == list(schedule.actions[r])
            for (_, end, _), (start, _, _) in zip(intervals, intervals[1:]):
                assert start >= end
            for start, _, action in intervals:
                for message, source in schedule.receives(r, action):
                    assert timeline.sent[message] <= start and source == schedule.place(
                        message.stage - (message.kind == "act") + (message.kind == "grad"))[0]
        assert 0 <= timeline.bubble_fraction < 1
    forwards = [[a.micro for a in order if a.kind == "F" and a.chunk == 0] for order in schedule.actions]
    assert all(f == list(range(m)) for f in forwards)  # micro-batches enter every chunk in order


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 12])
def test_closed_forms_for_unit_costs(p, m):
    gpipe, one = simulate(build("gpipe", p, m)), simulate(build("1f1b", p, m))
    assert gpipe.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert one.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert gpipe.peak_activations == m and one.peak_activations == min(p, m)
    assert one.peaks == [min(p - r, m) for r in range(p)]  # stage r: p - r micro-batches alive
    zb = simulate(build("zb", p, m))
    assert zb.peak_activations == min(p, m)  # 1F1B's memory
    assert zb.bubble_fraction <= one.bubble_fraction
    if m >= p:
        assert zb.bubble_fraction <= (p - 1) / (3 * m + p - 1) + 1e-12
        # the idle time per rank is (p-1)(F+B-W) = p-1 against 1F1B's 3(p-1)
        assert zb.span == pytest.approx(3 * m + p - 1)
    # any uniform costs: GPipe and 1F1B idle (p-1)(F+B+W) per rank, the same fraction
    assert simulate(build("1f1b", p, m), (1, 2.5, 0.5)).bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p,v", [(2, 2), (2, 4), (3, 2), (4, 2), (4, 3)])
@pytest.mark.parametrize("groups", [1, 2, 3])
def test_interleaved_divides_the_bubble_by_the_chunks(p, v, groups):
    m = groups * p
    timeline = simulate(build("interleaved", p, m, v))
    assert timeline.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))
    assert timeline.peak_activations <= p + (p - 1) / v + 1e-12
    if m > p:  # rank 0 warms up with 2(p-1) + (V-1)p chunk forwards before its first backward
        assert timeline.peaks[0] == pytest.approx(p + (p - 1) / v)
    schedule = timeline.schedule
    assert schedule.stage(p - 1, 0) + 1 == schedule.stage(0, 1)  # the last rank feeds the first rank's next chunk
    assert schedule.sends(p - 1, Action("F", 0, 0)) == [(("act", p, 0), 0)]
    assert schedule.sends(0, Action("BW", 1, 0)) == [(("grad", p - 1, 0), p - 1)]


@pytest.mark.parametrize("args,message", [
    (("interleaved", 4, 2, 2), r"needs micro_batches >= pp: micro_batches=2 < pp=4"),
    (("interleaved", 4, 6, 2), r"micro_batches divisible by pp: micro_batches=6 is not a multiple of pp=4"),
    (("interleaved", 1, 4, 2), r"needs pp >= 2 pipeline stages, got pp=1"),
    (("interleaved", 2, 4, 1), r"needs virtual_stages >= 2 model chunks per rank, got virtual_stages=1"),
    (("1f1b", 2, 4, 2), r"virtual_stages=2: schedule '1f1b' runs one model chunk per rank"),
    (("zb", 0, 4, 1), r"pp=0 must be an integer >= 1"),
    (("gpipe", 2, 0, 1), r"micro_batches=0 must be an integer >= 1"),
    (("gpipe", 2, True, 1), r"micro_batches=True must be an integer >= 1"),
    (("zbv", 2, 4, 1), r"schedule='zbv' must be one of \('gpipe', '1f1b', 'interleaved', 'zb'\)"),
])
def test_bad_sizes_are_refused_in_one_line(args, message):
    with pytest.raises(ScheduleError, match=message) as info:
        build(*args)
    assert "\n" not in str(info.value)


def _handmade(ranks, v=1, m=2):
    return Schedule("handmade", len(ranks), m, v, tuple(tuple(Action(*a) for a in r) for r in ranks))


def test_the_simulator_finds_deadlocks_and_broken_orders():
    # rank 1 starts micro-batch 1 first: it waits for rank 0's F1, which waits behind BW0, which waits for rank 1
    stuck = _handmade([[("F", 0, 0), ("BW", 0, 0), ("F", 0, 1), ("BW", 0, 1)],
                       [("F", 0, 1), ("BW", 0, 1), ("F", 0, 0), ("BW", 0, 0)]])
    with pytest.raises(ScheduleError, match=r"deadlock: rank 0 at BW0 \(waits for \[\('grad', 0, 0\)\]\), rank 1 "
                                            r"at F1"):
        simulate(stuck)
    backward_first = _handmade([[("BW", 0, 0), ("F", 0, 0)]], m=1)
    with pytest.raises(ScheduleError, match=r"rank 0, action 0 \(BW0\): follows nothing of its micro-batch and "
                                            r"chunk, expected \['F'\]"):
        simulate(backward_first)
    no_weights = _handmade([[("F", 0, 0), ("B", 0, 0)]], m=1)
    with pytest.raises(ScheduleError, match=r"rank 0 does not complete micro-batch 0 of chunk 0 \(has \['F', 'B'\]\)"):
        simulate(no_weights)
    twice = _handmade([[("F", 0, 0), ("BW", 0, 0), ("BW", 0, 0)]], m=1)
    with pytest.raises(ScheduleError, match=r"action 2 \(BW0\): follows \['F', 'BW'\]"):
        check_actions(twice)
    with pytest.raises(ScheduleError, match=r"costs=\(1, -1, 1\) must be three numbers >= 0"):
        simulate(build("1f1b", 2, 2), (1, -1, 1))


@pytest.mark.parametrize("name,p,m,v", [("1f1b", 4, 6, 1), ("zb", 3, 5, 1), ("interleaved", 4, 8, 2),
                                        ("interleaved", 2, 4, 3)])
def test_both_ends_of_a_link_agree_on_its_order(name, p, m, v):
    """pair_order: each pair's transfers in one order, consistent with both senders' own action order, so the
    runner can issue every link's sends and receives in the same sequence on both ranks."""
    schedule = build(name, p, m, v)
    pairs = pair_order(schedule)
    assert set(pairs) == {(r, r + 1) for r in range(p - 1)} | ({(0, p - 1)} if v > 1 and p > 2 else set())
    for (a, b), transfers in pairs.items():
        for src in (a, b):
            mine = [msg for msg, s, _ in transfers if s == src]
            produced = [msg for act in schedule.actions[src] for msg, dst in schedule.sends(src, act)
                        if dst == (b if src == a else a)]
            assert mine == produced
    total = sum(len(t) for t in pairs.values())
    assert total == 2 * m * (p * v - 1)  # every stage boundary: one activation and one gradient per micro-batch


def test_schedule_cli_prints_json_and_draws_the_timeline(tmp_path, capsys):
    from bench import schedule as cli

    assert cli.main(["--pp", "4", "--micro-batches", "8", "--schedule", "zb", "--json", "--out", str(tmp_path)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["bubble_fraction"] == pytest.approx(3 / 27) and result["peak_activations"] == 4
    assert (tmp_path / "zb_p4_m8.png").stat().st_size > 10_000
    cli.main(["--pp", "2", "--micro-batches", "4", "--schedule", "interleaved", "--virtual-stages", "2",
              "--costs", "1,2,1"])
    out = capsys.readouterr().out
    assert "bubble fraction  0.1111" in out and "peak activations 2.500" in out
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--pp", "4", "--micro-batches", "6", "--schedule", "interleaved", "--virtual-stages", "2"])
    assert exit_info.value.code == 2
    assert "micro_batches=6 is not a multiple of pp=4" in capsys.readouterr().err


def test_schedule_cli_refuses_an_unwritable_out_in_one_line(tmp_path, capsys):
    from bench import schedule as cli

    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--pp", "2", "--micro-batches", "2", "--schedule", "1f1b", "--out", str(tmp_path / "file" / "x")])
    assert exit_info.value.code == 2 and f"--out {tmp_path / 'file' / 'x'}:" in capsys.readouterr().err
