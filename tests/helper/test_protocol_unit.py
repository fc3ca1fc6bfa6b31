"""The helper's frame protocol in process: framing, the strict JSON rules, the value count and the strict
request decoder, each refusal checked word for word.

The framing tests in test_hostile_framing.py drive a real `bcd helper serve`; these call
bcd_helper.protocol directly, so they are fast and mutation testing sees them (docs/mutation.md)."""

from __future__ import annotations

import socket
import struct
import sys
from collections.abc import Iterator

import pytest
from attrs import frozen
from bcd_helper.ops.host import Ping
from bcd_helper.ops.nft import NftApply
from bcd_helper.protocol import (
    MAX_DEPTH,
    MAX_FRAME,
    MAX_VALUES,
    DecodeError,
    ProtocolError,
    converter,
    count_values,
    decode_body,
    encode_frame,
    read_frame,
    recv_exact,
    strict_loads,
    structure,
    unstructure,
)


def refused(body: bytes) -> str:
    with pytest.raises(ProtocolError) as info:
        decode_body(body)
    return str(info.value)


# --- encode_frame ---------------------------------------------------------------------------------------


def test_a_frame_is_a_big_endian_length_then_compact_utf8_json() -> None:
    frame = encode_frame({"op": "helper.ping", "args": {"é": [1, 2]}})
    body = '{"op":"helper.ping","args":{"é":[1,2]}}'.encode()
    assert frame == struct.pack(">I", len(body)) + body
    assert frame[:4] == len(body).to_bytes(4, "big")


def test_a_frame_of_exactly_max_frame_is_encoded_and_one_more_byte_is_refused() -> None:
    fill = MAX_FRAME - 2  # two quotes
    assert len(encode_frame("a" * fill)) == 4 + MAX_FRAME
    with pytest.raises(ProtocolError) as info:
        encode_frame("a" * (fill + 1))
    assert str(info.value) == f"frame of {MAX_FRAME + 1} bytes exceeds {MAX_FRAME}"


# --- strict JSON ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"a":1} x', "Extra data: line 1 column 9 (char 8)"),
        (b"", "Expecting value: line 1 column 1 (char 0)"),
        (b"\xff", "'utf-8' codec can't decode byte 0xff in position 0: invalid start byte"),
        (b"[1,NaN]", "NaN is not a JSON number"),
        (b"[1,Infinity]", "Infinity is not a JSON number"),
        (b"[-Infinity]", "-Infinity is not a JSON number"),
        (b'{"a":1,"a":2}', "key 'a' appears twice"),
        (b'{"x":{"b":1,"b":1}}', "key 'b' appears twice"),
        (b'"\\ud800"', "a string holds a lone surrogate (\\ud800-\\udfff)"),
        (b'["ok", ["\\udfff"]]', "a string holds a lone surrogate (\\ud800-\\udfff)"),
        (b'{"\\uDC00": 1}', "a string holds a lone surrogate (\\ud800-\\udfff)"),
        (b'[{"k": "\\udBff"}]', "a string holds a lone surrogate (\\ud800-\\udfff)"),
        (b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1), f"nested deeper than {MAX_DEPTH} levels"),
        (b'{"a":' * MAX_DEPTH + b"[]" + b"}" * MAX_DEPTH, f"nested deeper than {MAX_DEPTH} levels"),
    ],
)
def test_a_body_outside_strict_json_is_refused_naming_the_rule(body: bytes, message: str) -> None:
    assert refused(body) == f"frame is not one JSON document: {message}"


def test_a_duplicate_key_is_named_cut_to_100_characters() -> None:
    key = "k" * 150
    with pytest.raises(ValueError) as info:
        strict_loads(f'{{"{key}":1,"{key}":2}}'.encode())
    assert str(info.value) == f"key {'k' * 100!r} appears twice"


def test_nesting_at_the_limit_is_decoded() -> None:
    doc = decode_body(b"[" * MAX_DEPTH + b"]" * MAX_DEPTH)
    for _ in range(MAX_DEPTH - 1):
        assert type(doc) is list and len(doc) == 1
        doc = doc[0]
    assert doc == []
    mixed = b'{"a":' * (MAX_DEPTH - 1) + b"[]" + b"}" * (MAX_DEPTH - 1)
    assert strict_loads(mixed) is not None


def test_the_depth_limit_is_a_parameter() -> None:
    assert strict_loads(b"[[[]]]", max_depth=3) == [[[]]]
    with pytest.raises(ValueError, match=r"^nested deeper than 2 levels$"):
        strict_loads(b"[[[]]]", max_depth=2)
    with pytest.raises(ValueError, match=r"^nested deeper than 2 levels$"):
        strict_loads(b'{"a":{"b":{}}}', max_depth=2)
    # depth counts containers, whatever the strings hold
    assert strict_loads(b'["[[[[", {"a": "{{{{"}]', max_depth=2) == ["[[[[", {"a": "{{{{"}]


