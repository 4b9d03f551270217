"""The training job behind `python -m models.train`: its typed configuration, command line, launcher, per-rank
trainer, model build, data, checkpoints."""
