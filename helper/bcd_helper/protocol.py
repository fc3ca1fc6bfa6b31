"""The helper's wire protocol: length-prefixed JSON frames over a Unix stream socket.

A frame is a 4-byte big-endian length followed by that many bytes of UTF-8 JSON (one document,
no trailing data). Frames larger than MAX_FRAME (4 MiB) are refused and the connection closed, and so are
frames holding more than MAX_VALUES values (counted on the bytes before decoding). The JSON
is strict (strict_loads): a duplicate key, NaN or Infinity, a lone surrogate escape, or nesting deeper
than MAX_DEPTH refuses the frame.

Request:  {"op": "<name>", "args": {...}}            (exactly these two keys, and optionally
          "trace": "<traceparent>", the W3C trace context of the command the node is handling:
          version 00 exactly, else the request is refused; decode_trace)
Answer:   {"ok": true, "result": {...}}
      or  {"ok": false, "error": "refused"|"failed", "reason": "<code>", "message": "<text>"}

`args` is decoded strictly into the op's frozen attrs request type: an unknown field, a missing
required one or a value of the wrong JSON type is refused, the message naming the field path
(`$.args.content: expected str`). Ints are never taken from strings, bools never from ints.
The agent's client (bcd_agent.helperclient) speaks the same framing with its own few lines, since
the agent does not depend on bcd-helper.
"""

from __future__ import annotations

import functools
import json
import re
import socket
import struct
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
from bcd_shared.strictjson import unique_keys, value_bound
from bcd_shared.tracecontext import parse_version_00

if TYPE_CHECKING:
    import cattrs

MAX_FRAME = 4 * 1024 * 1024
MAX_DEPTH = 32  # a request nests four levels (host.unit's intent.chain); 10,000 would overflow recursion
# Values (array and object openings, members, separators) one frame may hold. A real request holds a few
# hundred at most (host.unit's settings and intent are strings); a 4 MiB frame of `[[],[],…]` holds 1.4 M,
# which decoded would take ~200 MiB. Counted on the bytes, before json.loads (issue 9 item 3).
MAX_VALUES = 16384
# count_values takes the strings out in two linear passes: every escape pair, left to right (outside a
# string a backslash is not JSON, and json.loads stops there), then the strings, which hold no backslash
# by then. One expression for strings with escapes was tried at every `"` and, for `\"` x N with no
# string ending, ran to the end each time: quadratic, in C code that holds the interpreter lock (round 11).
_ESCAPE = re.compile(rb"\\.", re.DOTALL)
_PLAIN_STRING = re.compile(rb'"[^"]*"')
_LEN = struct.Struct(">I")

T = TypeVar("T")


class ProtocolError(Exception):
    """The peer broke the framing or sent something that is not a request; the connection closes."""


class DecodeError(Exception):
    """The request's arguments do not fit the op's type; the message names the field path."""


# Built once: json.dumps and json.loads with options build a new encoder or decoder at every call.
_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


def encode_frame(doc: Any) -> bytes:
    body = _ENCODER.encode(doc).encode()
    if len(body) > MAX_FRAME:
        raise ProtocolError(f"frame of {len(body)} bytes exceeds {MAX_FRAME}")
    return _LEN.pack(len(body)) + body


_pairs = unique_keys(lambda key: ValueError(f"key {key[:100]!r} appears twice"))


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


_DECODER = json.JSONDecoder(object_pairs_hook=_pairs, parse_constant=_constant)


def _check_string(value: str) -> None:
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("a string holds a lone surrogate (\\ud800-\\udfff)") from None


