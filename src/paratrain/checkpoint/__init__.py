"""Snapshots (when to save, writing, committing, finding, loading, inspecting, exporting),
the run-dir rule and the Hugging Face export."""
