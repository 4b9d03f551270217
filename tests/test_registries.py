"""Each family of variants is named once (issue 34): a registry, a plain dict name -> implementation in the module
that implements the family, from which every upper floor (the job's config and flags, the planner, the benchmarks,
the docs) takes its names.

(a) Read from the source with `ast`: a collection literal (tuple, list, set, or a dict's keys) holding two or more
of a family's names declares the family; the family's only declaration is its registry, in its own module. (b) The
job, the planner and the benchmarks accept exactly the registry's names, in its order. (c) The docs' lists of the
variants follow the registries.

A new family is one line of FAMILIES (and, for (b), its line of `_accepted`).
"""
import ast
import importlib
import re
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("tp", "kernels", "models", "bench")
TREES = {path.relative_to(ROOT).as_posix(): ast.parse(path.read_text(), str(path))
         for package in PRODUCT for path in sorted((ROOT / package).rglob("*.py"))}


class Family(NamedTuple):
    module: str  # the module that implements the family and declares its registry
    registry: str  # the registry's name there


FAMILIES = {
    "pipeline schedules": Family("tp.pipeline.schedules", "SCHEDULES"),
    "context-parallel attention modes": Family("tp.context", "MODES"),
    "router score functions": Family("tp.moe.router", "SCORES"),
    "token dispatchers": Family("tp.moe.dispatch", "DISPATCHERS"),
    "data-parallel modes": Family("models.training.data_parallel", "MODES"),
    "recompute granularities": Family("models.recompute", "GRANULARITIES"),
    "recompute modules": Family("models.recompute", "MODULES"),
    "recompute methods": Family("models.recompute", "METHODS"),
    "learning-rate decay styles": Family("models.training.lr_decay", "DECAY_STYLES"),
    "kernels backends": Family("kernels.ops", "BACKENDS"),
    "fp8 recipes": Family("kernels.fp8", "FP8_RECIPES"),
    "model shapes": Family("models.presets", "MODELS"),
    "data formats": Family("models.training.data.formats", "FORMATS"),
    "Hugging Face families": Family("tp.hf.registry", "FAMILIES"),
}
# Literals that hold two of a family's names without listing its variants: {(family, file): why}. An entry that
# matches nothing any more must go.
NOT_DECLARATIONS = {
    ("kernels backends", "bench/gpu_check.py"): "the torch and triton packages' versions",
    ("kernels backends", "bench/grouped.py"): "the grouped GEMM's two paths (kernels.ops.backend_for's answers), "
                                              "not the backends' list",
    ("kernels backends", "kernels/grouped.py"): "its two implementations, by kernels.ops.backend_for's answer",
    ("context-parallel attention modes", "bench/attention.py"): "the time modelled for each mode, a formula per "
                                                                "mode (test_the_attention_model_covers_every_mode)",
}
# Registries collecting objects that spell their own names, each in its own module (Family("llama") in
# tp/hf/llama.py): no literal anywhere may list two of the names, the registry's module included.
SPELLED_BY_MEMBERS = {"Hugging Face families"}


def _registry(family):
    module, name = FAMILIES[family]
    return getattr(importlib.import_module(module), name)


def _file(module):
    return Path(importlib.import_module(module).__file__).relative_to(ROOT).as_posix()


def _declared(tree, names):
    """Line numbers of the collection literals in `tree` holding two or more of `names`."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            items = node.elts
        elif isinstance(node, ast.Dict):
            items = [key for key in node.keys if key is not None]
        else:
            continue
        if len({item.value for item in items if isinstance(item, ast.Constant) and item.value in names}) >= 2:
            lines.append(node.lineno)
    return sorted(lines)


def _declarations(names):
    """{file: [lines]} of the product's collection literals holding two or more of `names`."""
    return {path: lines for path, tree in TREES.items() if (lines := _declared(tree, set(names)))}


def test_a_literal_of_two_names_is_a_declaration():
    source = ('A = ("gpipe", "zb")\nif s in ("1f1b", "zb"): pass\nB = {"zb": f, "1f1b": g}\n'
              'C = ["zb", "zb"]\nD = ("zb", "x")\nE = "gpipe" if v else "1f1b"\n')
    assert _declared(ast.parse(source), {"gpipe", "1f1b", "zb"}) == [1, 2, 3]


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_is_declared_once_by_its_registry(family):
    registry, home = _registry(family), _file(FAMILIES[family].module)
    assert isinstance(registry, dict), f"{family}: {FAMILIES[family]} is not a dict"
    assert len(registry) >= 2
    found = _declarations(registry)
    assert home in found or family in SPELLED_BY_MEMBERS, \
        f"{family}: {home} does not spell out {FAMILIES[family].registry}'s names"
    elsewhere = [f"{path}:{line}" for path, lines in found.items() for line in lines
                 if path != home and (family, path) not in NOT_DECLARATIONS]
    assert not elsewhere, (f"{family}: their names are declared again, derive them from "
                           f"{FAMILIES[family].module}.{FAMILIES[family].registry}: {', '.join(elsewhere)}")
    stale = [path for fam, path in NOT_DECLARATIONS if fam == family and path not in found]
    assert not stale, f"{family}: NOT_DECLARATIONS lists {stale}, which no longer spell out the names: drop them"


