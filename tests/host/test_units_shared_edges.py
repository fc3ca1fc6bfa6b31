"""The units' shared modules at their edges, written against mutation testing's survivors (docs/mutation.md,
"shared units: k8s, _base, bootargs, distro, nvsmi, rootonly"): the root-only wrapper, the nvidia-smi
parsers, boot loader arguments, distribution families, the shared steps and decoders, and the one-unit
runner's corners. In-process and quick; the units' whole runs on the simulated host are in
test_units_simhost.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from bcd_shared.errors import RetryableError
from bcd_shared.system import CommandResult, LocalSystem
from bcd_shared.units import (
    ApplyContext,
    ConfigUnit,
    Issue,
    Plan,
    RootOnlySystem,
    UnitCondition,
    UnitContext,
    UnitResult,
    clean,
    converge_unit,
    for_root,
    nvsmi,
    rootonly,
)

# -- rootonly


def test_for_root_wraps_only_as_root_and_never_twice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    system = LocalSystem(tmp_path)

    class Marked(LocalSystem):
        root_only = True  # already follows the rule (the helper's per-call System)

    marked = Marked(tmp_path)
    wrapped = RootOnlySystem(system)
    monkeypatch.setattr(rootonly.os, "geteuid", lambda: 0)
    assert rootonly.acting_as_root()
    assert isinstance(for_root(system), RootOnlySystem) and for_root(system).inner is system  # type: ignore[attr-defined]
    assert for_root(marked) is marked and for_root(wrapped) is wrapped
    for uid in (1, 1000):
        monkeypatch.setattr(rootonly.os, "geteuid", lambda uid=uid: uid)
        assert not rootonly.acting_as_root()
        assert for_root(system) is system and for_root(marked) is marked and for_root(wrapped) is wrapped


# -- _unit and units/__init__: the one-unit runner's corners


class _Step:
    def __init__(self, name: str, fail: Exception | None = None) -> None:
        self.name, self.fail = name, fail

    def describe(self) -> str:
        return f"step {self.name}"

    def apply(self, system: Any, actx: Any) -> None:
        system.append(self.name)
        if self.fail is not None:
            raise self.fail


def test_HST_LVL_a_failed_step_whose_replan_fails_keeps_the_plans_conditions() -> None:
    """After a step failed and changed the host, the conditions come from planning again; when that
    observation itself fails, from the plan that was being applied (never lost, never None)."""
    cond = (UnitCondition("FabricManagerDown", "NotRunning", "m"),)

    class Flaky(ConfigUnit[str, int]):
        name = "flaky"

        def __init__(self) -> None:
            self.observed = 0

        def decode(self, obj: dict[str, Any]) -> str:
            return "s"

        def observe(self, system: Any, settings: str | None, ctx: Any) -> int:
            self.observed += 1
            if self.observed > 1:
                raise RetryableError("Unreadable", "cannot read the host")
            return 0

        def plan(self, settings: str | None, observed: int) -> Plan:
            return Plan((_Step("ok"), _Step("bad", RetryableError("X", "step failed"))), conditions=cond)

    host: list[str] = []
    r = converge_unit(Flaky(), "s", host, UnitContext(), ApplyContext())  # type: ignore[arg-type]
    assert host == ["ok", "bad"]
    assert r == UnitResult("flaky", True, (Issue("retryable", "flaky: step failed"),), cond, ("step ok",))


def test_clean_hands_the_context_to_the_unit(tmp_path: Path) -> None:
    """`clean` observes with the caller's UnitContext and applies with its ApplyContext: k8s-join's
    observation carries root's allowlist, and the clean-up's removal goes through the path guard."""
    system = LocalSystem(tmp_path)
    assert clean("k8s-join", system, UnitContext(), ApplyContext()) == UnitResult("k8s-join")
    system.write_atomic("/etc/sysctl.d/90-bcd.conf", b"vm.swappiness = 10\n")
    guarded: list[str] = []
    r = clean("sysctl", system, UnitContext(), ApplyContext(guard=guarded.append))
    assert r.ok and guarded == ["/etc/sysctl.d/90-bcd.conf"]
    assert not system.exists("/etc/sysctl.d/90-bcd.conf")


def _refusing_guard(path: str) -> None:
    raise RetryableError("RootOnly", f"{path} refused")


def test_clean_refused_by_the_guard_removes_nothing(tmp_path: Path) -> None:
    system = LocalSystem(tmp_path)
    system.write_atomic("/etc/sysctl.d/90-bcd.conf", b"vm.swappiness = 10\n")
    r = clean("sysctl", system, UnitContext(), ApplyContext(guard=_refusing_guard))
    assert r.issues == (Issue("retryable", "sysctl: /etc/sysctl.d/90-bcd.conf refused"),)
    assert system.exists("/etc/sysctl.d/90-bcd.conf")


# -- nvsmi


def _smi(tmp: Path, rc: int, out: bytes) -> tuple[LocalSystem, list[tuple[str, ...]]]:
    calls: list[tuple[str, ...]] = []

    def smi(system: Any, argv: Any, stdin: bytes | None) -> CommandResult:
        calls.append(tuple(argv))
        return CommandResult(tuple(argv), rc, out, b"")

    return LocalSystem(tmp, tools={"nvidia-smi": smi}), calls


def test_nvsmi_query_rows_past_blank_lines_and_bytes_that_are_not_utf8(tmp_path: Path) -> None:
    # --query-gpu rows as the reference CSV shows them (590.48.01), with a blank line between two GPUs,
    # a row of the wrong width and a product name byte that is not UTF-8.
    out = (
        b"0, GPU-a, Enabled, Enabled\n\n  \n"
        b"1, GPU-b\xff, Disabled, [N/A]\n2, GPU-c\n3, GPU-d, Enabled, Enabled\n"
    )
    system, calls = _smi(tmp_path, 0, out)
    assert nvsmi.query(system, nvsmi.MIG_QUERY) == [
        ["0", "GPU-a", "Enabled", "Enabled"],
        ["1", "GPU-b\ufffd", "Disabled", "[N/A]"],
        ["3", "GPU-d", "Enabled", "Enabled"],
    ]
    assert calls == [("nvidia-smi", f"--query-gpu={nvsmi.MIG_QUERY}", "--format=csv,noheader,nounits")]
    failed, _ = _smi(tmp_path, 9, out)
    assert nvsmi.query(failed, nvsmi.MIG_QUERY) is None
    assert nvsmi.number("700.00 W") == 700.0 and nvsmi.number("[N/A]") is None and nvsmi.number("") is None
