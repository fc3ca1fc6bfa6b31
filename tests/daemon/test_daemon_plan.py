"""The daemon section's pure planner and its reading of the wire (agent/bcd_agent/sections/daemon/model.py).

Covers DLV-SPEC-08 (the section holds the self-update target: version, URL, SHA-256, signature)."""

from __future__ import annotations

import pytest
from bcd_agent.sections.daemon.model import Observed, ReleaseTarget, Step, plan, target_from_wire
from bcd_shared import wire
from bcd_shared.errors import TerminalError

SHA = "ab" * 32
SIG = bytes(64)


def _section(**kw: object) -> wire.DaemonSection:
    fields: dict[str, object] = {
        "version": "1.2.0",
        "url": "https://releases.example.com/bcd/1.2.0/bcd",
        "sha256": SHA,
        "signature": SIG,
    }
    fields.update(kw)
    return wire.DaemonSection(**fields)  # type: ignore[arg-type]


def test_DLV_SPEC_08_the_section_is_the_self_update_target() -> None:
    target = target_from_wire(_section(rollback=True))
    assert target == ReleaseTarget("1.2.0", "https://releases.example.com/bcd/1.2.0/bcd", SHA, SIG, True)
    assert target is not None and target.artifact_name == "bcd-1.2.0"
    assert target_from_wire(None) is None
    assert target_from_wire(wire.DaemonSection()) is None


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("version", "../1", "daemon.version"),
        ("url", "http://releases.example.com/bcd", "daemon.url"),
        ("sha256", "AB" * 32, "daemon.sha256"),
        ("signature", b"short", "daemon.signature"),
        ("signature", bytes(65), "daemon.signature"),
        # A section with some of the target is not an empty one: the missing field is named.
        ("version", "", "daemon.version"),
        ("url", "", "daemon.url"),
        ("sha256", "", "daemon.sha256"),
    ],
    ids=["version", "url", "sha256", "signature-short", "signature-65", "no-version", "no-url", "no-sha256"],
)
def test_a_bad_field_fails_naming_it(field: str, value: object, named: str) -> None:
    """DLV-SPEC-08: each of version, URL, SHA-256 and the 64-byte signature is required of a target,
    and a bad or missing one fails the section naming it."""
    with pytest.raises(TerminalError) as info:
        target_from_wire(_section(**{field: value}))
    assert info.value.reason == "InvalidRelease" and info.value.message.startswith(named)


def test_plan_steps() -> None:
    target = target_from_wire(_section())
    assert plan(None, Observed("1.0.0", None)) == ()
    assert plan(target, Observed("1.2.0", None)) == ()
    assert plan(target, Observed("1.0.0", None)) == (Step.DOWNLOAD, Step.SWAP, Step.RESTART)
    assert plan(target, Observed("1.0.0", "cd" * 32)) == (Step.DOWNLOAD, Step.SWAP, Step.RESTART)
    assert plan(target, Observed("1.0.0", SHA)) == (Step.SWAP, Step.RESTART)


def test_is_empty_never_raises_on_a_bad_section() -> None:
    from bcd_agent.sections.daemon.section import DaemonSection

    section = DaemonSection.__new__(DaemonSection)  # is_empty needs none of its parts
    assert section.is_empty(None) and section.is_empty(wire.DaemonSection())
    assert not section.is_empty(_section(version="../bad"))
    assert not section.is_empty(wire.DaemonSection(rollback=True))