def test_a_recursion_error_in_the_decoder_reads_as_too_deep(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "getrecursionlimit", sys.getrecursionlimit)  # restored by monkeypatch
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(200)
    try:
        with pytest.raises(ValueError) as info:
            strict_loads(b"[" * 300 + b"]" * 300, max_depth=7)
    finally:
        sys.setrecursionlimit(old)
    assert str(info.value) == "nested deeper than 7 levels"


def test_surrogate_pairs_and_non_ascii_text_pass() -> None:
    assert strict_loads(b'"\\ud83d\\ude00"') == "\U0001f600"
    assert strict_loads('["é", {"ü": "日本"}]'.encode()) == ["é", {"ü": "日本"}]
    assert strict_loads(b'{"a": ["\\ud83d\\ude00", {"\\ud83d\\ude00": "x"}]}') == {
        "a": ["\U0001f600", {"\U0001f600": "x"}]
    }
    assert strict_loads(b"7") == 7


def test_a_lone_surrogate_is_found_in_every_place_of_a_shallow_tree() -> None:
    for body in [
        b'{"a": "\\ud800"}',
        b'{"\\ud800": "a"}',
        b'[1, "x", "\\ud800"]',
        b'{"a": {"b": ["\\ud800"]}}',
        b'{"a": [{"b": "\\ud800"}]}',
    ]:
        with pytest.raises(ValueError, match=r"lone surrogate"):
            strict_loads(body)


def test_a_lone_surrogate_is_found_in_a_tree_deep_enough_to_be_walked() -> None:
    deep = b"[" * 20 + b'"\\ud800"' + b"]" * 20
    with pytest.raises(ValueError, match=r"lone surrogate"):
        strict_loads(deep, max_depth=25)
    with pytest.raises(ValueError, match=r"^nested deeper than 19 levels$"):
        strict_loads(deep, max_depth=19)


# --- the value count ------------------------------------------------------------------------------------


def test_values_are_counted_as_brackets_separators_and_colons() -> None:
    assert count_values(b'{"a":[1,2]}') == 4
    assert count_values(b"[[],{}]") == 4
    assert count_values(b'"a:b,c[d{"') == 4  # below the limit, strings are not taken out
    assert count_values(b"7") == 0


def test_past_the_limit_brackets_inside_strings_do_not_count() -> None:
    body = b'{"a":"' + b"[" * (MAX_VALUES + 10) + b'"}'
    assert count_values(body) == 2
    assert decode_body(body) == {"a": "[" * (MAX_VALUES + 10)}
    escaped = b'{"a":"' + b"[" * (MAX_VALUES + 10) + b'\\"x"}'
    assert count_values(escaped) == 2


def test_past_the_limit_too_many_strings_are_counted_without_taking_them_out() -> None:
    body = b"[" * (MAX_VALUES + 1) + b'""' * 20000 + b'"'
    assert count_values(body) == 20000
    assert type(count_values(body)) is int
    # strings with an escaped quote count once each: 12000 of them are not past the limit, so they
    # are taken out and the brackets counted
    escaped = b"[" * (MAX_VALUES + 1) + b'"\\""' * 12000
    assert count_values(escaped) == MAX_VALUES + 1
    # exactly MAX_VALUES strings are not too many: they are taken out
    assert count_values(b"[" * (MAX_VALUES + 1) + b'""' * MAX_VALUES) == MAX_VALUES + 1


def test_at_the_limit_separators_inside_strings_still_count() -> None:
    body = b'["' + b"," * (MAX_VALUES - 1) + b'"]'
    assert count_values(body) == MAX_VALUES
    assert decode_body(body) == ["," * (MAX_VALUES - 1)]


def test_a_frame_with_one_value_too_many_is_refused_before_decoding() -> None:
    at_limit = b"[" + b"0," * (MAX_VALUES - 1) + b"0]"
    assert count_values(at_limit) == MAX_VALUES
    assert len(decode_body(at_limit)) == MAX_VALUES
    over = b"[" + b"0," * MAX_VALUES + b"0]"
    assert refused(over) == (
        f"frame holds {MAX_VALUES + 1} values (arrays, objects, members), more than {MAX_VALUES}: "
        "refused before decoding"
    )


# --- reading frames -------------------------------------------------------------------------------------


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    with a, b:
        yield a, b


