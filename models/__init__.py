"""Models built from the tensor-parallel layers: GPTConfig, TransformerBlock, GPT (and the training job)."""
from .block import MLP, Attention, Norm, TransformerBlock
from .config import GPTConfig
from .gpt import GPT

__all__ = ["GPTConfig", "GPT", "TransformerBlock", "Attention", "MLP", "Norm"]
