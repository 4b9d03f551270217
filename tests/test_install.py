"""The installed package beside its dependencies, from a user's directory: tp-layers' top-level `kernels` shares its
import name with Hugging Face's `kernels` distribution (transformers 5.25 requires it), so setup.py keeps transformers
below 5.25, and `import tp` names a foreign `kernels` in one line instead of failing deep inside tp."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytest.importorskip("transformers")


def run_python(code: str, cwd: Path, path: str | None = str(ROOT)) -> subprocess.CompletedProcess:
    """`python -c code` in cwd with this checkout on the path (path=None: the path as the cwd and install give it)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | ({"PYTHONPATH": path} if path else {})
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env=env)


def test_tp_and_a_transformers_model_import_from_outside_the_checkout(tmp_path):
    done = run_python(
        "import kernels, tp, models\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "LlamaForCausalLM(LlamaConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1,"
        " num_attention_heads=2, vocab_size=16))\n"
        "print(kernels.__file__)", tmp_path)
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).resolve() == ROOT / "kernels" / "__init__.py"


def test_a_foreign_kernels_package_first_on_the_path_is_named_in_one_line(tmp_path):
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("CUDAProperties = None\n")  # what Hugging Face's exports
    done = run_python(f"import sys; sys.path.insert(1, {str(ROOT)!r}); import tp", tmp_path, path=None)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: tp-layers needs its own `kernels` package"), done.stderr
    assert str(tmp_path / "kernels" / "__init__.py") in last and "transformers<5.25" in last
