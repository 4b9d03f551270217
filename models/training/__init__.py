"""The training job behind `python -m models.train`: command line, launcher, per-rank trainer, data, checkpoints."""