def test_a_frame_is_read_back(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    a.sendall(encode_frame({"op": "x", "args": {}}) + encode_frame([1]))
    assert read_frame(b) == {"op": "x", "args": {}}
    assert read_frame(b) == [1]


def test_recv_exact_gathers_chunks_and_names_where_the_peer_closed(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    a.sendall(b"abc")
    a.sendall(b"defg")
    assert recv_exact(b, 7) == b"abcdefg"
    assert recv_exact(b, 0) == b""
    a.sendall(b"xy")
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(ProtocolError) as info:
        recv_exact(b, 5)
    assert str(info.value) == "connection closed mid-frame"
    with pytest.raises(ProtocolError) as info:
        recv_exact(b, 1)
    assert str(info.value) == "connection closed"


def test_recv_exact_reads_more_than_one_mebibyte(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    data = bytes(range(256)) * (5 * 1024)  # 1.25 MiB
    import threading

    sender = threading.Thread(target=a.sendall, args=(data,))
    sender.start()
    try:
        assert recv_exact(b, len(data)) == data
    finally:
        sender.join()


def test_a_length_prefix_above_the_cap_is_refused_before_reading(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    a.sendall(struct.pack(">I", MAX_FRAME + 1))
    with pytest.raises(ProtocolError) as info:
        read_frame(b)
    assert str(info.value) == f"frame of {MAX_FRAME + 1} bytes exceeds {MAX_FRAME}"


def test_a_length_prefix_at_the_cap_is_read(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    import threading

    sender = threading.Thread(target=a.sendall, args=(encode_frame("a" * (MAX_FRAME - 2)),))
    sender.start()
    try:
        assert read_frame(b) == "a" * (MAX_FRAME - 2)
    finally:
        sender.join()


# --- the strict request decoder -------------------------------------------------------------------------


@frozen
class Inner:
    name: str
    n: int = 0


@frozen
class Req:
    a: str
    flag: bool
    items: tuple[str, ...] = ()
    inner: Inner | None = None


@frozen
class Counted:
    n: int


@frozen
class Listed:
    inners: tuple[Inner, ...] = ()


@pytest.fixture(autouse=True)
def fresh_converter() -> None:
    """The converter is built once per process (functools.cache): build it again for each test, so the
    strict hooks these tests check are the ones of the code under test."""
    converter.cache_clear()


def decode_error(args: object, cls: type = Req) -> str:
    with pytest.raises(DecodeError) as info:
        structure(args, cls)
    return str(info.value)


def test_a_request_is_structured_into_its_type() -> None:
    assert structure({"a": "x", "flag": True}, Req) == Req("x", True)
    got = structure({"a": "x", "flag": False, "items": ["p", "q"], "inner": {"name": "n", "n": 3}}, Req)
    assert got == Req("x", False, ("p", "q"), Inner("n", 3))
    assert type(got.items) is tuple
    assert structure({}, Ping) == Ping()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"a": 1, "flag": True}, "$.args.a: expected string, got int"),
        ({"a": "x", "flag": 1}, "$.args.flag: expected boolean, got int"),
        ({"a": "x", "flag": "true"}, "$.args.flag: expected boolean, got str"),
        ({"flag": True}, "$.args.a: required field missing"),
        (
            {"a": "x", "flag": True, "zz": 1, "yy": 2},
            "$.args: unknown field 'yy'; $.args: unknown field 'zz'",
        ),
        ({"a": "x", "flag": True, "items": ["a", 1]}, "$.args.items: item 1: expected string, got int"),
        ({"a": "x", "flag": True, "items": "ab"}, "$.args.items: expected array, got str"),
        ({"a": "x", "flag": True, "inner": {"name": 3}}, "$.args.inner.name: expected string, got int"),
        ({"a": "x", "flag": True, "inner": {"name": "q", "x": 1}}, "$.args.inner: unknown field 'x'"),
        ({"a": "x", "flag": True, "inner": {}}, "$.args.inner.name: required field missing"),
        ({}, "$.args.a: required field missing; $.args.flag: required field missing"),
        ([], "$.args: expected an object"),
        ("x", "$.args: expected an object"),
    ],
)
def test_a_request_outside_its_type_is_refused_naming_the_field(args: object, message: str) -> None:
    assert decode_error(args) == message


@pytest.mark.parametrize(("value", "got"), [(True, "bool"), ("1", "str"), (1.0, "float"), (None, "NoneType")])
def test_ints_are_never_taken_from_other_types(value: object, got: str) -> None:
    assert decode_error({"n": value}, Counted) == f"$.args.n: expected integer, got {got}"
    assert structure({"n": 5}, Counted) == Counted(5)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"inners": [{"name": "q"}, {"name": 1}]}, "$.args.inners[1].name: expected string, got int"),
        ({"inners": [{"name": "q"}, {}]}, "$.args.inners[1].name: required field missing"),
        ({"inners": [{"name": "q", "x": 1}]}, "$.args.inners[0]: unknown field 'x'"),
        ({"inners": [{"name": "q", "n": "2"}]}, "$.args.inners[0].n: expected integer, got str"),
        ({"inners": {"name": "q"}}, "$.args.inners: expected array, got dict"),
    ],
)
def test_an_item_of_a_tuple_of_types_is_named_by_its_index(args: object, message: str) -> None:
    assert decode_error(args, Listed) == message
    assert structure({"inners": [{"name": "q"}, {"name": "r", "n": 2}]}, Listed) == Listed(
        (Inner("q"), Inner("r", 2))
    )


