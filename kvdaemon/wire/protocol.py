"""The control protocol: msgpack messages, bounded decoding, field validation.

A request is a map ``{"id": int, "op": str, "args": map}``; its reply is
``{"id": int, "ok": true, "result": ...}`` or
``{"id": int, "ok": false, "error": {"code": str, "message": str}}``.
A message the daemon sends on its own (a notice: ``shutdown``, ``reclaim``) is
``{"notice": str, "args": map}``.

Decoding is bounded: a message is at most ``MAX_MESSAGE_BYTES``, every
string, array and map inside it has a length limit, and ``DecodeLimits`` caps
how many containers and items it may hold, so no message can make the daemon
allocate much or spend long unpacking it. Every field an op reads goes through ``Args``, which
raises ``BadRequest`` naming the field on a wrong type or range, so a handler
validates everything before it changes anything.

The byte cap is also the control socket's ZeroMQ ``MAXMSGSIZE``: a request frame longer
than ``MAX_MESSAGE_BYTES`` gets no reply at all (ZeroMQ drops the connection silently; a
DEALER reconnects by itself, the request is lost), so the sender waits for its own timeout.
``request`` refuses such a request before sending it (``BadRequest``); a raw client must
keep its requests within the cap and poll its socket with a receive timeout.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from kvdaemon.errors import BadRequest, KVDaemonError, from_code

PROTOCOL_VERSION = 2  # 2: a wake's logical pages in parts (WakeNotice.parts)
MAX_MESSAGE_BYTES = 1 << 20  # also the control socket's MAXMSGSIZE: a longer frame is dropped, unanswered
MAX_LIST_LEN = 1 << 16
MAX_REQUEST_LIST_LEN = 8192  # a request's longest list: a grow's or shrink's pages (handles.MAX_GROW_PAGES), twice
MAX_VIRTUAL_PAGES = 1 << 24  # logical pages a tenant may reserve
MAX_MAP_LEN = 256
MAX_STR_LEN = 1024
MAX_INT = (1 << 63) - 1


@dataclass(frozen=True)
class DecodeLimits:
    """What one message may hold beyond its byte size.

    ``max_containers`` bounds arrays plus maps, ``max_items`` their elements
    (a map entry counts two). Unpacking costs about 0.3-0.5 us per container
    and 25-50 ns per other object, so these bound a message's decode time, which
    the byte cap alone does not (1 MiB of empty arrays is ~1M lists: ~0.5-1 s).
    ``max_array_len`` refuses a longer array at its header, before any of its
    items is read.
    """

    max_containers: int
    max_items: int
    max_array_len: int = MAX_LIST_LEN

    def admit_all(self, num_bytes: int) -> bool:
        """True when no message of ``num_bytes`` can pass these limits (objects take a byte)."""
        return num_bytes <= min(self.max_containers, self.max_items)


# Anything within the byte cap: replies, which the client decodes off the daemon's thread.
MESSAGE_LIMITS = DecodeLimits(max_containers=MAX_MESSAGE_BYTES, max_items=MAX_MESSAGE_BYTES)
# A request to the daemon (and a handle frame it reads): one list of up to
# MAX_REQUEST_LIST_LEN ints and a few small maps need far less; decoding stays under ~1 ms.
REQUEST_LIMITS = DecodeLimits(
    max_containers=4096, max_items=MAX_REQUEST_LIST_LEN + 4096, max_array_len=MAX_REQUEST_LIST_LEN)


class _OverLimits(Exception):
    """Raised inside msgpack's hooks to stop unpacking a message over its limits."""


def encode(obj: object) -> bytes:
    """Pack ``obj`` as msgpack."""
    return msgpack.packb(obj, use_bin_type=True)


def peek_request_id(data: bytes) -> int | None:
    """The ``id`` of a request that does not decode as a whole, when it is its first entry.

    Requests put ``id`` first (``request``), so a message refused for what
    follows (a string over ``MAX_STR_LEN``, too many items) still gets an error
    reply its sender can match. Reads at most the map header and one entry.
    """
    unpacker = msgpack.Unpacker(raw=False, max_str_len=MAX_STR_LEN, max_bin_len=MAX_STR_LEN,
                                max_array_len=0, max_map_len=MAX_MAP_LEN, max_ext_len=0)  # fmt: skip
    unpacker.feed(data[:64])
    try:
        if unpacker.read_map_header() < 1 or unpacker.unpack() != "id":
            return None
        value = unpacker.unpack()
    except (ValueError, msgpack.UnpackException, TypeError, msgpack.OutOfData):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def decode(data: bytes, limits: DecodeLimits = MESSAGE_LIMITS) -> dict[str, Any]:
    """Unpack one message within ``limits``; raise ``BadRequest`` unless it is a map.

    Every object takes at least one byte, so a message no longer than both
    limits is unpacked without counting (no overhead); a longer one is counted
    by hooks that run once per container and stop the unpacking as soon as a
    limit is passed. Cost: O(len(data)), and at most about one array of
    ``MAX_LIST_LEN`` items past the limits before a refusal.
    """
    if len(data) > MAX_MESSAGE_BYTES:
        raise BadRequest(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    hooks = {} if limits.admit_all(len(data)) else _counting_hooks(limits)
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_str_len=MAX_STR_LEN,
            max_bin_len=MAX_STR_LEN,
            max_array_len=limits.max_array_len,
            max_map_len=MAX_MAP_LEN,
            max_ext_len=0,
            **hooks,
        )
    except _OverLimits as exc:
        raise BadRequest(f"message too complex: {exc}") from None
    except msgpack.StackError:
        raise BadRequest("undecodable message: nested too deeply") from None
    except (ValueError, msgpack.UnpackException, TypeError) as exc:
        raise BadRequest(f"undecodable message: {str(exc) or type(exc).__name__}") from exc
    if not isinstance(obj, dict):
        raise BadRequest(f"a message must be a map, got {type(obj).__name__}")
    return obj