def _check_tree(doc: Any, max_depth: int) -> None:
    """Nesting at most `max_depth` (the top value is depth 1) and no lone surrogate in any string."""
    stack: list[tuple[Any, int]] = [(doc, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > max_depth:
            raise ValueError(f"nested deeper than {max_depth} levels")
        items = value.items() if type(value) is dict else enumerate(value)
        for key, item in items:
            if type(key) is str:
                _check_string(key)
            kind = type(item)
            if kind is dict or kind is list:
                stack.append((item, depth + 1))
            elif kind is str:
                _check_string(item)


def strict_loads(data: bytes | bytearray, max_depth: int = MAX_DEPTH) -> Any:
    """One JSON document in UTF-8, strictly: no duplicate keys (never last-wins), no NaN or Infinity, no
    lone surrogates, at most `max_depth` levels of nesting. Raises ValueError naming the rule."""
    try:
        text = data.decode("utf-8")
        if text.startswith("\ufeff"):  # as json.loads refuses it
            raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
        doc = _DECODER.decode(text)
    except RecursionError:
        raise ValueError(f"nested deeper than {max_depth} levels") from None
    # UTF-8 text cannot hold a surrogate, so only a \\uD8xx..\\uDFxx escape makes one; fewer brackets
    # than max_depth cannot nest deeper. Only then is the tree walked (a frame is up to 4 MiB).
    deep = data.count(b"[") + data.count(b"{") > max_depth
    if type(doc) in (dict, list) and (deep or _SURROGATE_ESCAPE.search(data)):
        _check_tree(doc, max_depth)
    elif type(doc) is str:
        _check_string(doc)
    return doc


def count_values(body: bytes | bytearray) -> int:
    """An upper bound on the values in a JSON text: `[`, `{`, `,` and `:` outside strings. Counted on all
    the bytes first (no copy); only when that passes MAX_VALUES are the strings taken out and counted
    again, so brackets inside a file's content never count."""
    total = value_bound(body)
    if total <= MAX_VALUES:
        return total
    # Each string is a value: past MAX_VALUES strings (unescaped quotes / 2, a lower bound) the frame is
    # refused at once, so the substitution below never has more than ~2 x MAX_VALUES strings to take out.
    strings = (body.count(b'"') - body.count(b'\\"')) // 2
    if strings > MAX_VALUES:
        return strings
    return value_bound(_PLAIN_STRING.sub(b"", _ESCAPE.sub(b"", body)))


def decode_body(body: bytes | bytearray) -> Any:
    values = count_values(body)
    if values > MAX_VALUES:
        raise ProtocolError(
            f"frame holds {values} values (arrays, objects, members), more than {MAX_VALUES}: refused "
            "before decoding"
        )
    try:
        return strict_loads(body)
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ProtocolError(f"frame is not one JSON document: {exc}") from None


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Read exactly n bytes (client side; the server reads through recvmsg to see ancillary data)."""
    chunks: list[bytes] = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise ProtocolError("connection closed mid-frame" if chunks else "connection closed")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def read_frame(sock: socket.socket) -> Any:
    (n,) = _LEN.unpack(recv_exact(sock, 4))
    if n > MAX_FRAME:
        raise ProtocolError(f"frame of {n} bytes exceeds {MAX_FRAME}")
    return decode_body(recv_exact(sock, n))


def _strict(conv: cattrs.Converter) -> cattrs.Converter:
    def exact(kind: type, name: str) -> Any:
        def hook(value: Any, _t: Any) -> Any:
            if type(value) is not kind:
                raise TypeError(f"expected {name}, got {type(value).__name__}")
            return value

        return hook

    conv.register_structure_hook(str, exact(str, "string"))
    conv.register_structure_hook(bool, exact(bool, "boolean"))
    conv.register_structure_hook(int, exact(int, "integer"))

    from cattrs.errors import (
        ClassValidationError,
        ForbiddenExtraKeysError,
        IterableValidationError,
        IterableValidationNote,
    )

    def tuple_hook(value: Any, t: Any) -> Any:
        if not isinstance(value, list):
            raise TypeError(f"expected array, got {type(value).__name__}")
        (inner,) = [a for a in getattr(t, "__args__", (Any,)) if a is not Ellipsis] or [Any]
        out = []
        for i, v in enumerate(value):
            try:
                out.append(conv.structure(v, inner))
            except (TypeError, ValueError) as exc:
                raise TypeError(f"item {i}: {exc}") from None
            except (ClassValidationError, ForbiddenExtraKeysError) as exc:
                # An item that is itself a request type (nft.apply's nics): keep its index in the path,
                # `$.args.nics[2].name`, which cattrs' own errors would lose under this hook.
                exc.add_note(IterableValidationNote(f"Structuring {t} @ index {i}", i, inner))
                raise IterableValidationError(f"While structuring {t}", [exc], t) from None
        return tuple(out)

    conv.register_structure_hook_func(
        lambda t: getattr(t, "__origin__", None) is tuple,
        tuple_hook,
    )
    return conv


@functools.cache
def converter() -> cattrs.Converter:
    """The strict converter, built on the first request with arguments (cattrs costs ~10 ms to import,
    which the helper's start does not pay: a request without arguments never needs it)."""
    import cattrs

    return _strict(cattrs.Converter(forbid_extra_keys=True, detailed_validation=True))


def _messages(exc: BaseException, path: str) -> list[str]:
    from cattrs.errors import (
        AttributeValidationNote,
        ClassValidationError,
        ForbiddenExtraKeysError,
        IterableValidationError,
        IterableValidationNote,
    )

    if isinstance(exc, ForbiddenExtraKeysError):
        return [f"{path}: unknown field {k!r}" for k in sorted(exc.extra_fields)]
    if isinstance(exc, ClassValidationError | IterableValidationError):
        out: list[str] = []
        for sub in exc.exceptions:
            # cattrs notes each sub-error with the attribute's name or the item's index (notes are str
            # subclasses: `getattr(note, "index")` would find str.index, so test the type).
            field = ""
            for n in getattr(sub, "__notes__", ()):
                if isinstance(n, AttributeValidationNote):
                    field = f".{n.name}"
                elif isinstance(n, IterableValidationNote):
                    field = f"[{n.index}]"
            if isinstance(sub, KeyError):
                out.append(f"{path}{field}: required field missing")
            else:
                out.extend(_messages(sub, path + field))
        return out
    return [f"{path}: {exc}"]


TRACE_RULE = (
    "$.trace: expected a W3C traceparent of version 00, exactly 55 characters "
    "00-<32 hex>-<16 hex>-<2 hex> in lower case, neither id all zeros"
)


def decode_trace(value: Any) -> tuple[str, str]:
    """A request's `trace`: its (trace id, parent id). Decoded strictly, as every field: anything but a
    valid version-00 traceparent raises DecodeError (TRACE_RULE). The W3C rule that a receiver ignores an
    invalid one is applied where the control plane's value arrives (the node's dispatcher); the node's
    client sends only what it formats from a valid context, so a bad one here is a broken or hostile
    node (docs/helper.md "Audit log")."""
    ctx = parse_version_00(value)
    if ctx is None:
        raise DecodeError(TRACE_RULE)
    return ctx.trace_id, ctx.parent_id


def _without_fields(cls: type[Any]) -> bool:
    return attrs.has(cls) and not attrs.fields(cls)


def structure(args: Any, cls: type[T], path: str = "$.args") -> T:
    """Decode `args` into `cls` strictly; DecodeError names the field path and the rule."""
    if not isinstance(args, dict):
        raise DecodeError(f"{path}: expected an object")
    if not args and _without_fields(cls):  # helper.ping, node.reboot
        return cls()
    from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError, IterableValidationError

    try:
        return converter().structure(args, cls)
    except (ClassValidationError, IterableValidationError, ForbiddenExtraKeysError) as exc:
        raise DecodeError("; ".join(_messages(exc, path))) from None
    except (TypeError, ValueError, KeyError) as exc:
        raise DecodeError(f"{path}: {exc}") from None


def unstructure(value: Any) -> Any:
    return converter().unstructure(value)
