"""Every error kvdaemon raises, each with a stable wire code.

All errors derive from :class:`KVDaemonError`. The ``code`` class attribute is
the string that crosses the control channel; it never changes once released, so
clients and tests may match on it. ``from_code`` rebuilds the matching class on
the client side.
"""

from __future__ import annotations


class KVDaemonError(Exception):
    """Root of every kvdaemon error. ``code`` is the stable wire code; ``from_daemon``: the
    daemon's own answer (rebuilt by ``from_code``), not a failure to reach it."""

    code: str = "INTERNAL"
    from_daemon: bool = False

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BadRequest(KVDaemonError):
    """A request is malformed: wrong shape, type or range of a field."""

    code = "BAD_REQUEST"


class UnknownOp(KVDaemonError):
    """A request names an op the daemon does not have."""

    code = "UNKNOWN_OP"


class UnknownTenant(KVDaemonError):
    """A request names a tenant that is not registered."""

    code = "UNKNOWN_TENANT"


class Forbidden(KVDaemonError):
    """The caller lacks the token or uid the op needs."""

    code = "FORBIDDEN"


class NoMemory(KVDaemonError):
    """The pool has too few free pages to grant the request."""

    code = "NO_MEMORY"


class OverLimit(KVDaemonError):
    """Granting the request would take a tenant past its ``max_bytes``."""

    code = "OVER_LIMIT"


class Asleep(KVDaemonError):
    """The tenant is sleeping; wake it first."""

    code = "ASLEEP"


class Conflict(KVDaemonError):
    """The request conflicts with current state (name taken, stale revision)."""

    code = "CONFLICT"


class StaleRevision(KVDaemonError):
    """A revisioned request is older than the state it would change."""

    code = "STALE"


class VersionMismatch(KVDaemonError):
    """Client and daemon speak different protocol versions."""

    code = "VERSION_MISMATCH"


class DaemonUnreachable(KVDaemonError):
    """No daemon answered at the given directory within the timeout."""

    code = "UNREACHABLE"


class NoReply(DaemonUnreachable):
    """A daemon did not answer this request in time.

    Not a decision: the request may still be carried out (a sleep still
    completes, a late grant is adopted or given back by the client).
    """

    code = "NO_REPLY"


class NotAnswering(NoReply):
    """A daemon holds the directory's lock (it runs) but did not answer in time (CLI exit 4)."""

    code = "NOT_ANSWERING"


class PoolExhausted(KVDaemonError):
    """A KV pool cannot hand out the blocks asked for; nothing was allocated."""

    code = "POOL_EXHAUSTED"


class PoolClosed(KVDaemonError):
    """The pool (or client) was closed, or its lease revoked by the daemon; it serves nothing more."""

    code = "POOL_CLOSED"


class ConfigError(KVDaemonError):
    """A configuration value (flag, env variable, file) is invalid."""

    code = "CONFIG"


class UnsafeDirectory(ConfigError):
    """A daemon directory is not private: not ours, not mode 0700, a symlink, or not a
    directory at all. Nothing is created in it, and its mode is left alone."""

    code = "UNSAFE_DIR"


class WaitTimeout(KVDaemonError):
    """What was waited for (a tenant to register, to go idle) did not happen in time."""

    code = "TIMEOUT"


class LifecycleError(KVDaemonError):
    """Starting or stopping a daemon process failed: it exited early, or did not
    accept clients or exit within the timeout. The message carries the reason
    (for a failed start, the tail of the daemon's log)."""

    code = "LIFECYCLE"


class Unsupported(KVDaemonError):
    """An engine, its version or its configuration is outside what an integration supports."""

    code = "UNSUPPORTED"


class BackendError(KVDaemonError):
    """A virtual-memory backend operation failed.

    ``driver_code`` carries the underlying error: the CUDA driver's error name
    (``"CUDA_ERROR_OUT_OF_MEMORY"``), an errno name (``"EINVAL"``), or ``None``
    when the backend itself refused the call before reaching the OS or driver.
    """

    code = "BACKEND_ERROR"

    def __init__(self, message: str, driver_code: str | None = None) -> None:
        super().__init__(message if driver_code is None else f"{message} [{driver_code}]")
        self.driver_code = driver_code


_BY_CODE: dict[str, type[KVDaemonError]] = {
    cls.code: cls
    for cls in (
        KVDaemonError,
        BadRequest,
        UnknownOp,
        UnknownTenant,
        Forbidden,
        NoMemory,
        OverLimit,
        Asleep,
        Conflict,
        StaleRevision,
        VersionMismatch,
        DaemonUnreachable,
        NoReply,
        NotAnswering,
        PoolExhausted,
        PoolClosed,
        ConfigError,
        UnsafeDirectory,
        WaitTimeout,
        LifecycleError,
        Unsupported,
        BackendError,
    )
}


def from_code(code: str, message: str) -> KVDaemonError:
    """Rebuild the error for a wire ``code``; unknown codes give the root class."""
    cls = _BY_CODE.get(code, KVDaemonError)
    error = cls.__new__(cls)
    KVDaemonError.__init__(error, message)
    error.from_daemon = True
    if isinstance(error, BackendError):
        error.driver_code = None
    return error
