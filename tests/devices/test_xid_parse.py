"""The XID watcher's pure core (bcd_agent.inventory.xid): NVRM lines, journald entries, the bounded
state, conditions and the state file. Fixtures: tests/fixtures/kernel (README says where each format
comes from)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bcd_agent.inventory import xid
from bcd_agent.inventory.xid import GpuAt, GpuXids, KernelEntry, XidEvent, XidState

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "kernel"
JSONL = FIXTURES / "hgx-h200_journalctl-252_o-json_xid.jsonl"
BOOT = "6cb7f0e1-a2c9-4e5b-8d3f-0a1b2c3d4e5f"  # /proc's form; journald's has no dashes


def uuid(n: int) -> str:
    return f"GPU-5f1c2a90-0000-4000-8000-{n:012x}"


# tests/fixtures/nvidia-smi: index -> pci.bus_id, as NVRM names the GPU
INVENTORY = {
    "0000:18:00": uuid(1),
    "0000:2a:00": uuid(2),
    "0000:3a:00": uuid(3),
    "0000:5d:00": uuid(4),
    "0000:9a:00": uuid(5),
    "0000:ab:00": uuid(6),
    "0000:ba:00": uuid(7),
    "0000:db:00": uuid(8),
}


def fixture_lines() -> list[bytes]:
    return JSONL.read_bytes().splitlines()


def fixture_state() -> XidState:
    entries = [e for line in fixture_lines() if (e := xid.parse_entry(line, BOOT)) is not None]
    return xid.apply_entries(XidState(BOOT), entries)


def test_the_fixture_boot_gives_each_gpu_its_codes_and_counts() -> None:
    state = fixture_state()
    assert {a: dict(g.codes) for a, g in state.gpus.items()} == {
        "0000:2a:00": {13: 2, 43: 1},
        "0000:3a:00": {31: 1, 32: 1},
        "0000:ab:00": {62: 1, 154: 1},
        "0000:ba:00": {79: 2},
        "0000:db:00": {31: 1, 94: 1},  # MIG-attributed lines count for their GPU
    }
    # Not counted: the injected (facility 1) 5d line, the syslog-transport 9a line, another boot's
    # XID 48 on 18, the NVSwitch SXid on c3.
    assert dict(state.uuids) == {"0000:2a:00": uuid(2)}
    assert state.cursor == json.loads(fixture_lines()[-1])["__CURSOR"]
    assert state.codes("0000:ba:00") == (79,) and state.codes("0000:18:00") == ()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
            XidEvent("0000:3b:00", 79, detail="pid='<unknown>', name=<unknown>, GPU has fallen off the bus."),
        ),
        (
            "NVRM: Xid (PCI:0000:3b:00): 79, pid=1122, GPU has fallen off the bus.",
            XidEvent("0000:3b:00", 79, detail="pid=1122, GPU has fallen off the bus."),
        ),
        (
            "NVRM: Xid (PCI:0000:3B:00 GPU-I:07 GPU-CI:01): 31, pid=9, name=x, Ch 00000009",
            XidEvent("0000:3b:00", 31, 7, 1, "pid=9, name=x, Ch 00000009"),
        ),
        ("NVRM: Xid (PCI:0000:3b:00 GPU-I:02): 94, x", XidEvent("0000:3b:00", 94, 2, None, "x")),
        ("NVRM: Xid (PCI:10000:01:00): 13, y\n", XidEvent("10000:01:00", 13, detail="y")),  # a VMD domain
        ("NVRM: Xid (PCI:0000:01:00): 48", XidEvent("0000:01:00", 48)),
        ("NVRM: GPU at PCI:0000:01:00: GPU-34d7319c-5b19-1e75-186d-c187099e4fe5", None),  # GPU at (below)
        ("NVRM: Xid (PCI:0000:3b:00): 79x, GPU has fallen off the bus.", None),
        ("NVRM: Xid (PCI:0000:3b:00): 123456, six digits", None),
        ("NVRM: Xid (PCI:0000:3b): 79, no device", None),
        ("NVRM: Xid (PCI:0000:3b:00.0): 79, a function", None),
        ("x NVRM: Xid (PCI:0000:3b:00): 79, not at the start", None),
        ("nvidia-nvswitch0: SXid (PCI:0000:c3:00.0): 20009, Non-fatal, Link 28", None),
        ("NVRM: GPU 0000:ba:00.0: GPU has fallen off the bus.", None),
        ("", None),
    ],
)
def test_nvrm_xid_formats(text: str, expected: XidEvent | None) -> None:
    got = xid.parse_message(text)
    if expected is None and text.startswith("NVRM: GPU at"):
        assert got == GpuAt("0000:01:00", "GPU-34d7319c-5b19-1e75-186d-c187099e4fe5")
    else:
        assert got == expected


def test_detail_is_bounded_and_printable() -> None:
    got = xid.parse_message("NVRM: Xid (PCI:0000:3b:00): 13, " + "\x1b[31m" + "A" * 5000)
    assert isinstance(got, XidEvent)
    assert len(got.detail) == xid.MAX_DETAIL_CHARS and "\x1b" not in got.detail


def test_gpu_at_needs_a_whole_uuid() -> None:
    assert xid.parse_message("NVRM: GPU at PCI:0000:01:00: GPU-34d7319c") is None
    assert xid.parse_message("NVRM: GPU at PCI:0000:01:00: GPU-34D7319C-5B19-1E75-186D-C187099E4FE5") is None


def _entry(**over: object) -> bytes:
    doc: dict[str, object] = {
        "__CURSOR": "s=1;i=2",
        "_BOOT_ID": BOOT.replace("-", ""),
        "_TRANSPORT": "kernel",
        "SYSLOG_FACILITY": "0",
        "MESSAGE": "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.",
    }
    doc.update(over)
    return json.dumps({k: v for k, v in doc.items() if v is not None}).encode()


def test_a_kernel_entry_of_this_boot_is_taken() -> None:
    message = "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus."
    assert xid.parse_entry(_entry(), BOOT) == KernelEntry("s=1;i=2", message)


@pytest.mark.parametrize(
    ("why", "line"),
    [
        ("written to /dev/kmsg from user space (LOG_USER)", _entry(SYSLOG_FACILITY="1")),
        ("sent to journald's syslog socket", _entry(_TRANSPORT="syslog")),
        ("sent with journald's native protocol", _entry(_TRANSPORT="journal")),
        ("a service's stdout", _entry(_TRANSPORT="stdout")),
        ("no facility", _entry(SYSLOG_FACILITY=None)),
        ("facility as a number", _entry(SYSLOG_FACILITY=0)),
        ("another boot", _entry(_BOOT_ID="0" * 32)),
        ("no cursor", _entry(__CURSOR=None)),
        ("an empty cursor", _entry(__CURSOR="")),
        ("a message that was not UTF-8 (journalctl prints bytes)", _entry(MESSAGE=[78, 86, 82, 77])),
        ("not an object", b"[1, 2]"),
        ("not JSON", b"NVRM: Xid (PCI:0000:3b:00): 79, x"),
        ("bad UTF-8", b"\xff\xfe"),
        (
            "over the size bound",
            _entry(MESSAGE="NVRM: Xid (PCI:0000:3b:00): 79, " + "x" * xid.MAX_LINE_BYTES),
        ),
    ],
)
def test_hostile_or_foreign_entries_are_refused(why: str, line: bytes) -> None:
    assert xid.parse_entry(line, BOOT) is None, why


def test_cursor_of_moves_past_refused_entries_but_not_garbage() -> None:
    assert xid.cursor_of(_entry(SYSLOG_FACILITY="1")) == "s=1;i=2"
    assert xid.cursor_of(b"{}") is None and xid.cursor_of(b"[]") is None and xid.cursor_of(b"x") is None
    assert xid.cursor_of(_entry(__CURSOR=7)) is None
    assert xid.cursor_of(b" " * (xid.MAX_LINE_BYTES + 1)) is None


def test_address_of_bus_id_maps_nvidia_smi_to_nvrm() -> None:
    assert xid.address_of_bus_id("00000000:3B:00.0") == "0000:3b:00"
    assert xid.address_of_bus_id("0000:3b:00.0") == "0000:3b:00"
    assert xid.address_of_bus_id("00010000:01:00.0") == "10000:01:00"
    for bad in ("00000000:3B:00", "GPU-1", "", "0000:3b:00.8", "zz000000:3B:00.0"):
        assert xid.address_of_bus_id(bad) is None, bad


def test_a_flood_grows_counts_not_memory() -> None:
    """Bounded: one code repeated is one count; distinct codes and addresses are capped."""
    state = XidState(BOOT)
    for _ in range(20_000):
        state = xid.record(state, XidEvent("0000:3b:00", 13))
    assert dict(state.gpus["0000:3b:00"].codes) == {13: 20_000}
    for code in range(100, 100 + xid.MAX_CODES + 8):
        state = xid.record(state, XidEvent("0000:01:00", code))
    held = state.gpus["0000:01:00"]
    assert len(held.codes) == xid.MAX_CODES and held.overflow == 8
    state = xid.record(state, XidEvent("0000:01:00", 100))
    assert held.codes[100] == 1 and state.gpus["0000:01:00"].codes[100] == 2  # a kept code still counts
    for bus in range(xid.MAX_GPUS + 5):
        state = xid.record(state, XidEvent(f"0001:{bus:02x}:00", 79))
    assert len(state.gpus) == xid.MAX_GPUS and state.dropped == 5 + 2
    saturated = GpuXids({79: xid.MAX_COUNT}).with_code(79)
    assert saturated.codes[79] == xid.MAX_COUNT


def test_learned_uuids_are_bounded_and_idempotent() -> None:
    state = XidState(BOOT)
    fact = GpuAt("0000:01:00", uuid(1))
    once = xid.learn(state, fact)
    assert xid.learn(once, fact) is once
    for bus in range(xid.MAX_GPUS + 3):
        state = xid.learn(state, GpuAt(f"0000:{bus:02x}:00", uuid(bus)))
    assert len(state.uuids) == xid.MAX_GPUS
    changed = xid.learn(state, GpuAt("0000:00:00", uuid(99)))  # a known address may change GPU
    assert changed.uuids["0000:00:00"] == uuid(99)


def test_one_condition_per_gpu_naming_its_uuid_and_the_codes() -> None:
    conditions = xid.xid_conditions(fixture_state(), INVENTORY)
    assert [(c.type, c.reason) for c in conditions] == [
        ("XidError", uuid(2)),
        ("XidError", uuid(3)),
        ("XidError", uuid(6)),
        ("XidError", uuid(7)),
        ("XidError", uuid(8)),
    ]
    by = {c.reason: c.message for c in conditions}
    assert by[uuid(7)].startswith(
        f"{uuid(7)} (PCI 0000:ba:00): XID 79 (GPU has fallen off the bus) x2 this boot"
    )
    assert "XID 13 (Graphics Engine Exception) x2, XID 43 (GPU stopped processing)" in by[uuid(2)]
    assert "XID 62 (Internal micro-controller halt), XID 154 (GPU recovery action changed)" in by[uuid(6)]
    assert "gpu.reset" in by[uuid(7)] and "reboot" in by[uuid(7)]


def test_an_unmapped_gpu_is_named_by_its_address_and_learned_uuids_fill_in() -> None:
    state = xid.record(XidState(BOOT), XidEvent("0000:3b:00", 4242))
    (c,) = xid.xid_conditions(state, {})
    assert c.reason == "PCI:0000:3b:00" and c.message.startswith("the GPU at PCI 0000:3b:00: XID 4242 this")
    learned = xid.learn(state, GpuAt("0000:3b:00", uuid(9)))
    assert xid.uuid_map(learned, {}) == {"0000:3b:00": uuid(9)}
    assert xid.uuid_map(learned, {"0000:3b:00": uuid(1)}) == {"0000:3b:00": uuid(1)}  # nvidia-smi wins
    (c,) = xid.xid_conditions(learned, xid.uuid_map(learned, {}))
    assert c.reason == uuid(9)


def test_overflow_is_said_and_the_message_is_bounded() -> None:
    held = GpuXids({c: 1 for c in range(1000, 1000 + xid.MAX_CODES)}, overflow=3)
    state = XidState(BOOT, gpus={"0000:3b:00": held})
    (c,) = xid.xid_conditions(state, {})
    assert "3 more of other codes" in c.message
    codes = [*xid.XID_MEANINGS, *range(10000, 10000 + xid.MAX_CODES - len(xid.XID_MEANINGS))]
    big = XidState(BOOT, gpus={"0000:3b:00": GpuXids(dict.fromkeys(codes, xid.MAX_COUNT), overflow=9)})
    (c,) = xid.xid_conditions(big, {})
    assert len(c.message.encode()) == xid.MAX_MESSAGE_BYTES and c.message.endswith("...")


def test_clear_drops_only_the_named_gpus() -> None:
    state = fixture_state()
    cleared = xid.clear(state, ["0000:ba:00", "0000:99:00"])
    assert set(cleared.gpus) == set(state.gpus) - {"0000:ba:00"}
    assert cleared.cursor == state.cursor and cleared.uuids == state.uuids
    assert xid.clear(state, ["0000:99:00"]) is state


def test_the_state_file_round_trips() -> None:
    state = xid.record(fixture_state(), XidEvent("0000:3b:00", 79))
    state = XidState(state.boot_id, state.cursor, state.gpus, state.uuids, dropped=4)
    state = XidState(
        state.boot_id,
        state.cursor,
        {**state.gpus, "0000:01:00": GpuXids({1: 1}, overflow=2)},
        state.uuids,
        state.dropped,
    )
    assert xid.from_json(xid.to_json(state)) == state


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda d: d.update(extra=1), "unknown fields ['extra']"),
        (lambda d: d.pop("cursor"), "missing fields ['cursor']"),
        (lambda d: d.update(format=2), "format"),
        (lambda d: d.update(boot_id=7), "boot_id"),
        (lambda d: d.update(gpus=[]), "gpus"),
        (lambda d: d.update(uuids=[]), "uuids"),
        (lambda d: d["gpus"].update({"3b:00": {"codes": {}, "overflow": 0}}), "not a PCI address"),
        (lambda d: d["gpus"].update({"0000:3b:00": {"codes": {}}}), "missing fields ['overflow']"),
        (lambda d: d["gpus"].update({"0000:3b:00": {"codes": {"x": 1}, "overflow": 0}}), "not an XID code"),
        (lambda d: d["gpus"].update({"0000:3b:00": {"codes": {"123456": 1}, "overflow": 0}}), "not an XID"),
        (lambda d: d["gpus"].update({"0000:3b:00": {"codes": {"79": -1}, "overflow": 0}}), "from 0 to"),
        (lambda d: d["gpus"].update({"0000:3b:00": {"codes": {"79": True}, "overflow": 0}}), "integer"),
        (lambda d: d["gpus"].update({"0000:3b:00": {"codes": [], "overflow": 0}}), "codes"),
        (
            lambda d: d["gpus"].update(
                {"0000:3b:00": {"codes": {str(c): 1 for c in range(xid.MAX_CODES + 1)}, "overflow": 0}}
            ),
            "at most",
        ),
        (
            lambda d: d["gpus"].update({f"0000:{b:02x}:00": {"codes": {}, "overflow": 0} for b in range(65)}),
            "at most",
        ),
        (lambda d: d["uuids"].update({"0000:3b:00": "GPU-nope"}), "GPU UUID"),
        (
            lambda d: d["uuids"].update({"0000:3b:00": ["GPU-34d7319c-5b19-1e75-186d-c187099e4fe5"]}),
            "GPU UUID",
        ),
        (lambda d: d["uuids"].update({"0000:3B:00": uuid(1)}), "GPU UUID"),
        (lambda d: d.update(dropped=1.5), "dropped"),
    ],
)
def test_the_state_file_is_read_strictly(change: object, words: str) -> None:
    doc = json.loads(xid.to_json(fixture_state()))
    change(doc)  # type: ignore[operator]
    with pytest.raises(xid.XidStateError, match=words.replace("[", r"\[").replace("]", r"\]")):
        xid.from_json(json.dumps(doc).encode())


def test_a_state_file_that_is_not_json_is_refused() -> None:
    with pytest.raises(xid.XidStateError, match="not JSON"):
        xid.from_json(b"{")
    with pytest.raises(xid.XidStateError, match="must be an object"):
        xid.from_json(b"[]")


def test_describe_names_well_known_codes_only() -> None:
    assert xid.describe(79) == "XID 79 (GPU has fallen off the bus)"
    assert xid.describe(48) == "XID 48 (Double Bit ECC Error)"
    assert xid.describe(5) == "XID 5"


# --- edges (docs/mutation.md "xid") ------------------------------------------------------------------


def test_line_edges_trailing_newline_spaces_and_hex_device() -> None:
    assert xid.parse_message("NVRM: Xid (PCI:0000:3b:1f): 13, x\n") == XidEvent("0000:3b:1f", 13, detail="x")
    assert xid.parse_message("NVRM: Xid (PCI:0000:01:00): 48 ") is None  # nothing but ", …" follows the code
    assert xid.parse_message("NVRM: Xid (PCI:0000:01:00): 13, ECC XX") == XidEvent(
        "0000:01:00", 13, detail="ECC XX"
    )
    at = "NVRM: GPU at PCI:0000:01:00: GPU-34d7319c-5b19-1e75-186d-c187099e4fe5"
    assert xid.parse_message(at + "\n") == GpuAt("0000:01:00", "GPU-34d7319c-5b19-1e75-186d-c187099e4fe5")
    assert xid.parse_message(at + " ") is None
    assert xid.parse_message(at + "X") is None


def _sized(size: int) -> bytes:
    base = _entry(MESSAGE="NVRM: Xid (PCI:0000:3b:00): 79, ")
    line = _entry(MESSAGE="NVRM: Xid (PCI:0000:3b:00): 79, " + "x" * (size - len(base)))
    assert len(line) == size
    return line


def test_a_line_of_exactly_the_bound_is_read() -> None:
    assert xid.parse_entry(_sized(xid.MAX_LINE_BYTES), BOOT) is not None
    assert xid.cursor_of(_sized(xid.MAX_LINE_BYTES)) == "s=1;i=2"
    assert xid.parse_entry(_sized(xid.MAX_LINE_BYTES + 1), BOOT) is None
    assert xid.cursor_of(_sized(xid.MAX_LINE_BYTES + 1)) is None


def test_each_change_keeps_the_rest_of_the_state() -> None:
    base = XidState(BOOT, "c1", {"0000:01:00": GpuXids({1: 1}, overflow=2)}, {"0000:01:00": uuid(1)}, 7)
    assert GpuXids({1: 1}, overflow=2).with_code(1) == GpuXids({1: 2}, overflow=2)
    assert GpuXids({1: 1}, overflow=2).with_code(5) == GpuXids({1: 1, 5: 1}, overflow=2)
    recorded = xid.record(base, XidEvent("0000:02:00", 79))
    assert (recorded.boot_id, recorded.cursor, recorded.uuids, recorded.dropped) == (
        BOOT,
        "c1",
        base.uuids,
        7,
    )
    full = XidState(BOOT, "c1", {f"0000:{b:02x}:00": GpuXids({1: 1}) for b in range(xid.MAX_GPUS)}, {}, 7)
    dropped = xid.record(full, XidEvent("0000:ff:00", 79))
    assert (dropped.boot_id, dropped.cursor, dropped.gpus, dropped.dropped) == (BOOT, "c1", full.gpus, 8)
    learned = xid.learn(base, GpuAt("0000:02:00", uuid(2)))
    assert (learned.boot_id, learned.cursor, learned.gpus, learned.dropped) == (BOOT, "c1", base.gpus, 7)
    applied = xid.apply_entries(base, [KernelEntry("c2", "not NVRM")])
    assert applied == XidState(BOOT, "c2", base.gpus, base.uuids, 7)
    cleared = xid.clear(base, ["0000:01:00"])
    assert cleared == XidState(BOOT, "c1", {}, base.uuids, 7)


def test_a_gpu_without_codes_raises_nothing_and_overflow_alone_does() -> None:
    state = XidState(
        BOOT,
        gpus={"0000:01:00": GpuXids(), "0000:02:00": GpuXids(overflow=3), "0000:03:00": GpuXids({79: 1})},
    )
    assert [c.reason for c in xid.xid_conditions(state, {})] == ["PCI:0000:02:00", "PCI:0000:03:00"]


def test_bounded_keeps_exactly_the_limit() -> None:
    assert xid.bounded("x" * xid.MAX_MESSAGE_BYTES) == "x" * xid.MAX_MESSAGE_BYTES
    assert xid.bounded("x" * (xid.MAX_MESSAGE_BYTES + 1)) == "x" * (xid.MAX_MESSAGE_BYTES - 3) + "..."


def test_the_state_file_bytes_are_compact_and_sorted() -> None:
    state = XidState(BOOT, "c", {"0000:02:00": GpuXids({79: 2, 13: 1})}, {"0000:02:00": uuid(2)}, 1)
    assert xid.to_json(state) == (
        b'{"boot_id":"' + BOOT.encode() + b'","cursor":"c","dropped":1,"format":1,'
        b'"gpus":{"0000:02:00":{"codes":{"13":1,"79":2},"overflow":0}},'
        b'"uuids":{"0000:02:00":"' + uuid(2).encode() + b'"}}\n'
    )


def test_the_state_file_at_its_bounds_is_read() -> None:
    doc = json.loads(xid.to_json(XidState(BOOT)))
    doc["gpus"] = {f"0000:{b:02x}:00": {"codes": {}, "overflow": 0} for b in range(xid.MAX_GPUS)}
    doc["gpus"]["0000:00:00"] = {
        "codes": {str(99968 + c): xid.MAX_COUNT for c in range(xid.MAX_CODES - 1)} | {"1": 1},
        "overflow": xid.MAX_COUNT,
    }
    doc["uuids"] = {f"0000:{b:02x}:00": uuid(b) for b in range(xid.MAX_GPUS)}
    doc["dropped"] = xid.MAX_COUNT
    state = xid.from_json(json.dumps(doc).encode())
    assert len(state.gpus) == xid.MAX_GPUS and len(state.uuids) == xid.MAX_GPUS
    assert (
        len(state.gpus["0000:00:00"].codes) == xid.MAX_CODES
        and state.gpus["0000:00:00"].codes[99968] == xid.MAX_COUNT
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.pop("cursor"), "xid state: missing fields ['cursor']"),
        (lambda d: d.update(cursor=1), "xid state: boot_id and cursor must be strings"),
        (lambda d: d.update(dropped=-1), "xid state: dropped: must be an integer from 0 to 1000000000"),
        (
            lambda d: d["gpus"].update({"0000:3b:00": {"codes": {}}}),
            "xid state: gpus['0000:3b:00']: missing fields ['overflow']",
        ),
        (
            lambda d: d["gpus"].update({"0000:3b:00": {"codes": {"79": "1"}, "overflow": 0}}),
            "xid state: gpus['0000:3b:00'].codes['79']: must be an integer from 0 to 1000000000",
        ),
        (
            lambda d: d["gpus"].update({"0000:3b:00": {"codes": {}, "overflow": None}}),
            "xid state: gpus['0000:3b:00'].overflow: must be an integer from 0 to 1000000000",
        ),
    ],
)
def test_a_refused_state_file_names_the_field(change: object, message: str) -> None:
    doc = json.loads(xid.to_json(XidState(BOOT)))
    change(doc)  # type: ignore[operator]
    with pytest.raises(xid.XidStateError) as caught:
        xid.from_json(json.dumps(doc).encode())
    assert str(caught.value) == message