def _choices(flag_dest):
    from models.training.cli import parser

    return next(action.choices for action in parser()._actions if action.dest == flag_dest)


def _plan_choices(flag_dest):
    from bench.plan.cli import parser

    return next(action.choices for action in parser()._actions if action.dest == flag_dest)


def _accepted(family):
    """{where: the names it accepts} of the upper floors that read `family`."""
    from bench import attention, train
    from bench.plan import memory
    from models import config as model
    from models.training import config as job

    return {
        "pipeline schedules": {"job": job.PIPELINE_SCHEDULES, "--schedule": _choices("schedule"),
                               "bench.plan": memory.SCHEDULES, "bench.train": train.SCHEDULES},
        "context-parallel attention modes": {"GPTConfig": model.CP_MODES, "--cp-mode": _choices("cp_mode"),
                                             "bench.attention": attention.MODES},
        "router score functions": {"GPTConfig": model.MOE_SCORES, "job": job.MOE_SCORES,
                                   "--moe-router-score": _choices("moe_router_score")},
        "token dispatchers": {"GPTConfig": model.MOE_DISPATCHERS, "job": job.MOE_DISPATCHERS,
                              "--moe-dispatcher": _choices("moe_dispatcher")},
        "data-parallel modes": {"job": job.DP_MODES, "--dp-mode": _choices("dp_mode"), "bench.plan": memory.DP_MODES},
        "recompute granularities": {"GPTConfig": model.RECOMPUTE, "--recompute": _choices("recompute"),
                                    "bench.plan": memory.RECOMPUTE},
        "recompute modules": {"GPTConfig": model.RECOMPUTE_MODULES,
                              "--recompute-modules": _choices("recompute_modules")},
        "recompute methods": {"GPTConfig": model.RECOMPUTE_METHODS,
                              "--recompute-method": _choices("recompute_method")},
        "learning-rate decay styles": {"job": job.LR_DECAY_STYLES, "--lr-decay-style": _choices("lr_decay_style")},
        "kernels backends": {"bench.plan's own": memory.BACKENDS[:-1]},
        "fp8 recipes": {"GPTConfig": model.FP8_RECIPES, "job": job.FP8_RECIPES, "--fp8-recipe": _choices("fp8_recipe")},
        "model shapes": {"--model": _choices("model"), "bench.plan --model": _plan_choices("model")},
        "data formats": {},  # (no flag names them: each source's format is detected)
        "Hugging Face families": {},  # (read by tp.parallelize and models.hf through the registry itself)
    }[family]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_upper_floors_accept_the_registrys_names(family):
    names = tuple(_registry(family))
    for where, accepted in _accepted(family).items():
        assert tuple(accepted) == names, f"{family}: {where} accepts {tuple(accepted)}, the registry has {names}"


def test_the_schedule_kinds_say_what_their_schedules_do():
    """What the planner and the benchmarks read off a ScheduleKind holds for the schedules it builds."""
    from tp.pipeline.schedules import SCHEDULES, ScheduleError, build, simulate

    for name, kind in SCHEDULES.items():
        for p, m in ((2, 4), (4, 8), (3, 3)):
            v = 2 if kind.interleaves else 1
            timeline = simulate(build(name, p, m, v))
            assert timeline.schedule.split_backward == kind.split_backward, name
            assert [kind.in_flight(p, r, v, m) for r in range(p)] == pytest.approx(timeline.peaks), name
            bubble = kind.bubble(p, m, v)
            assert timeline.bubble_fraction <= bubble + 1e-12 if kind.bubble_bound else \
                timeline.bubble_fraction == pytest.approx(bubble), name
        with pytest.raises(ScheduleError):
            build(name, 2, 4, 1 if kind.interleaves else 2)


def test_the_attention_model_covers_every_mode():
    from bench.attention import HARDWARE, model_row
    from tp.context import MODES

    row = model_row(HARDWARE["h100-nvlink"], 8192, 8, 32, 8, 128, 1e-5)
    assert [key for key in row if key.endswith("_ms") and key != "compute_ms"] == \
        [f"{mode.replace('+', '_')}_ms" for mode in MODES]


def _table(page, header):
    """The first cells of the markdown table under `header` in docs/`page`, without a trailing '(...)'."""
    text = (ROOT / "docs" / page).read_text()
    rows = text[text.index(header):].split("\n\n")[0].splitlines()[2:]
    return [re.sub(r" \(.*\)$", "", row.split("|")[1].strip()) for row in rows]


def test_the_docs_list_the_registries_variants():
    from tp.context import MODES
    from tp.pipeline.schedules import SCHEDULES

    assert _table("pipeline.md", "| schedule | bubble |") == [kind.title for kind in SCHEDULES.values()]
    cp = (ROOT / "docs" / "sequence-context-parallel.md").read_text()
    assert re.findall(r'^- `mode="([^"]+)"`', cp, re.M) == list(MODES)
