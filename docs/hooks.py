"""mkdocs hooks: the Reference pages made from the code when the site is built (the config keys
from config/sections.py's field docstrings, the command line from the argparse parser)."""

from __future__ import annotations

from mkdocs.structure.files import File

from paratrain.cli_docs import cli_markdown
from paratrain.config import TrainConfig
from paratrain.config.docs import reference_markdown

GENERATED = {"reference/config.md": lambda: reference_markdown(TrainConfig),
             "reference/cli.md": cli_markdown}


def on_files(files, config):
    for uri, make in GENERATED.items():
        files.append(File.generated(config, uri, content=make()))
    return files