def _counting_hooks(limits: DecodeLimits) -> dict[str, Any]:
    """msgpack ``list_hook``/``object_hook`` that count containers and items."""
    num_containers = num_items = 0

    def count(container: Any, num_new_items: int) -> Any:
        nonlocal num_containers, num_items
        num_containers += 1
        num_items += num_new_items
        if num_containers > limits.max_containers:
            raise _OverLimits(f"more than {limits.max_containers} arrays and maps")
        if num_items > limits.max_items:
            raise _OverLimits(f"more than {limits.max_items} items")
        return container

    return {
        "list_hook": lambda items: count(items, len(items)),
        "object_hook": lambda entries: count(entries, 2 * len(entries)),
    }


def request(request_id: int, op: str, args: Mapping[str, Any]) -> bytes:
    """One request, ``id`` first (see ``peek_request_id``); ``BadRequest`` when it is
    larger than a daemon accepts (nothing is sent then)."""
    try:
        data = encode({"id": request_id, "op": op, "args": dict(args)})
    except (OverflowError, TypeError, ValueError) as exc:  # an int past 64 bits, an object
        raise BadRequest(f"a {op!r} request cannot be encoded: {exc}") from None
    if len(data) > MAX_MESSAGE_BYTES:
        raise BadRequest(f"a {op!r} request of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    return data


def reply_ok(request_id: int | None, result: object) -> bytes:
    return encode({"id": request_id, "ok": True, "result": result})


def reply_error(request_id: int | None, error: KVDaemonError) -> bytes:
    return encode(
        {"id": request_id, "ok": False, "error": {"code": error.code, "message": error.message}}
    )


def notice(kind: str, args: Mapping[str, Any]) -> bytes:
    return encode({"notice": kind, "args": dict(args)})


def result_of(reply: Mapping[str, Any]) -> Any:
    """The result of a decoded reply, or raise the error it carries."""
    if reply.get("ok") is True:
        return reply.get("result")
    error = reply.get("error")
    if not isinstance(error, Mapping):
        raise BadRequest("malformed reply from the daemon")
    raise from_code(str(error.get("code")), str(error.get("message")))


class Args:
    """Typed, range-checked access to a request's ``args`` map.

    Each getter raises ``BadRequest`` naming the field; none mutates anything.
    """

    def __init__(self, raw: object) -> None:
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise BadRequest("args must be a map")
        self._raw = raw

    def has(self, key: str) -> bool:
        return self._raw.get(key) is not None

    def raw(self, key: str, default: object = None) -> object:
        """The field as decoded, unchecked (the caller validates it)."""
        return self._raw.get(key, default)

    def bool(self, key: str, default: bool = False) -> bool:
        value = self._raw.get(key, default)
        if not isinstance(value, bool):
            raise BadRequest(f"field {key!r} must be true or false, got {_kind(value)}")
        return value

    def int(self, key: str, lo: int = 0, hi: int = MAX_INT, default: int | None = None) -> int:
        value = self._raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise BadRequest(f"field {key!r} must be an integer, got {_kind(value)}")
        if not lo <= value <= hi:
            raise BadRequest(f"field {key!r} = {value} is outside [{lo}, {hi}]")
        return value

    def opt_int(self, key: str, lo: int = 0, hi: int = MAX_INT) -> int | None:
        return self.int(key, lo, hi) if self.has(key) else None

    def float(self, key: str, lo: float, hi: float, default: float | None = None) -> float:
        value = self._raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise BadRequest(f"field {key!r} must be a number, got {_kind(value)}")
        if not lo <= value <= hi:  # also refuses NaN
            raise BadRequest(f"field {key!r} = {value} is outside [{lo}, {hi}]")
        return float(value)

    def opt_float(self, key: str, lo: float, hi: float) -> float | None:
        return self.float(key, lo, hi) if self.has(key) else None

    def str(self, key: str, max_len: int = 128) -> str:
        value = self._raw.get(key)
        if not isinstance(value, str):
            raise BadRequest(f"field {key!r} must be a string, got {_kind(value)}")
        if not 0 < len(value) <= max_len:
            raise BadRequest(f"field {key!r} must be 1..{max_len} characters")
        return value

    def int_list(self, key: str, lo: int, hi: int, max_len: int = MAX_LIST_LEN) -> list[int]:
        value = self._raw.get(key)
        if not isinstance(value, list):
            raise BadRequest(f"field {key!r} must be a list of integers, got {_kind(value)}")
        if len(value) > max_len:
            raise BadRequest(f"field {key!r} has {len(value)} items, more than {max_len}")
        for item in value:
            if isinstance(item, bool) or not isinstance(item, int) or not lo <= item <= hi:
                raise BadRequest(f"field {key!r} holds {item!r}, not an integer in [{lo}, {hi}]")
        if len(set(value)) != len(value):
            raise BadRequest(f"field {key!r} holds duplicates")
        return value

    def map(self, key: str) -> Args:
        value = self._raw.get(key)
        if not isinstance(value, dict):
            raise BadRequest(f"field {key!r} must be a map, got {_kind(value)}")
        return Args(value)


def _kind(value: object) -> str:
    return "nothing" if value is None else type(value).__name__
