"""The README's examples run as written."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _block_after(heading):
    text = open(os.path.join(ROOT, "README.md")).read()
    return re.search(r"```python\n(.*?)```", text[text.index(heading):], re.S).group(1)


def test_readme_opens_with_the_two_commands_ci_runs():
    text = open(os.path.join(ROOT, "README.md")).read()
    commands = re.search(r"```bash\n(.*?)```", text, re.S).group(1).strip().splitlines()
    assert [c.split("#")[0].strip() for c in commands] == [
        'pip install torch==2.13.0 -e . && python -m models.train',
        'pip install torch==2.13.0 -e ".[test]" && python -m pytest']
    ci = open(os.path.join(ROOT, ".ci", "run")).read()  # the README's command, with `ruff check .` between its parts
    parts = commands[1].split("#")[0].strip().split(" && ")
    assert " && ".join([parts[0], "ruff check .", *parts[1:]]) in ci


def test_using_the_layers_snippet_runs_under_torchrun(tmp_path):
    script = tmp_path / "mlp.py"
    script.write_text(_block_after("## Using the layers"))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                             str(script)], capture_output=True, text=True, timeout=240,
                            env=env | {"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("(16, 2, 1024) (2048, 1024)") == 2, result.stdout
