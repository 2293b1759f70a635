"""The exit statuses of every ``kvdaemon`` command, and which error gives which.

====  ==============================================================================
0     done (also: ``stop`` with no daemon running, ``wake`` of an awake tenant,
      ``sleep`` of a tenant already asleep in that mode: they say so and change nothing)
1     no daemon runs at the directory (``UNREACHABLE``)
2     usage or configuration error: a bad flag or value, a config file that does not
      parse, a capacity larger than the device, an unsafe or unusable directory
      (``USAGE``, ``CONFIG``, ``UNSAFE_DIR``)
3     the daemon refused or failed: its error code is printed (``UNKNOWN_TENANT``,
      ``CONFLICT``, ``ASLEEP``, ``LIFECYCLE``, ...)
4     a daemon runs there (it holds the directory's lock) but did not answer in time
      (``NOT_ANSWERING``)
5     ``kvdaemon wait`` timed out (``TIMEOUT``)
====  ==============================================================================
"""

from __future__ import annotations

from kvdaemon.errors import (
    ConfigError, DaemonUnreachable, KVDaemonError, NotAnswering, WaitTimeout,
)  # fmt: skip

EXIT_OK = 0
EXIT_UNREACHABLE = 1
EXIT_USAGE = 2
EXIT_DAEMON_ERROR = 3
EXIT_NOT_ANSWERING = 4
EXIT_TIMEOUT = 5

STATUS_WORDS = {
    EXIT_OK: "done",
    EXIT_UNREACHABLE: "no daemon running",
    EXIT_USAGE: "usage or configuration error",
    EXIT_DAEMON_ERROR: "the daemon refused (its error code is printed)",
    EXIT_NOT_ANSWERING: "a daemon runs but does not answer",
    EXIT_TIMEOUT: "wait timed out",
}


def statuses(*codes: int, **words: str) -> str:
    """A command's ``Exit status: 0 done; ...`` line, of the statuses it can exit with;
    ``words`` (``s0=...``) says one in the command's own terms."""
    said = "; ".join(f"{code} {words.get(f's{code}', STATUS_WORDS[code])}" for code in codes)
    return f"Exit status: {said}."


EPILOG = statuses(EXIT_OK, EXIT_UNREACHABLE, EXIT_USAGE, EXIT_DAEMON_ERROR, EXIT_NOT_ANSWERING, EXIT_TIMEOUT)
TALKING = statuses(EXIT_OK, EXIT_UNREACHABLE, EXIT_USAGE, EXIT_DAEMON_ERROR, EXIT_NOT_ANSWERING)
"""The statuses of a command that asks the running daemon once (all but ``wait``'s timeout)."""


def exit_code_of(error: KVDaemonError) -> int:
    """The exit status for ``error`` (see the module docstring)."""
    if isinstance(error, NotAnswering):
        return EXIT_NOT_ANSWERING
    if isinstance(error, DaemonUnreachable):
        return EXIT_UNREACHABLE
    if isinstance(error, ConfigError):
        return EXIT_USAGE
    if isinstance(error, WaitTimeout):
        return EXIT_TIMEOUT
    return EXIT_DAEMON_ERROR
