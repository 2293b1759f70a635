"""``PoolLock``: a pool's lock, and the block gate that keeps it off the engine's fast path.

Two things guard a pool's shared state:

- the **lock** (a ``threading.Lock``) serialises page moves, state changes and
  the daemon exchanges made for them (grow, page returns, sleep, wake, the
  move to a restarted daemon);
- the **block gate** is one token: whoever holds it may read and change the
  pool's blocks (``PoolCore.allocator``, a warm sleeper's allocator) and the
  mappings under free blocks.

Acquiring the lock also takes the token (waiting for it: it is only ever held
for local work), so a lock holder sees and changes the blocks alone, as with
a plain lock. A lock holder that must wait on the daemon for something that
needs nothing of the blocks (confirming pages already taken out of the
allocator and unmapped) opens the gate for that wait (``open_gate``), so the
engine does not wait for the agent's round trips.

The engine's ``alloc``/``free`` fast path takes only the token, never waits
for it (``try_enter``: one ``list.pop``, atomic in CPython with or without the
GIL), and takes the slow path (the lock) when it is shut. The agent therefore
never changes a block list under the engine, and the engine pays no lock on
its fast path.

Invariants: at most one thread holds the token; a holder of the token alone
(not the lock) never blocks on anything, so a lock holder waits for it at most
for the length of one ``alloc``/``free``. Lock order: the lock, then the token.
Cost: fast path one ``list.pop`` and one ``list.append``; the lock path adds
the same to a plain lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

class PoolLock:
    """The pool lock with its block gate (see the module docstring). Usable with ``with``
    and as the lock of a ``threading.Condition``."""

    def __init__(self) -> None:
        self.gate: list[bool] = [True]  # the token; the engine's fast path pops and appends it
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._holds_token = False

    # -- the engine's fast path --------------------------------------------------

    def try_enter(self) -> bool:
        """Take the token if it is free (never waits); pair with ``leave``."""
        try:
            self.gate.pop()
        except IndexError:
            return False
        return True

    def leave(self) -> None:
        self.gate.append(True)

    # -- the lock ----------------------------------------------------------------

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if not self._lock.acquire(blocking, timeout):
            return False
        self._take_token()
        self._owner = threading.get_ident()
        return True

    def release(self) -> None:
        self._owner = None
        if self._holds_token:
            self._holds_token = False
            self.gate.append(True)
        self._lock.release()

    def locked(self) -> bool:
        """True while some thread holds the lock."""
        return self._lock.locked()

    def __enter__(self) -> PoolLock:
        self.acquire()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.release()

    @contextmanager
    def open_gate(self) -> Iterator[None]:
        """Lock held: let the engine's fast path in while the caller waits on the daemon.

        The caller must not rely on the blocks read before it, nor touch them inside.
        """
        assert self._owner == threading.get_ident() and self._holds_token, "open_gate needs the lock"
        self._holds_token = False
        self.gate.append(True)
        try:
            yield
        finally:
            self._take_token()

    def _take_token(self) -> None:
        gate = self.gate
        num_tries = 0
        while True:
            try:
                gate.pop()
                break
            except IndexError:  # a fast path holds it for one alloc/free: yield, then nap
                time.sleep(0.0 if num_tries < 64 else 1e-5 if num_tries < 128 else 1e-4)
                num_tries += 1
        self._holds_token = True

    # -- threading.Condition's protocol -----------------------------------------

    def _is_owned(self) -> bool:
        return self._owner == threading.get_ident()

    def _release_save(self) -> None:
        self.release()

    def _acquire_restore(self, _state: object) -> None:
        self.acquire()
