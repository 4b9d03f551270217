"""A local Hugging Face tokenizer directory (--tokenizer DIR, or a --from-hf model's own), never downloaded."""
import functools
import os
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")  # any one of them


@functools.lru_cache(maxsize=8)
def load_tokenizer(directory: str) -> Any:
    """transformers.AutoTokenizer of a local directory (no downloads); one-line errors."""
    if not os.path.isdir(directory):
        raise ValueError(f"--tokenizer {directory}: no such directory (a Hugging Face tokenizer directory)")
    try:
        import transformers
    except ImportError:
        raise ValueError(f"--tokenizer {directory}: reading a tokenizer needs transformers (pip install -e "
                         "'.[hf]')") from None
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        if not has_tokenizer(directory):
            raise ValueError(f"--tokenizer {directory} holds no tokenizer files ({', '.join(TOKENIZER_FILES[:-1])} "
                             f"or {TOKENIZER_FILES[-1]})") from None
        said = " ".join(str(e).split()) or type(e).__name__  # (transformers' lines, joined into one)
        raise ValueError(f"--tokenizer {directory}: cannot load a tokenizer: {said}") from None
    if tokenizer.eos_token_id is None:
        raise ValueError(f"--tokenizer {directory}: the tokenizer has no EOS token to end documents with: name one "
                         "(eos_token in its tokenizer_config.json)")
    return tokenizer


def tokenizer_vocab_size(tokenizer: Any) -> int:
    """Ids the tokenizer can emit: its vocabulary with the added tokens."""
    return max(len(tokenizer), max(tokenizer.get_vocab().values(), default=-1) + 1)


def has_tokenizer(directory: str) -> bool:
    """Whether a (Hugging Face model) directory holds tokenizer files."""
    return any(os.path.isfile(os.path.join(directory, name)) for name in TOKENIZER_FILES)
