"""Backend "auto" on CUDA: per key the measured fastest of the candidate modules, cached in memory and on disk
(kernels.choice). Without a GPU the "measurable device" predicate and the timer are swapped: the candidates run on
CPU tensors (fakes recording each call over torch_ops, or the real Triton kernels under TRITON_INTERPRET=1, which
conftest sets) and the timer returns a cost per candidate."""
import json
import types

import pytest
import torch

import kernels
from kernels import choice, ops, torch_ops, triton_ops
from kernels.choice import OPS

calls = []  # (candidate, primitive) of every call the fake modules ran
COST = {("triton", "forward"): 1.0, ("torch", "forward"): 2.0, ("triton", "dgrad"): 3.0, ("torch", "dgrad"): 1.5,
        ("triton", "wgrad"): 2.0, ("torch", "wgrad"): 1.0,
        **{("triton_epilogue", op): 4.0 for op in OPS}}  # (the third candidate: slowest unless a test says otherwise)


def fake_module(name):
    def recorded(primitive):
        def run(*args, **kwargs):
            calls.append((name, primitive.removeprefix("linear_")))
            return getattr(torch_ops, primitive)(*args, **kwargs)
        return run
    return types.SimpleNamespace(**{p: recorded(p) for p in ("linear_forward", "linear_dgrad", "linear_wgrad")})


FAKES = {name: fake_module(name) for name in ops.BACKENDS}


def cost_timer(fn, device):
    """The fake modules' cost of the one call fn makes."""
    calls.clear()
    fn()
    return COST[calls[-1]]


def no_timer(fn, device):
    raise AssertionError("measured although the choice was cached, forced or not measurable")


