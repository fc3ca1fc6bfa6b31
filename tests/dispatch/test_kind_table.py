"""The kind table against the seed's "Kinds by lane" table and "Timeouts" paragraph (DLV-KIND, DLV-TMO)."""

from __future__ import annotations

import re

import pytest
from bcd_agent.dispatch.kinds import DEFAULT_TIMEOUT_S, KINDS, UPGRADE_KIND, Lane, Role, timeout_for
from testsupport import SHARED, require_shared

SEED = SHARED / "seeds" / "delivery.md"


def _seed_rows() -> dict[str, tuple[str, set[str], set[str]]]:
    """kind -> (lane, roles, flags) parsed from the seed's table."""
    text = SEED.read_text()
    section = text[text.index("### Kinds by lane") : text.index("### Results and acknowledgements")]
    rows: dict[str, tuple[str, set[str], set[str]]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].startswith("`") or cells[0] == "Lane":
            continue
        lane = cells[0].strip("`")
        roles = {r.strip() for r in cells[2].split(",")}
        flags_text = cells[3].split(";")[0].split("(")[0]
        flags = {f.strip() for f in flags_text.split(",") if f.strip() and f.strip() != "none"}
        for kind in re.findall(r"`([a-zA-Z.]+)`", cells[1]):
            rows[kind] = (lane, roles, flags)
    return rows


def test_DLV_KIND_01_to_21_table_matches_the_seed() -> None:
    require_shared(SEED)
    seed = _seed_rows()
    assert len(seed) == 20
    for kind, (lane, roles, flags) in seed.items():
        spec = KINDS[kind]
        ours = {
            name
            for name, on in (
                ("retry-safe", spec.retry_safe),
                ("attested", spec.attested),
                ("destructive", spec.destructive),
                ("self-terminating", spec.self_terminating),
            )
            if on
        }
        assert (spec.lane.value, {r.value for r in spec.roles}, ours) == (lane, roles, flags), kind
    assert set(KINDS) == set(seed) | {UPGRADE_KIND}


def test_DLV_SIG_06_destructive_kinds() -> None:
    """The seed's list, plus driver.invoke which its table marks destructive (Q-DLV-KIND-02)."""
    listed = {
        "gpu.reset",
        "node.reboot",
        "bmc.power",
        "bmc.firmware",
        "bmc.storage",
        "disk.wipe",
        "deploy.image",
    }
    listed |= {"bmc.boot", "bmc.rotate", "site.httpProxy", "driver.invoke"}
    assert {k for k, s in KINDS.items() if s.destructive} == listed


def test_DLV_REC_12_not_retry_safe_kinds() -> None:
    seed_list = {
        "disk.wipe", "deploy.image", "boot.kexec", "bmc.power", "bmc.rotate", "bmc.firmware", "bmc.storage",
        "site.httpProxy", "instance.snapshot", "gpu.reset",
    }  # fmt: skip
    not_retry_safe = {k for k, s in KINDS.items() if not s.retry_safe}
    assert seed_list <= not_retry_safe
    assert not_retry_safe - seed_list == {"driver.invoke"}


def test_DLV_SIG_17_attested_kinds() -> None:
    assert {k for k, s in KINDS.items() if s.attested} == {
        "diag.nvml",
        "diag.dcgm",
        "gpu.reset",
        "disk.wipe",
        "bmc.rotate",
    }


MIN = 60.0


@pytest.mark.parametrize(
    ("kind", "minutes"),
    [
        ("diag.nvml", 2), ("inventory.refresh", 2), ("gpu.reset", 5), ("logs.collect", 15),
        ("node.reboot", 15), ("site.httpProxy", 1), ("bmc.query", 2), ("bmc.boot", 2),
        ("boot.prepareRamdisk", 2), ("boot.cleanUp", 2), ("bmc.power", 5), ("bmc.rotate", 5),
        ("boot.kexec", 15), ("bmc.firmware", 60), ("bmc.storage", 60), ("diag.dcgm", 60),
        ("deploy.image", 60), ("disk.wipe", 360),
    ],
)  # fmt: skip
def test_DLV_TMO_05_07_08_built_in_timeouts(kind: str, minutes: float) -> None:
    assert timeout_for(kind) == minutes * MIN


def test_DLV_TMO_06_unregistered_kind_gets_15_minutes() -> None:
    assert timeout_for("vendor.unknown") == DEFAULT_TIMEOUT_S == 15 * MIN


def test_DLV_LANE_01_to_03_lanes_of_kinds() -> None:
    assert KINDS["gpu.reset"].lane is Lane.CONTROL and KINDS["disk.wipe"].lane is Lane.PROVISION
    assert KINDS["logs.collect"].lane is Lane.BULK
    assert Role.NODE in KINDS[UPGRADE_KIND].roles
