"""The kind table against the seed's "Kinds by lane" table and "Timeouts" paragraph (DLV-KIND, DLV-TMO)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from bcd_agent.dispatch.command import UpdateState
from bcd_agent.dispatch.kinds import DEFAULT_TIMEOUT_S, KINDS, UPGRADE_KIND, Lane, Role, timeout_for
from bcd_agent.journal import CommandState
from bcd_agent.kinds.testing import EffectHandler
from dhelpers import Gate, Harness, Pki, effect_ids, effect_lines, make_command, start
from testsupport import SHARED, require_shared


@pytest.fixture(scope="module")
def pki() -> Pki:
    return Pki.build()


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


def test_the_kind_table_matches_the_seed() -> None:
    """KINDS row for row against the seed's table. It names no id: a table compared with a table shows
    nothing the code does; test_each_kind_row_is_what_the_dispatcher_does asserts each row (DLV-KIND-…)
    through the dispatcher."""
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


def test_lanes_of_a_few_kinds_and_the_upgrade_kinds_role() -> None:
    """A table check, naming no id: the lanes are asserted by the credit each kind holds in
    test_each_kind_row_is_what_the_dispatcher_does."""
    assert KINDS["gpu.reset"].lane is Lane.CONTROL and KINDS["disk.wipe"].lane is Lane.PROVISION
    assert KINDS["logs.collect"].lane is Lane.BULK
    assert Role.NODE in KINDS[UPGRADE_KIND].roles


# --- the rows as behaviour: each kind's lane, roles and flags, through the real dispatcher ----------------
#
# A row here is the seed's, written out (not read from KINDS), and every column is checked by what the
# dispatcher does with a command of that kind: on a role outside the row it is UNSUPPORTED; on its roles it
# runs holding a credit of its lane and no other; an attested kind's result is node-signed; a destructive
# kind is under the quorum (UNBATCHED_LIMIT with approver keys and no allowance); after a crash during its
# effect a retry-safe kind runs again and another is FAILED `interrupted`; a self-terminating kind has
# `running{boot_id}` on disk and is SUCCEEDED `rebooted` from the next boot. The kinds get the test kinds'
# effect handler: this build has no handler for most of them, and the rules are the dispatcher's.

KIND_ROWS = [
    ("DLV-KIND-02", "inventory.refresh", "control", "node site ramdisk", "retry-safe"),
    ("DLV-KIND-03", "diag.nvml", "control", "node ramdisk", "retry-safe attested"),
    ("DLV-KIND-04", "gpu.reset", "control", "node", "attested destructive"),
    ("DLV-KIND-05", "node.reboot", "control", "node site", "retry-safe self-terminating destructive"),
    ("DLV-KIND-06", "bmc.query", "control", "site", "retry-safe"),
    ("DLV-KIND-07", "bmc.boot", "control", "site", "retry-safe destructive"),
    ("DLV-KIND-08", "bmc.power", "control", "site", "destructive"),
    ("DLV-KIND-09", "bmc.firmware", "control", "site", "destructive"),
    ("DLV-KIND-10", "bmc.storage", "control", "site", "destructive"),
    ("DLV-KIND-11", "bmc.rotate", "control", "site", "attested destructive"),
    ("DLV-KIND-12", "site.httpProxy", "control", "site", "destructive"),
    ("DLV-KIND-13", "boot.prepareRamdisk", "control", "site", "retry-safe"),
    ("DLV-KIND-14", "boot.cleanUp", "control", "site", "retry-safe"),
    ("DLV-KIND-15", "boot.kexec", "control", "ramdisk", "self-terminating"),
    ("DLV-KIND-16", "disk.wipe", "provision", "ramdisk", "attested destructive"),
    ("DLV-KIND-17", "deploy.image", "provision", "ramdisk", "destructive"),
    ("DLV-KIND-18", "diag.dcgm", "provision", "node ramdisk", "retry-safe attested"),
    (
        "KIND 19 (not claimed: no bcx plugin)",
        "driver.invoke",
        "provision",
        "node site ramdisk",
        "destructive",
    ),
    ("DLV-KIND-20", "logs.collect", "bulk", "node site ramdisk", "retry-safe"),
    ("DLV-KIND-21", "instance.snapshot", "bulk", "node", ""),
]


async def _run_once(h: Any, kind: str, log: Path, *, crash: bool = False) -> tuple[Any, dict[Lane, int]]:
    """Deliver one command of `kind`; return it and the lanes' credits in use during its effect. With
    `crash` the process stops during the effect, nothing settled."""
    gate = Gate()
    credits: dict[Lane, int] = {}
    cmd = make_command(h.pki, kind=kind, kinds=KINDS)
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher({kind: EffectHandler(log, during_effect=gate)}, kinds=KINDS))
        d.deliver(cmd)
        await trio.testing.wait_all_tasks_blocked()
        credits = {lane: d.credits_in_use(lane) for lane in Lane}
        if crash:
            n.cancel_scope.cancel()
        else:
            gate.release.set()
            await h.sink.wait_terminal(cmd.id)
            n.cancel_scope.cancel()
    return cmd, credits


@pytest.mark.parametrize(
    ("ident", "kind", "lane", "roles", "flags"), KIND_ROWS, ids=[r[1] for r in KIND_ROWS]
)
async def test_each_kind_row_is_what_the_dispatcher_does(
    tmp_path: Path, pki: Pki, ident: str, kind: str, lane: str, roles: str, flags: str
) -> None:
    """Covers DLV-KIND-02..18, DLV-KIND-20 and DLV-KIND-21, one row each (see the comment above KIND_ROWS),
    and DLV-KIND-01: every
    kind is UNSUPPORTED on each role outside its row, and runs on each role inside it. Covers DLV-LANE-01,
    DLV-LANE-02 and DLV-LANE-03: while it runs, each kind holds a credit of its row's lane (control: the
    diagnostics, inventory, reboots, resets, BMC operations, kexec; provision: disk wipe, image write,
    DCGM; bulk: log collection) and of no other. `driver.invoke`'s row is run too, but its id is not
    claimed: the row's other half, running in a bcx plugin bcd hosts, is not built."""
    words = set(flags.split())
    own = [Role(r) for r in roles.split()]
    for role in Role:
        h = Harness(tmp_path / role.value, pki, role=role)
        cmd, credits = await _run_once(h, kind, tmp_path / f"{role.value}.log")
        done = h.sink.terminal(cmd.id)
        assert done is not None
        if role not in own:
            assert (done.state, done.reason) == (UpdateState.REJECTED, "UNSUPPORTED"), (role, done)
            assert f"not on a {role.value} agent" in done.message
            assert not (tmp_path / f"{role.value}.log").exists()
            continue
        assert done.state is UpdateState.SUCCEEDED, (role, done)
        assert credits == {x: int(x is Lane(lane)) for x in Lane}, role
        assert bool(done.node_sig) is ("attested" in words)
    # The quorum: approver keys and no unbatched allowance.
    h = Harness(tmp_path / "quorum", pki, bundle=pki.bundle(approvers=3, allowance=0), role=own[0])
    cmd, _ = await _run_once(h, kind, tmp_path / "quorum.log")
    done = h.sink.terminal(cmd.id)
    assert done is not None
    if "destructive" in words:
        assert (done.state, done.reason) == (UpdateState.REJECTED, "UNBATCHED_LIMIT")
    else:
        assert done.state is UpdateState.SUCCEEDED
    # A crash during the effect, then the same boot or the next one.
    for boot in ("boot-1", "boot-2"):
        h = Harness(tmp_path / f"crash-{boot}", pki, role=own[0])
        log = tmp_path / f"crash-{boot}.log"
        cmd, _ = await _run_once(h, kind, log, crash=True)
        entry = h.journal.get_command(cmd.id)
        assert entry is not None
        if "self-terminating" in words:
            assert (entry.state, entry.boot_id) == (CommandState.RUNNING, "boot-1")
        h.reopen(boot_id=boot)
        async with trio.open_nursery() as n:
            d = await start(n, h.dispatcher({kind: EffectHandler(log)}, kinds=KINDS))
            d.deliver(cmd)
            done = await h.sink.wait_terminal(cmd.id)
            n.cancel_scope.cancel()
        if "self-terminating" in words and boot == "boot-2":
            assert (done.state, done.reason) == (UpdateState.SUCCEEDED, "rebooted")
            assert len(effect_lines(log)) == 0  # the gate held the effect: the reboot completed it
        elif "retry-safe" in words:
            assert done.state is UpdateState.SUCCEEDED and list(effect_ids(log)) == [cmd.id]
        else:
            assert (done.state, done.error_code) == (UpdateState.FAILED, "interrupted")
            assert not log.exists()
