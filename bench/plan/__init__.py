"""The parallelism planner (`python -m bench.plan`): per-GPU memory (memory.py) and step time (step_time.py) of
every split of a model on a cluster, searched and ranked (cli.py), validated on published runs (validation.py)."""
