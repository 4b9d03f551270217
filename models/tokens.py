"""`python -m models.tokens`: text tokenized once into a token file (models/training/tokens.py)."""
import sys

from .training.tokens import main

if __name__ == "__main__":
    sys.exit(main())
