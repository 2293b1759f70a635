"""The policies set with ``kvdaemon limit``, kept in ``policies.json`` in the daemon directory.

Format (version 1), one object::

    {"version": 1, "tenants": {"llama-a": {"max": "40%", "min": "none", "weight": 2.0}}}

A field missing from a tenant's object is unset there (the config file's value
applies); ``"none"`` removes it (see ``kvdaemon.daemon.policies``).

``write_policies`` replaces the file whole and atomically: a fresh temporary
file (``O_EXCL | O_NOFOLLOW``, mode 0600) is written, flushed to disk and
renamed over the old one, so a crash leaves the old file or the new one, never
a mix. ``read_policies`` opens without following symlinks and reads at most
``MAX_FILE_BYTES``. Only the daemon holding the directory's lock touches it.
Cost: one small file read at start, one write per ``set_limit``.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvdaemon.daemon.policies import Policy, parse_policy
from kvdaemon.daemon.tenant import check_name
from kvdaemon.errors import ConfigError, KVDaemonError

FILE_NAME = "policies.json"
FILE_MODE = 0o600
FORMAT_VERSION = 1
MAX_FILE_BYTES = 1 << 20


def policy_path(root: Path) -> Path:
    """Where the daemon at directory ``root`` keeps its operator policies."""
    return root / FILE_NAME


def read_policies(path: Path) -> dict[str, Policy]:
    """The policies kept at ``path``; none when it does not exist.

    Raises ``ConfigError`` (the daemon then refuses to start, exit 2) for a file
    that is a symlink, too large, not JSON or not this format, saying how to
    recover: nothing is dropped without the operator's word.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return {}
    except OSError as err:
        raise _unreadable(path, err.strerror or str(err)) from err
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # before fdopen, which refuses a directory
        os.close(fd)
        raise _unreadable(path, "not a regular file")
    with os.fdopen(fd, "rb") as stream:
        data = stream.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise _unreadable(path, f"larger than {MAX_FILE_BYTES} bytes")
    try:
        document = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _unreadable(path, f"not JSON ({err})") from err
    return _parsed(path, document)


def _parsed(path: Path, document: Any) -> dict[str, Policy]:
    if not isinstance(document, dict) or document.get("version") != FORMAT_VERSION:
        raise _unreadable(path, f"not a version {FORMAT_VERSION} policy file")
    tenants = document.get("tenants")
    if not isinstance(tenants, dict):
        raise _unreadable(path, "'tenants' is not an object")
    policies: dict[str, Policy] = {}
    for name, raw in tenants.items():
        try:
            check_name(name)
        except KVDaemonError as err:
            raise _unreadable(path, err.message) from err
        if not isinstance(raw, dict):
            raise _unreadable(path, f"the policy of {name!r} is not an object")
        try:
            policies[name] = parse_policy(raw, f"tenant {name!r}")
        except ConfigError as err:
            raise _unreadable(path, err.message) from err
    return policies


def _unreadable(path: Path, why: str) -> ConfigError:
    return ConfigError(
        f"cannot use the policy file {path}: {why}; fix it, or remove it to forget the "
        "policies set with `kvdaemon limit` (the config file's [tenants] still apply)"
    )


def write_policies(path: Path, policies: Mapping[str, Policy]) -> None:
    """Replace the file at ``path`` with ``policies``, atomically (module docstring).

    Raises ``KVDaemonError`` with the OS's reason when it cannot; the old file is
    then unchanged.
    """
    document = {
        "version": FORMAT_VERSION,
        "tenants": {name: policies[name].to_json() for name in sorted(policies)},
    }
    partial = path.with_name(path.name + ".tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        partial.unlink(missing_ok=True)  # a leftover of a crash; the daemon holds the dir's lock
        with os.fdopen(os.open(partial, flags, FILE_MODE), "w", encoding="utf-8") as stream:
            json.dump(document, stream, indent=2, sort_keys=True)
            stream.write("\n")
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(partial, path)
        _sync_dir(path.parent)
    except OSError as err:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
        raise KVDaemonError(
            f"cannot keep the policy in {path}: {err.strerror or err}; nothing changed"
        ) from err


def _sync_dir(directory: Path) -> None:
    """Make the rename durable: flush the directory entry to disk."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
