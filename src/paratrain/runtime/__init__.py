"""One rank's run: joining, building, the training loop, early stopping, the optimizer."""
