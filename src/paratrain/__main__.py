"""`python -m paratrain ...` and `torchrun ... -m paratrain train cfg.yaml`."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
