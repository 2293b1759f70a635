"""The operator's tools: the ``kvdaemon`` command line, daemon lifecycle, status and top views."""

from kvdaemon.cli.commands import main

__all__ = ["main"]
