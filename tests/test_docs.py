"""Every code block of the README and docs/ runs as written; the pages are short, linked and fit 120 columns.

Python blocks open with `# run: COMMAND FILE.py`, the command a user types:
- `python FILE.py`: run in one process (the blocks of this kind share one interpreter, run one after the other);
- `torchrun --nproc-per-node N FILE.py`: run on N ranks (gloo, OMP_NUM_THREADS=1); the blocks with the same N share
  one launch (`python -m torch.distributed.run --standalone --nproc-per-node N`), in which every rank runs them one
  after the other (this file's `__main__`), as if each were its own script;
- `python -m pytest FILE.py`: that command (every such block's file in one run of it: each file's tests pass).
A comment `# prints: TEXT` (or `# rank R prints: TEXT`) says a line rank 0 (rank R) prints, or its start when TEXT
ends in "...": the test checks it.

Bash blocks follow a marker: `<!-- test: run -->` runs every command for real, in order, in one temporary directory
(cheap ones only: `--help`, a planner call, a 2-step job); `<!-- test: parse -->` hands each command's arguments to
the program's own argument parser (torchrun's too) and stops there, for commands too slow to run here (benchmarks,
full training runs, multi-node launches); `<!-- test: sbatch -->` marks an sbatch script, which tests/test_slurm.py
runs on two simulated nodes of this machine. The README's first block, the set-up, is checked against .ci/run instead
(which runs its test command first, verbatim).
"""
import argparse
import contextlib
import json
import os
import re
import runpy
import shlex
import subprocess
import sys
import warnings
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN_LINE = re.compile(r"# run: (torchrun --nproc-per-node (\d+)|python -m pytest|python) (\w+\.py)")
PRINTS = re.compile(r"# (?:rank (\d+) )?prints: (.*?)\s*$")
TIMEOUT = 900  # seconds per launch, on a machine busy with other tests


def _blocks(page):
    """(language, marker, code) of every fenced block of `page`; marker: the `<!-- test: ... -->` just before."""
    text = page.read_text()
    return [(m["lang"], m["marker"], m["code"]) for m in re.finditer(
        r"(?:<!-- test: (?P<marker>\w+) -->\n)?```(?P<lang>\w*)\n(?P<code>.*?)```", text, re.S)]


def _python_blocks():
    """{file name: (run command, N ranks or None, code)} of every python block."""
    blocks = {}
    for page in PAGES:
        for lang, _, code in _blocks(page):
            if lang != "python":
                continue
            match = RUN_LINE.fullmatch(code.splitlines()[0])
            assert match, f"{page.name}: a python block must open with `# run: COMMAND FILE.py`:\n{code}"
            command, ranks, name = match.groups()
            assert name not in blocks, f"{page.name}: two python blocks named {name}"
            blocks[name] = (command, ranks and int(ranks), code)
    return blocks


def _env():
    """A user's environment on a CPU machine (the examples' setting, on a GPU machine too): no torchrun variables,
    none of the suite's settings (tests/conftest.py), no GPU."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TRITON_INTERPRET", "TP_KERNELS_BACKEND")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return env | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}


def _run(args, cwd):
    result = subprocess.run(args, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode == 0, f"{shlex.join(map(str, args))} failed:\n{result.stdout[-3000:]}\n" \
                                   f"{result.stderr[-5000:]}"
    return result


def _check_prints(name, code, outputs):
    """Every `# prints:` comment of the block against the rank's output of it."""
    for line in code.splitlines():
        if match := PRINTS.search(line):
            rank, text = int(match[1] or 0), match[2]
            lines = [out.strip() for out in outputs[rank].splitlines()]  # (TEXT ending in "...": a line's start)
            found = any(out.startswith(text[:-3]) for out in lines) if text.endswith("...") else text in lines
            assert found, f"{name}: rank {rank} should print the line {text!r}, printed:\n{outputs[rank]}"


def _run_python_blocks(tmp_path, selected, launcher):
    for name, (_, _, code) in selected.items():
        (tmp_path / name).write_text(code)
    _run([*launcher, str(Path(__file__)), *selected], tmp_path)
    for name, (_, ranks, code) in selected.items():
        _check_prints(name, code, [(tmp_path / f"{name}.rank{r}.out").read_text() for r in range(ranks or 1)])


