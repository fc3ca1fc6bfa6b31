"""The OPS table (bcd_helper.ops.table) read as the server reads it: each row's module, request type and
handler resolved by name (the handler at each call), and each row's timeout, locks and flags exactly as
docs/helper-rpc.md's table documents them and as the node's client waits for them (docs/mutation.md)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from bcd_agent.helperclient import OP_TIMEOUT_S
from bcd_helper.ops import access, daemon, files, nft, table
from bcd_helper.ops.table import LOCK_ORDER, OPS, OpSpec, lock_names

REPO = Path(__file__).resolve().parents[2]
UNITS = {"s": 1, "min": 60}


def documented() -> dict[str, tuple[float, tuple[str, ...], frozenset[str]]]:
    """docs/helper-rpc.md's "Timeouts and locks" table: op -> (timeout s, locks, flags)."""
    text = (REPO / "docs/helper-rpc.md").read_text()
    section = text.split("## Timeouts and locks", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, tuple[float, tuple[str, ...], frozenset[str]]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].startswith("`"):
            continue
        amount, unit = cells[1].split(" ")
        timeout = float(amount) * UNITS[unit]
        locks = tuple(x.strip() for x in cells[2].split(",") if x.strip())
        flags = frozenset(x.strip() for x in cells[3].split(",") if x.strip() in ("destructive", "nowait"))
        for op in re.findall(r"`([a-z0-9.]+)`", cells[0]):
            rows[op] = (timeout, locks, flags)
    return rows


def test_every_row_is_as_documented() -> None:
    """Timeout, locks (in LOCK_ORDER) and flags of every op, against docs/helper-rpc.md."""
    rows = documented()
    assert set(rows) == set(OPS)
    for name, spec in OPS.items():
        assert (spec.timeout_s, spec.locks, spec.flags) == rows[name], name
        assert list(spec.locks) == sorted(spec.locks, key=LOCK_ORDER.index), name


def test_the_nodes_client_waits_for_each_ops_own_timeout() -> None:
    for name, timeout in OP_TIMEOUT_S.items():
        assert OPS[name].timeout_s == timeout, name


@pytest.mark.parametrize(
    ("op", "module", "kind", "handler"),
    [
        ("access.apply", access, access.AccessApply, "access_apply"),
        ("nft.apply", nft, nft.NftApply, "nft_apply"),
        ("nft.check", nft, nft.NftCheck, "nft_check"),
        ("daemon.swap", daemon, daemon.DaemonSwap, "daemon_swap"),
        ("daemon.confirm", daemon, daemon.DaemonConfirm, "daemon_confirm"),
        ("file.write", files, files.FileWrite, "file_write"),
    ],
)
def test_a_row_names_its_module_type_and_handler(op: str, module: object, kind: type, handler: str) -> None:
    spec = OPS[op]
    assert spec.module == module.__name__  # type: ignore[attr-defined]
    assert spec.request is kind
    assert spec.handler is getattr(module, handler)


def test_the_handler_is_looked_up_at_each_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """A handler replaced in its module is the one served (how tests stand in for an op)."""

    def stand_in(call: object, req: object) -> dict[str, object]:
        return {}

    spec = OPS["nft.check"]
    monkeypatch.setattr(nft, "nft_check", stand_in)
    assert spec.handler is stand_in


def test_a_row_made_by_op_has_its_fields() -> None:
    spec = table._op("host", "Ping", "ping", 5, ("units",), ("nowait", "destructive"), ("a",), "s")
    assert spec == OpSpec(
        "bcd_helper.ops.host",
        "Ping",
        "ping",
        5,
        ("units",),
        frozenset({"nowait", "destructive"}),
        ("a",),
        "s",
    )
    bare = table._op("host", "Ping", "ping", 5)
    assert (bare.locks, bare.flags, bare.shown, bare.summary) == ((), frozenset(), (), "")
    assert bare.request.__name__ == "Ping" and bare.handler.__name__ == "ping"


def test_the_shown_arguments_are_fields_of_the_request() -> None:
    """What the audit line shows of each request: only its own arguments (a misspelt name shows nothing)."""
    for name, spec in OPS.items():
        fields = {f.name for f in spec.request.__attrs_attrs__}
        assert set(spec.shown) <= fields, name


def test_lock_names_are_the_lock_order() -> None:
    assert (
        lock_names()
        == LOCK_ORDER
        == (
            "units",
            "access",
            "gpus",
            "slices",
            "libvirt",
            "nft",
            "ch",
            "system",
        )
    )
