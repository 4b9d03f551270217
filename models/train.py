"""`python -m models.train`: the training job (models/training/; `--help` lists every flag)."""
from .training.cli import entry
from .training.launch import use_srun_tasks

if __name__ == "__main__":
    use_srun_tasks()  # (srun's tasks, one per GPU: the ranks, as torchrun's would be)
    entry()