def test_readme_opens_with_the_two_commands_ci_runs():
    text = (ROOT / "README.md").read_text()
    commands = re.search(r"```bash\n(.*?)```", text, re.S).group(1).strip().splitlines()
    assert [c.split("#")[0].strip() for c in commands] == [
        'pip install torch==2.13.0 -e . && python -m models.train',
        'pip install torch==2.13.0 -e ".[test]" && python -m pytest']
    # .ci/run: the README's command first, verbatim with `ruff check .` between its parts, then nothing but passes
    # of the suite's own files again on torch's baseline CPU kernels (another machine's rounding: issue 40)
    script = (ROOT / ".ci" / "run").read_text().replace("\\\n", " ")
    ci = [" ".join(line.split()) for line in script.splitlines() if line and not line.startswith(("#", "set ", "cd "))]
    parts = commands[1].split("#")[0].strip().split(" && ")
    assert ci[0] == " && ".join([parts[0], "ruff check .", *parts[1:]]), ci[0]
    assert len(ci) > 1, ".ci/run lost its pass of the numerically sensitive files on ATEN_CPU_CAPABILITY=default"
    for line in ci[1:]:
        assert re.fullmatch(r"ATEN_CPU_CAPABILITY=default python -m pytest( tests/test_\w+\.py(::\w+)?)+", line), line
        assert all((ROOT / path).is_file() for path in re.findall(r"tests/test_\w+\.py", line)), line
    _parse("python -m models.train")  # (the set-up's job, as its parser reads it)


def test_the_readme_is_short_and_links_every_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) < 12000
    linked = re.findall(r"\]\(docs/([\w-]+\.md)\)", readme)
    assert sorted(linked) == sorted(p.name for p in PAGES[1:]), "the README's table must link every docs page once"


def test_pages_fit_120_columns_link_what_exists_and_cite_no_private_notes():
    for page in PAGES:
        text = page.read_text()
        long = [n for n, line in enumerate(text.splitlines(), 1) if len(line.encode()) > 120]
        assert not long, f"{page.name}: lines over 120 bytes: {long}"
        assert "REFERENCE" not in text, f"{page.name} cites REFERENCE.md, which users do not have"
        for target, anchor in re.findall(r"\]\((?!https?:)([^)#]*)(?:#([^)]*))?\)", text):
            path = (page.parent / target).resolve() if target else page
            assert path.exists(), f"{page.name}: broken link {target}"
            if anchor:
                headings = re.findall(r"^#+ (.*)$", path.read_text(), re.M)
                slugs = {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}
                assert anchor in slugs, f"{page.name}: no heading #{anchor} in {path.name}"


def test_every_block_says_how_it_is_tested():
    for page in PAGES:
        blocks = _blocks(page)
        for i, (lang, marker, code) in enumerate(blocks):
            assert lang in ("python", "bash"), f"{page.name}: a ```{lang} block cannot be run:\n{code}"
            if lang == "bash" and not (page.name == "README.md" and i == 0):
                assert marker in ("run", "parse", "sbatch"), \
                    f"{page.name}: mark the bash block <!-- test: run|parse|sbatch -->:\n{code}"
    assert _python_blocks()  # every python block opens with its `# run:` line


def test_single_process_blocks_run(tmp_path):
    blocks = {n: b for n, b in _python_blocks().items() if b[0] == "python"}
    _run_python_blocks(tmp_path, blocks, [sys.executable])


def test_multi_rank_blocks_run_under_torchrun(tmp_path):
    blocks = {n: b for n, b in _python_blocks().items() if b[0].startswith("torchrun")}
    assert "mlp.py" in blocks  # the README's (tests/test_launch.py runs it without torchrun)
    for ranks in sorted({b[1] for b in blocks.values()}):
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
        _run_python_blocks(tmp_path, {n: b for n, b in blocks.items() if b[1] == ranks}, launch)


def test_pytest_blocks_run(tmp_path):
    """Every `python -m pytest FILE.py` block's file in one pytest run (one interpreter and one pool of warm ranks
    instead of one each; the files share no state): each file's tests all pass."""
    blocks = {name: code for name, (command, _, code) in _python_blocks().items() if command == "python -m pytest"}
    for name, code in blocks.items():
        (tmp_path / name).write_text(code)
    names = list(blocks)
    out = _run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", *names], tmp_path).stdout
    for name in names:
        assert re.search(rf"^{re.escape(name)}::\S+ PASSED", out, re.M), f"{name}: no test passed:\n{out[-3000:]}"