def test_a_real_op_names_the_bad_item_of_its_list() -> None:
    """nft.apply's `nics`: the path names the NIC."""
    nic = {"instance": "vm-1", "index": 0, "bridge": "br0"}
    with pytest.raises(DecodeError) as info:
        structure({"nics": [nic, {**nic, "index": "1"}]}, NftApply)
    assert str(info.value) == "$.args.nics[1].index: expected integer, got str"


def test_two_bad_fields_are_both_named() -> None:
    assert decode_error({"a": 1, "flag": 2}) == (
        "$.args.a: expected string, got int; $.args.flag: expected boolean, got int"
    )


def test_an_op_without_fields_refuses_any_argument() -> None:
    assert decode_error({"x": 1}, Ping) == "$.args: unknown field 'x'"


def test_the_path_is_a_parameter() -> None:
    with pytest.raises(DecodeError) as info:
        structure({"a": "x"}, Req, path="$.args.intent")
    assert str(info.value) == "$.args.intent.flag: required field missing"


def test_unstructure_gives_json_types() -> None:
    assert unstructure(Req("x", True, ("a",), Inner("q", 2))) == {
        "a": "x",
        "flag": True,
        "items": ["a"],
        "inner": {"name": "q", "n": 2},
    }


# --- the duplicate-key hook (bcd_shared.strictjson), called directly: the decoders build theirs at import ---


def test_the_duplicate_key_hook_builds_the_object_and_names_the_first_repeated_key() -> None:
    from bcd_shared.strictjson import unique_keys

    hook = unique_keys(lambda key: KeyError(f"twice: {key}"))
    assert hook([]) == {}
    out = hook([("a", 1), ("b", [2])])
    assert out == {"a": 1, "b": [2]} and type(out) is dict and list(out) == ["a", "b"]
    with pytest.raises(KeyError, match="twice: b"):
        hook([("a", 1), ("b", 2), ("c", 3), ("b", 4), ("a", 5)])
    with pytest.raises(KeyError, match="twice: x"):
        hook([("x", 1), ("x", 1)])


def test_a_byte_order_mark_is_refused_as_json_loads_refuses_it() -> None:
    """The decoder built once (protocol._DECODER) keeps json.loads' own refusal of a leading BOM, word for
    word (JSONDecoder.decode alone would answer "Expecting value")."""
    for body in (b"\xef\xbb\xbf{}", b'\xef\xbb\xbf{"op":"helper.ping","args":{}}'):
        with pytest.raises(ValueError) as info:
            strict_loads(body)
        assert str(info.value) == "Unexpected UTF-8 BOM (decode using utf-8-sig): line 1 column 1 (char 0)"
    assert strict_loads(b' {"a": "\xef\xbb\xbf"}') == {"a": "\ufeff"}  # one inside a string is a character


def test_DLV_CMD_15_decode_trace_takes_a_version_00_traceparent_only() -> None:
    """DLV-CMD-15: a request's `trace` is its (trace id, parent id) when it is exactly a valid version-00
    traceparent; anything else is a DecodeError naming the field and the rule, word for word."""
    from bcd_helper.protocol import DecodeError, decode_trace

    trace, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    assert decode_trace(f"00-{trace}-{parent}-01") == (trace, parent)
    assert decode_trace(f"00-{trace}-{parent}-ff") == (trace, parent)
    rule = (
        "$.trace: expected a W3C traceparent of version 00, exactly 55 characters "
        "00-<32 hex>-<16 hex>-<2 hex> in lower case, neither id all zeros"
    )
    for bad in (f"01-{trace}-{parent}-01", f"00-{trace}-{parent}-01 ", f"00-{'0' * 32}-{parent}-01", None, 1):
        with pytest.raises(DecodeError) as info:
            decode_trace(bad)
        assert str(info.value) == rule, bad
