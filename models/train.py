"""`python -m models.train`: the training job (models/training/; `--help` lists every flag)."""
from .training.cli import entry

if __name__ == "__main__":
    entry()