def _commands(code):
    """Each command of a bash block as its words: continuation lines joined, comments dropped, `&&` split."""
    for line in code.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        while words:
            end = words.index("&&") if "&&" in words else len(words)
            yield words[:end]
            words = words[end + 1:]


def _bash_commands(marker):
    return [c for page in PAGES for lang, m, code in _blocks(page) if lang == "bash" and m == marker
            for c in _commands(code)]


def test_bash_blocks_run(tmp_path):
    """The commands in order, each as `python -m` runs it (its module as `__main__` with its arguments in sys.argv), in
    two interpreters at once (each pays its imports once): the models' commands (a job's checkpoint feeds the next
    one's --load), and the others (the planner's searches and the benchmarks, which read no job's files)."""
    commands = _bash_commands("run")
    assert commands
    for words in commands:
        assert words[:2] == ["python", "-m"], f"only `python -m ...` commands run here: {shlex.join(words)}"
    jobs = [words[2:] for words in commands if words[2].startswith("models.")]
    others = [words[2:] for words in commands if not words[2].startswith("models.")]
    runs = []  # (each chain's output to files: a full pipe would stall it while the other is waited for)
    try:
        for name, chain in (("jobs", jobs), ("others", others)):
            with open(tmp_path / f"{name}.out", "w") as out:
                runs.append((name, subprocess.Popen([sys.executable, str(Path(__file__)), "--modules",
                                                     json.dumps(chain)], cwd=tmp_path, env=_env(), stdout=out,
                                                    stderr=subprocess.STDOUT)))
        for name, run in runs:
            run.wait(timeout=TIMEOUT)
            output = (tmp_path / f"{name}.out").read_text()
            assert run.returncode == 0, f"the {name}' commands failed:\n{output[-6000:]}"
    finally:
        for _, run in runs:
            run.kill()


class _Parsed(Exception):
    """Raised by the patched ArgumentParser.parse_args: the program's arguments parsed, nothing run."""


def _parse_with_program(module, args):
    """`python -m module *args` up to its parse_args: argparse's verdict on the arguments, nothing executed."""
    parse_args = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, args=None, namespace=None):
        raise _Parsed(parse_args(self, args, namespace))

    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_and_stop), \
            mock.patch.object(sys, "argv", [module, *args]), warnings.catch_warnings():
        # (this process imported the module already, which `python -m` would not have: runpy's warning says so)
        warnings.filterwarnings("ignore", r"'.*' found in sys\.modules after import of package", RuntimeWarning)
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except _Parsed as parsed:
            return parsed.args[0]
        except SystemExit as e:
            command = shlex.join(["python", "-m", module, *args])
            raise AssertionError(f"{command}: refused by its parser (exit {e.code})") from None
    raise AssertionError(f"python -m {module} returned without parsing its arguments")


def _parse(command):
    words = shlex.split(command) if isinstance(command, str) else command
    if words[:2] == ["python", "-m"]:
        return _parse_with_program(words[2], words[3:])
    assert words[0] == "torchrun", f"no parser known for {shlex.join(words)}"
    from torch.distributed.run import get_args_parser

    try:
        launch = get_args_parser().parse_args(words[1:])
    except SystemExit as e:
        raise AssertionError(f"{shlex.join(words)}: refused by torchrun's parser (exit {e.code})") from None
    assert launch.module, f"{shlex.join(words)}: the docs launch modules (-m)"
    return _parse_with_program(launch.training_script, launch.training_script_args)


def test_bash_blocks_parse():
    commands = _bash_commands("parse")
    assert commands
    for words in commands:
        _parse(words)


def _run_scripts(names):
    """(Run by the tests, on each rank:) every script in turn as `__main__`, this rank's stdout to NAME.rankR.out."""
    rank = int(os.environ.get("RANK", 0))
    for name in names:
        with open(f"{name}.rank{rank}.out", "w") as out, contextlib.redirect_stdout(out):
            sys.argv = [name]
            runpy.run_path(name, run_name="__main__")


def _run_modules(commands):
    """(Run by test_bash_blocks_run:) each `python -m MODULE ARGS` in turn; the first that exits non-zero ends the
    run, named."""
    for module, *args in commands:
        sys.argv = [module, *args]
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as e:
            if e.code not in (None, 0):
                sys.exit(f"`python -m {shlex.join([module, *args])}` exited with {e.code}")


if __name__ == "__main__":
    if sys.argv[1] == "--modules":
        _run_modules(json.loads(sys.argv[2]))
    else:
        _run_scripts(sys.argv[1:])
