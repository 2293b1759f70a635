"""Help texts: each command's --help has an example and the exit statuses; nothing is cut off."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from kvdaemon.cli.commands import main

COMMANDS = ("start", "stop", "status", "limit", "sleep", "wake", "wait", "top", "logs", "version")


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_help_has_an_example_and_the_exit_statuses(command: str) -> None:
    result = CliRunner().invoke(main, [command, "--help"], terminal_width=80)
    assert result.exit_code == 0
    assert "\n  Example:\n    kvdaemon " + command in result.output
    said = " ".join(result.output.split())
    statuses = said[said.index("Exit status: "):]
    assert statuses.startswith("Exit status: 0 ") and statuses.endswith(".")  # whole, not cut off
    assert ("5 wait timed out" in statuses) == (command == "wait")  # each lists what it can exit with
    assert ("1 no daemon running" in statuses) == (command not in ("start", "stop", "logs", "version"))
    assert ("3 " in statuses) == (command not in ("logs", "version"))
    assert "--dir" in result.output and "--config" in result.output
    if command != "top":
        assert "--json" in result.output


def test_main_help_lists_every_command_in_full_and_documents_completion() -> None:
    result = CliRunner().invoke(main, ["--help"], terminal_width=80)
    assert result.exit_code == 0
    listed = result.output.split("Commands:")[1]
    for command in COMMANDS:
        (line,) = [line for line in listed.splitlines() if line.split()[:1] == [command]]
        short = main.commands[command].short_help
        assert short and line.split(None, 1)[1] == short  # whole, not cut with "..."
        assert "..." not in line
    assert "_KVDAEMON_COMPLETE=bash_source kvdaemon" in " ".join(result.output.split())
