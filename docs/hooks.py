"""mkdocs hooks: the Reference pages made from the code when the site is built (the config keys
from config.py's field docstrings, the command line from the argparse parser), and docs/gpu.md
put in the nav when it exists."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

from paratrain.cli_docs import cli_markdown
from paratrain.config import TrainConfig
from paratrain.config.docs import reference_markdown

GENERATED = {"reference/config.md": lambda: reference_markdown(TrainConfig),
             "reference/cli.md": cli_markdown}


def on_config(config):
    """docs/gpu.md (GPU figures) joins the Benchmarks section when the file is there."""
    if (Path(config["docs_dir"]) / "gpu.md").is_file():
        for entry in config["nav"]:
            if isinstance(entry, dict) and "Benchmarks" in entry:
                entry["Benchmarks"].append({"On GPUs": "gpu.md"})
    return config


def on_files(files, config):
    for uri, make in GENERATED.items():
        files.append(File.generated(config, uri, content=make()))
    return files
