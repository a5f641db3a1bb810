"""What a run reports: metrics.jsonl, log lines and the bar, TensorBoard / W&B / MLflow,
report.png."""
