"""The ``kvdaemon`` command line."""

from __future__ import annotations

import click

from kvdaemon import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvdaemon")
def main() -> None:
    """kvdaemon: elastic, multi-tenant KV-cache memory for LLM serving."""
