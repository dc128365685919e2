"""`python -m nanochat.dataset`, the command the docs give, runs nanochat/data/dataset.py (where the code lives)."""

import sys

from nanochat.data.dataset import main

if __name__ == "__main__":
    sys.exit(main())
