"""The names models/training/checkpoint.py imports from here, now in models.hf (experts.py): to go once it imports
them from models.hf."""
from .hf import disk_name, expert_names

__all__ = ["disk_name", "expert_names"]