@pytest.fixture
def auto(tmp_path, monkeypatch):
    """auto with fake candidates on a measurable CPU, the disk cache in tmp_path."""
    monkeypatch.setenv("TP_KERNELS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(choice, "measurable", lambda x: True)
    monkeypatch.setattr(choice, "time_ms", cost_timer)
    for name, module in FAKES.items():
        monkeypatch.setitem(ops.BACKENDS, name, lambda module=module: module)
    choice.clear()
    calls.clear()
    with kernels.use_backend("auto"):
        yield tmp_path
    choice.clear()


def run_all(tokens=37, n=24, k=16):
    """One call of each primitive of a GELU linear with bias, wgrad into a main_grad; -> the (candidate, primitive)
    that ran each."""
    x, w, b = torch.randn(tokens, k), torch.randn(n, k), torch.randn(n)
    ran = []
    for fn in (lambda: kernels.linear_forward(x, w, b, "gelu"),
               lambda: kernels.linear_dgrad(torch.randn(tokens, n), w, torch.randn(tokens, n), "gelu"),
               lambda: kernels.linear_wgrad(torch.randn(tokens, n), x, main_grad=torch.zeros(n, k))):
        calls.clear()
        fn()
        ran.append(calls[-1])
    return ran


def test_the_fastest_candidate_runs_per_key_and_the_table_says_why(auto):
    assert run_all() == [("triton", "forward"), ("torch", "dgrad"), ("torch", "wgrad")]
    rows = {row["op"]: row for row in kernels.choices()}
    assert rows["forward"] == dict(op="forward", dtype="float32", activation="gelu", bias=True, main_grad=False,
                                   tokens=64, N=24, K=16, device="cpu", kernels="", groups=0, torch_ms=2.0,
                                   triton_ms=1.0,
                                   triton_epilogue_ms=4.0,
                                   choice="triton")
    assert (rows["dgrad"]["choice"], rows["dgrad"]["activation"], rows["dgrad"]["bias"]) == ("torch", "gelu", False)
    assert (rows["wgrad"]["choice"], rows["wgrad"]["main_grad"], rows["wgrad"]["tokens"]) == ("torch", True, 64)


def test_candidates_are_timed_in_alternating_rounds_so_a_slow_first_measurement_does_not_decide(auto, monkeypatch):
    """A GPU's clocks move while it measures (run 4: cuBLAS's square GEMM 13 % apart in two measurements): each
    candidate is timed in ROUNDS rounds, the order reversed every other round, and keeps its median. Here the first
    measurement of all (torch's, the fastest) runs 1.5x slow: timed once each, triton would win."""
    costs = {"torch": 1.0, "triton": 1.1, "triton_epilogue": 4.0}
    timed = []

    def warming_timer(fn, device):
        calls.clear()
        fn()
        timed.append(calls[-1][0])
        return costs[timed[-1]] * (1.5 if len(timed) == 1 else 1.0)
    monkeypatch.setattr(choice, "time_ms", warming_timer)
    x, w = torch.randn(37, 16), torch.randn(24, 16)
    kernels.linear_forward(x, w)
    (row,) = kernels.choices()
    assert row["choice"] == "torch" and row["torch_ms"] == 1.0, row
    rounds = [timed[i:i + 3] for i in range(0, len(timed), 3)]
    assert len(rounds) == choice.ROUNDS >= 3 and rounds[1] == rounds[0][::-1] and rounds[2] == rounds[0]


def test_a_key_is_measured_once_per_token_bucket(auto, monkeypatch):
    run_all(tokens=37)
    monkeypatch.setattr(choice, "time_ms", no_timer)
    assert run_all(tokens=64) == [("triton", "forward"), ("torch", "dgrad"), ("torch", "wgrad")]  # same bucket
    monkeypatch.setattr(choice, "time_ms", cost_timer)
    run_all(tokens=65)
    assert sorted({row["tokens"] for row in kernels.choices()}) == [64, 128]
    # dgrad without the input gradient (only the activation's derivative) follows dgrad's choice, unmeasured
    monkeypatch.setattr(choice, "time_ms", no_timer)
    kernels.linear_dgrad(torch.randn(5, 24), torch.randn(24, 16), torch.randn(5, 24), "gelu", need_input_grad=False)
    assert calls[-1] == ("torch", "dgrad")


def test_a_choice_is_remeasured_when_the_triton_candidate_runs_other_kernels(auto, monkeypatch):
    """Hopper's persistent TMA kernels and the sm80 ones (TP_KERNELS_HOPPER, kernels.use_hopper) are different
    Triton candidates: a choice timed against one is not the other's."""
    family = ["sm90-tma"]
    monkeypatch.setattr(FAKES["triton"], "kernel_family", lambda x: family[0], raising=False)
    run_all()
    monkeypatch.setattr(choice, "time_ms", no_timer)
    run_all()  # the same kernels: cached
    family[0] = "sm80"
    monkeypatch.setattr(choice, "time_ms", cost_timer)
    run_all()
    assert sorted({row["kernels"] for row in kernels.choices()}) == ["sm80", "sm90-tma"]
    assert len(kernels.choices()) == 6


def test_the_disk_cache_serves_a_new_process_without_timing(auto, monkeypatch):
    run_all()
    (path,) = auto.glob("*.json")
    data = json.loads(path.read_text())
    assert (data["device"], data["torch_version"]) == ("cpu", torch.__version__) and len(data["choices"]) == 3
    choice.clear()  # a new process: nothing in memory
    monkeypatch.setattr(choice, "time_ms", no_timer)
    assert run_all() == [("triton", "forward"), ("torch", "dgrad"), ("torch", "wgrad")]
    assert len(kernels.choices()) == 3


def test_the_third_candidate_runs_where_it_is_fastest(auto, monkeypatch):
    """torch's GEMM with Triton's elementwise pass (kernels.triton_epilogue) is measured beside the other two and
    taken for the key it wins."""
    monkeypatch.setitem(COST, ("triton_epilogue", "dgrad"), 1.0)
    assert run_all() == [("triton", "forward"), ("triton_epilogue", "dgrad"), ("torch", "wgrad")]
    assert {row["op"]: row["choice"] for row in kernels.choices()}["dgrad"] == "triton_epilogue"


def test_a_known_choice_costs_one_dict_lookup(auto, monkeypatch):
    """Once a key is in memory its calls never touch the cache file's path (hashing the installed versions took
    ~330 us a call: 64 ms of host time per step of the 1B model, the GPU idle for a third of eager auto's step)."""
    first = run_all()

    def no_disk(device):
        raise AssertionError("the disk cache was consulted for a choice already in memory")

    monkeypatch.setattr(choice, "cache_path", no_disk)
    monkeypatch.setattr(choice, "time_ms", no_timer)
    assert run_all() == first


@pytest.mark.parametrize("change", ["device", "versions"])
def test_a_cache_of_another_device_or_library_version_is_not_used(auto, monkeypatch, change):
    run_all()
    choice.clear()
    if change == "device":
        monkeypatch.setattr(choice, "device_name", lambda device: "NVIDIA H200")
    else:
        monkeypatch.setattr(choice, "library_versions", lambda: {"torch_version": "9.9", "triton_version": "9.9"})
    measured = []
    monkeypatch.setattr(choice, "time_ms", lambda fn, device: measured.append(1) or cost_timer(fn, device))
    run_all()
    assert len(measured) == 3 * len(ops.BACKENDS) * choice.ROUNDS and len(list(auto.glob("*.json"))) == 2  # each of 3
    # keys; its own file


def test_a_file_holding_another_identity_warns_once_and_is_rebuilt(auto):
    path = choice.cache_path("cpu")
    path.write_text(json.dumps({"device": "NVIDIA H200", **choice.library_versions(), "choices": []}))
    with pytest.warns(UserWarning, match="another device or library version") as caught:
        run_all()
    assert len(caught) == 1 and json.loads(path.read_text())["device"] == "cpu"


@pytest.mark.parametrize("content", ["{not json", '{"device": "cpu"}', "[]"])
def test_a_corrupt_cache_warns_once_and_is_rebuilt(auto, content):
    path = choice.cache_path("cpu")
    path.write_text(content)
    with pytest.warns(UserWarning, match="auto-choice cache .*ignored") as caught:
        run_all()
        run_all(tokens=100)
    assert len(caught) == 1
    assert len(json.loads(path.read_text())["choices"]) == 6


def test_an_unwritable_cache_warns_once_and_is_not_fatal(auto, monkeypatch):
    (auto / "file").write_text("")
    monkeypatch.setenv("TP_KERNELS_CACHE_DIR", str(auto / "file" / "cache"))
    with pytest.warns(UserWarning, match="not written") as caught:
        assert run_all() == [("triton", "forward"), ("torch", "dgrad"), ("torch", "wgrad")]
    assert len(caught) == 1 and len(kernels.choices()) == 3


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_forced_backends_bypass_the_measurement(auto, monkeypatch, backend):
    monkeypatch.setattr(choice, "time_ms", no_timer)
    with kernels.use_backend(backend):
        assert run_all() == [(backend, "forward"), (backend, "dgrad"), (backend, "wgrad")]
    assert kernels.choices() == [] and not list(auto.glob("*.json"))


def test_cpu_tensors_under_auto_never_measure(tmp_path, monkeypatch):
    monkeypatch.setenv("TP_KERNELS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(choice, "time_ms", no_timer)
    choice.clear()
    x, w = torch.randn(5, 16), torch.randn(24, 16)
    with kernels.use_backend("auto"):
        assert not choice.measurable(x)
        assert ops._impl(x) is ops.BACKENDS["triton"]()  # the Triton backend under the interpreter, as before
        y, _ = kernels.linear_forward(x, w, None, "gelu")
    torch.testing.assert_close(y, torch_ops.linear_forward(x, w, None, "gelu")[0])
    assert kernels.choices() == [] and not list(tmp_path.iterdir())


@pytest.mark.parametrize("favoured", ["triton", "torch"])
def test_tune_linear_measures_the_real_backends(tmp_path, monkeypatch, favoured):
    """The real candidates (Triton interpreted): tune_linear measures its three keys; the timer's verdict holds."""
    monkeypatch.setenv("TP_KERNELS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(choice, "measurable", lambda x: True)

    def timer(fn, device):
        before = sum(triton_ops.LAUNCHES.values())
        fn()
        ran = "triton" if sum(triton_ops.LAUNCHES.values()) > before else "torch"
        return 1.0 if ran == favoured else 2.0
    monkeypatch.setattr(choice, "time_ms", timer)
    choice.clear()
    x, w, b = torch.randn(37, 16), torch.randn(24, 16), torch.randn(24)
    try:
        with kernels.use_backend("auto"):
            assert kernels.tune_linear(w, b, "gelu", tokens=37, main_grad=True)
            assert {row["op"]: row["choice"] for row in kernels.choices()} == dict.fromkeys(OPS, favoured)
            monkeypatch.setattr(choice, "time_ms", no_timer)
            before = sum(triton_ops.LAUNCHES.values())
            y, _ = kernels.linear_forward(x, w, b, "gelu")
            assert (sum(triton_ops.LAUNCHES.values()) > before) == (favoured == "triton")
        torch.testing.assert_close(y, torch_ops.linear_forward(x, w, b, "gelu")[0])
    finally:
        choice.clear()


def test_bench_kernels_measures_and_prints_the_choices_of_each_layer_shard(auto, capsys):
    from bench import kernels as bench_kernels

    bench_kernels.measure_choices("fc1", 64, 100, 2, torch.float32, "cpu")  # (a GPU's role, taken by the fakes)
    table = bench_kernels.print_choices(gpu=True)
    assert [(row["op"], row["N"], row["K"], row["tokens"], row["choice"]) for row in table] == [
        ("forward", 128, 64, 128, "triton"), ("dgrad", 128, 64, 128, "torch"), ("wgrad", 128, 64, 128, "torch")]
    assert "triton ms" in capsys.readouterr().out


# ------------------------------------------------------------------ the experts' grouped GEMM (kernels.grouped)
GROUPED_COST = {("triton", "grouped_forward"): 1.0, ("torch", "grouped_forward"): 2.0,
                ("triton", "grouped_dgrad"): 3.0, ("torch", "grouped_dgrad"): 1.5,
                ("triton", "grouped_wgrad"): 2.0, ("torch", "grouped_wgrad"): 1.0}
COUNTS = [5, 0, 37, 1]


def recording(name, real):
    """An implementation that records (name, primitive) and runs `real`'s."""
    def recorded(primitive):
        def run(*args):
            calls.append((name, f"grouped_{primitive}"))
            return getattr(real, primitive)(*args)
        return run
    return types.SimpleNamespace(**{p: recorded(p) for p in ("forward", "dgrad", "wgrad")})


@pytest.fixture
def grouped_auto(auto, monkeypatch):
    """auto over kernels.grouped's two implementations (recording fakes that run the torch one), costed."""
    from kernels import grouped

    real = grouped._IMPLEMENTATIONS["torch"]
    monkeypatch.setattr(grouped, "_IMPLEMENTATIONS", {name: recording(name, real) for name in grouped._IMPLEMENTATIONS})
    monkeypatch.setattr(choice, "time_ms", grouped_cost)
    return auto


def grouped_cost(fn, device):
    """The cost of the implementation fn runs (its measuring runs kept out of `calls`)."""
    ran = list(calls)
    fn()
    cost = GROUPED_COST[calls[-1]]
    calls[:] = ran
    return cost


def grouped_step(rows_scale=1):
    """grouped_linear forward and backward (wgrad into a main_grad) -> the (implementation, primitive) of each."""
    counts = [n * rows_scale for n in COUNTS]
    x = torch.randn(sum(counts), 16, requires_grad=True)
    w = torch.randn(len(counts), 24, 16, requires_grad=True)
    w.main_grad = torch.zeros(w.shape)
    calls.clear()
    kernels.grouped_linear(x, w, counts, activation="gelu").sum().backward()
    return list(calls)


def test_the_grouped_gemm_runs_its_faster_implementation_per_key(grouped_auto, monkeypatch):
    """auto measures the experts' grouped GEMM too (not Triton by device): per primitive the faster of torch's
    (torch._grouped_mm or a loop) and the Triton kernels, keyed with the number of groups; then cached."""
    assert grouped_step() == [("triton", "grouped_forward"), ("torch", "grouped_dgrad"), ("torch", "grouped_wgrad")]
    rows = {row["op"]: row for row in kernels.choices()}
    assert set(rows) == set(choice.GROUPED_OPS)
    assert rows["grouped_forward"] == dict(
        op="grouped_forward", dtype="float32", activation="gelu", bias=False, main_grad=False, tokens=64, N=24, K=16,
        device="cpu", kernels="", groups=4, torch_ms=2.0, triton_ms=1.0, choice="triton")
    assert rows["grouped_wgrad"]["main_grad"] and rows["grouped_dgrad"]["activation"] is None
    monkeypatch.setattr(choice, "time_ms", no_timer)
    assert grouped_step() == [("triton", "grouped_forward"), ("torch", "grouped_dgrad"), ("torch", "grouped_wgrad")]
    with kernels.use_backend("triton"):  # forced: no measurement, the Triton implementation throughout
        assert {name for name, _ in grouped_step()} == {"triton"}


def test_grouped_choices_survive_a_new_process_and_old_cache_rows_load(grouped_auto, monkeypatch):
    grouped_step()
    (path,) = grouped_auto.glob("*.json")
    data = json.loads(path.read_text())
    for row in data["choices"]:  # a file written before the key had `groups`: its linear rows still serve
        if row["groups"] == 0:
            del row["groups"]
    path.write_text(json.dumps(data))
    choice.clear()
    monkeypatch.setattr(choice, "time_ms", no_timer)
    assert grouped_step() == [("triton", "grouped_forward"), ("torch", "grouped_dgrad"), ("torch", "grouped_wgrad")]


@pytest.mark.parametrize("favoured", ["triton", "torch"])
def test_the_grouped_gemm_measures_its_real_implementations(tmp_path, monkeypatch, favoured):
    """The real implementations on the measuring operands (evenly split groups; Triton interpreted): the timer's
    verdict is what runs, and the result is the torch one's."""
    monkeypatch.setenv("TP_KERNELS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(choice, "measurable", lambda x: True)

    def timer(fn, device):
        before = sum(triton_ops.LAUNCHES.values())
        fn()
        return 1.0 if (sum(triton_ops.LAUNCHES.values()) > before) == (favoured == "triton") else 2.0
    monkeypatch.setattr(choice, "time_ms", timer)
    choice.clear()
    x, w = torch.randn(sum(COUNTS), 16), torch.randn(len(COUNTS), 48, 16)
    try:
        with kernels.use_backend("auto"):
            y, _ = kernels.grouped_forward(x, w, COUNTS, "swiglu")
            main_grad = torch.zeros(w.shape)
            kernels.grouped_wgrad(torch.randn(sum(COUNTS), 48), x, COUNTS, main_grad=main_grad)
        assert {row["op"]: row["choice"] for row in kernels.choices()} == {
            "grouped_forward": favoured, "grouped_wgrad": favoured}
        with kernels.use_backend("torch"):
            torch.testing.assert_close(y, kernels.grouped_forward(x, w, COUNTS, "swiglu")[0])
    finally:
        choice.clear()
