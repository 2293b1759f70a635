"""The control protocol: msgpack messages, bounded decoding, field validation.

A request is a map ``{"id": int, "op": str, "args": map}``; its reply is
``{"id": int, "ok": true, "result": ...}`` or
``{"id": int, "ok": false, "error": {"code": str, "message": str}}``.
A message the daemon sends on its own (a notice: ``shutdown``, ``reclaim``) is
``{"notice": str, "args": map}``.

Decoding is bounded: a message is at most ``MAX_MESSAGE_BYTES`` and every
string, array and map inside it has a length limit, so no message can make the
daemon allocate much. Every field an op reads goes through ``Args``, which
raises ``BadRequest`` naming the field on a wrong type or range, so a handler
validates everything before it changes anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgpack

from kvdaemon.errors import BadRequest, KVDaemonError, from_code

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 1 << 20
MAX_LIST_LEN = 1 << 16
MAX_STR_LEN = 1024
MAX_INT = (1 << 63) - 1


def encode(obj: object) -> bytes:
    """Pack ``obj`` as msgpack."""
    return msgpack.packb(obj, use_bin_type=True)


def decode(data: bytes) -> dict[str, Any]:
    """Unpack one message with bounded sizes; raise ``BadRequest`` unless it is a map."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise BadRequest(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_str_len=MAX_STR_LEN,
            max_bin_len=MAX_STR_LEN,
            max_array_len=MAX_LIST_LEN,
            max_map_len=256,
            max_ext_len=0,
        )
    except (ValueError, msgpack.UnpackException, TypeError) as exc:
        raise BadRequest(f"undecodable message: {exc}") from exc
    if not isinstance(obj, dict):
        raise BadRequest(f"a message must be a map, got {type(obj).__name__}")
    return obj


def request(request_id: int, op: str, args: Mapping[str, Any]) -> bytes:
    return encode({"id": request_id, "op": op, "args": dict(args)})


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
