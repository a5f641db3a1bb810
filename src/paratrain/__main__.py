"""`python -m paratrain ...` and `torchrun ... -m paratrain train cfg.yaml`."""

from .cli import run

if __name__ == "__main__":
    run()
