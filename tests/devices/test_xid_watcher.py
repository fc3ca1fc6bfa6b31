"""The XID watcher (bcd_agent.nodeparts.xid) on the simulated host, whose fake `journalctl -o json` reads
the kernel log bcd_simhost.kernellog keeps; and once against the real journalctl (a journal file built
from tests/fixtures/kernel with systemd-journal-remote)."""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
from bcd_agent.converge.types import Condition
from bcd_agent.inventory.gpus import collect_gpus
from bcd_agent.nodeparts.kinds import with_xids
from bcd_agent.nodeparts.xid import STATE_FILE, XidWatcher, journal_argv
from bcd_shared import wire
from bcd_shared.system import CommandResult, LocalSystem, System
from bcd_simhost import sim_system
from bcd_simhost.gpus import bus_id, gpu_uuid
from bcd_simhost.kernellog import boot_id, injected_line, kernel_line, xid_message
from testsupport import require_tool

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "kernel"


class Watched:
    """A watcher on the simulated host and what it published."""

    def __init__(self, root: Path, data: Path, system: System | None = None, **kw: Any) -> None:
        self.root = root
        self.system = system or sim_system(root)
        self.published: list[tuple[Condition, ...]] = []
        self.watcher = XidWatcher(
            self.system,
            str(data),
            (root / "proc/sys/kernel/random/boot_id").read_text().strip(),
            publish=self.published.append,
            inventory=lambda: collect_gpus(self.system),
            **kw,
        )
        self.watcher.load()

    @property
    def reasons(self) -> list[str]:
        return [c.reason for c in self.published[-1]] if self.published else []

    def message(self, uuid: str) -> str:
        return next(c.message for c in self.published[-1] if c.reason == uuid)


def xid(root: Path, index: int, code: int) -> None:
    kernel_line(root, xid_message(bus_id(index), code))


def reset_result(*outcomes: tuple[int, bool, bool]) -> wire.GpuResetResult:
    return wire.GpuResetResult(
        gpus=[wire.GpuResetOutcome(gpu_uuid=gpu_uuid(i), reset=r, healthy=h) for i, r, h in outcomes]
    )


async def test_xids_become_one_condition_per_gpu_with_its_uuid(sim_root: Path, tmp_path: Path) -> None:
    w = Watched(sim_root, tmp_path)
    xid(sim_root, 2, 79)
    xid(sim_root, 2, 79)
    xid(sim_root, 6, 48)
    xid(sim_root, 6, 63)
    await w.watcher.poll()
    assert w.reasons == [gpu_uuid(2), gpu_uuid(6)]
    assert "XID 79 (GPU has fallen off the bus) x2" in w.message(gpu_uuid(2))
    assert "XID 48 (Double Bit ECC Error), XID 63" in w.message(gpu_uuid(6))
    assert w.watcher.xids(gpu_uuid(6)) == (48, 63) and w.watcher.xids(gpu_uuid(0)) == ()
    assert all(c.type == "XidError" for c in w.published[-1])


async def test_lines_injected_through_dev_kmsg_raise_nothing(sim_root: Path, tmp_path: Path) -> None:
    w = Watched(sim_root, tmp_path)
    injected_line(sim_root, xid_message(bus_id(1), 79))
    kernel_line(sim_root, xid_message(bus_id(1), 79), boot="0" * 32)  # another boot's
    await w.watcher.poll()
    assert w.reasons == [] and w.watcher.state.gpus == {}


async def test_DLV_RST_14_DEV_BUSY_12_a_reset_gpu_that_reads_healthy_loses_its_xids_at_once(
    sim_root: Path, tmp_path: Path
) -> None:
    """Covers DLV-RST-14, DEV-BUSY-12: of three GPUs with XIDs, the one that reset and reads healthy
    loses its condition when gpus_reset returns (no poll after it), the one that reset but reads
    unhealthy and the one whose reset failed keep theirs, for the rest of the boot."""
    w = Watched(sim_root, tmp_path)
    for i in (1, 2, 3):
        xid(sim_root, i, 79)
    await w.watcher.poll()
    assert w.reasons == [gpu_uuid(1), gpu_uuid(2), gpu_uuid(3)]
    await w.watcher.gpus_reset(reset_result((1, True, True), (2, True, False), (3, False, False)))
    assert w.reasons == [gpu_uuid(2), gpu_uuid(3)]
    assert w.watcher.xids(gpu_uuid(1)) == ()
    # The clear is durable: an agent restarted in the same boot does not see it again.
    again = Watched(sim_root, tmp_path)
    await again.watcher.poll()
    assert again.reasons == [gpu_uuid(2), gpu_uuid(3)]
    # A new XID after the reset raises it again.
    xid(sim_root, 1, 13)
    await again.watcher.poll()
    assert again.reasons == [gpu_uuid(1), gpu_uuid(2), gpu_uuid(3)]
    assert again.watcher.xids(gpu_uuid(1)) == (13,)


async def test_xids_logged_before_the_reset_but_not_yet_read_are_cleared_too(
    sim_root: Path, tmp_path: Path
) -> None:
    """The log is read up to now before the clear: an XID the reset itself caused does not come back."""
    w = Watched(sim_root, tmp_path)
    xid(sim_root, 4, 79)
    await w.watcher.poll()
    xid(sim_root, 4, 154)  # logged during the reset, not polled yet
    await w.watcher.gpus_reset(reset_result((4, True, True)))
    assert w.reasons == []
    await w.watcher.poll()
    assert w.reasons == []


async def test_a_restart_in_the_same_boot_keeps_the_xids_and_reads_on(sim_root: Path, tmp_path: Path) -> None:
    w = Watched(sim_root, tmp_path, chunk=3)
    for _ in range(7):
        xid(sim_root, 5, 31)
    await w.watcher.poll()
    assert w.watcher.polls == 3  # 3 + 3 + 1 entries: bounded calls, all read in one poll
    state = json.loads((tmp_path / STATE_FILE).read_text())
    assert state["gpus"] == {"0000:ab:00": {"codes": {"31": 7}, "overflow": 0}}
    again = Watched(sim_root, tmp_path, chunk=3)
    assert again.watcher.state == w.watcher.state  # loaded before the first poll
    await again.watcher.poll()
    assert again.watcher.state.gpus["0000:ab:00"].codes[31] == 7  # read on after the cursor, not again
    assert again.watcher.polls == 1


async def test_a_new_boot_forgets_the_last_boots_xids(sim_root: Path, tmp_path: Path) -> None:
    w = Watched(sim_root, tmp_path)
    xid(sim_root, 0, 79)
    await w.watcher.poll()
    assert w.reasons == [gpu_uuid(0)]
    (sim_root / "proc/sys/kernel/random/boot_id").write_text("11111111-2222-4333-8444-555555555555\n")
    rebooted = Watched(sim_root, tmp_path)
    await rebooted.watcher.poll()
    assert rebooted.reasons == [] and rebooted.watcher.state.gpus == {}
    assert json.loads((tmp_path / STATE_FILE).read_text())["boot_id"].startswith("11111111")


async def test_a_bad_state_file_is_set_aside_and_the_boot_read_again(sim_root: Path, tmp_path: Path) -> None:
    xid(sim_root, 3, 92)
    (tmp_path / STATE_FILE).write_text('{"format": 1, "boot_id": "x", "surprise": true}')
    w = Watched(sim_root, tmp_path)
    await w.watcher.poll()
    assert w.reasons == [gpu_uuid(3)]


class Failing:
    def __init__(self, inner: System, result: CommandResult) -> None:
        self.inner, self.result = inner, result

    def run(self, argv: Sequence[str], **kw: Any) -> CommandResult:
        if argv[0] == "journalctl":
            return self.result
        return self.inner.run(argv, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def test_an_unreadable_kernel_log_is_said_not_fatal(sim_root: Path, tmp_path: Path) -> None:
    system = sim_system(sim_root)
    hint = (
        b"Hint: You are currently not seeing messages from other users and the system.\n"
        b"      Users in groups 'adm', 'systemd-journal' can see all messages.\n"
    )
    argv = ("journalctl",)
    blind = Watched(sim_root, tmp_path, Failing(system, CommandResult(argv, 0, b"", hint)))
    await blind.watcher.poll()
    assert "systemd-journal" in blind.watcher.blind and blind.reasons == []
    missing = Watched(sim_root, tmp_path, Failing(system, CommandResult(argv, 127, b"", b"not found")))
    await missing.watcher.poll()
    assert "127" in missing.watcher.blind or "not found" in missing.watcher.blind
    readable = Watched(sim_root, tmp_path)
    await readable.watcher.poll()
    assert readable.watcher.blind == ""


async def test_no_journal_at_all_is_said_not_silent(sim_root: Path, tmp_path: Path) -> None:
    """A container without the host's journal: journalctl --quiet finds no files, prints nothing and exits
    0. Before, the watcher took that for a quiet kernel and never said XIDs go unseen; now it is blind,
    naming the journal directories and the DaemonSet's mounts. A journal directory with no XID line yet
    is a quiet kernel."""
    (sim_root / "run/log/journal").rmdir()
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    missing = Watched(sim_root, tmp_path / "a")
    await missing.watcher.poll()
    assert "no journal at /var/log/journal or /run/log/journal" in missing.watcher.blind
    assert "bcd-daemonset.yaml" in missing.watcher.blind
    (sim_root / "run/log/journal").mkdir()
    quiet = Watched(sim_root, tmp_path / "b")
    await quiet.watcher.poll()
    assert quiet.watcher.blind == ""


async def test_the_condition_keeps_its_age_across_polls(sim_root: Path, tmp_path: Path) -> None:
    w = Watched(sim_root, tmp_path)
    xid(sim_root, 7, 79)
    await w.watcher.poll()
    first = w.published[-1][0].since_monotonic
    await trio.sleep(0.01)
    xid(sim_root, 7, 79)
    await w.watcher.poll()
    assert w.published[-1][0].since_monotonic == first and "x2" in w.published[-1][0].message


def test_diag_nvml_carries_each_gpus_xids() -> None:
    result = wire.DiagNvmlResult(
        gpus=[
            wire.GpuHealth(uuid="GPU-a", healthy=True),
            wire.GpuHealth(uuid="GPU-b", healthy=False, message="a row remap failed"),
        ]
    )
    gone = gpu_uuid(3)
    out = with_xids(result, {"GPU-b": (48, 79), gone: (79,), "PCI:0000:3b:00": (13,), "GPU-a": ()})
    assert [(g.uuid, g.healthy, list(g.xids)) for g in out.gpus] == [
        ("GPU-a", True, []),
        ("GPU-b", False, [48, 79]),
        (gone, False, [79]),  # XID 79: nvidia-smi no longer lists it
    ]
    assert out.gpus[1].message == (
        "a row remap failed; XIDs this boot: XID 48 (Double Bit ECC Error),"
        " XID 79 (GPU has fallen off the bus)"
    )
    assert out.gpus[0].message == ""
    assert (
        out.gpus[2].message == "not listed by nvidia-smi; XIDs this boot: XID 79 (GPU has fallen off the bus)"
    )


def test_journal_argv_asks_journald_for_this_boots_kernel_entries_only() -> None:
    boot = "6cb7f0e1-a2c9-4e5b-8d3f-0a1b2c3d4e5f"
    first = journal_argv(boot, "", 500)
    assert first[-4:] == [
        "--since=@0",
        "_TRANSPORT=kernel",
        "SYSLOG_FACILITY=0",
        "_BOOT_ID=6cb7f0e1a2c94e5b8d3f0a1b2c3d4e5f",
    ]
    assert "--lines=500" in first and "--output=json" in first
    on = journal_argv(boot, "s=ab;i=3;b=cd", 500)
    assert "--after-cursor=s=ab;i=3;b=cd" in on and "--since=@0" not in on
    # A cursor that is not journald's shape is not passed on (the file is the agent's own, but still).
    assert "--since=@0" in journal_argv(boot, "--file=/etc/shadow", 500)


def test_the_real_journalctl_answers_the_watchers_query(tmp_path: Path, sim_root: Path) -> None:
    """The argv against the real journalctl (systemd 252+) on a journal file imported from the fixture:
    journald's matches keep the injected, syslog and other-boot entries out, --lines bounds each call
    and --after-cursor reads on."""
    journalctl = require_tool("journalctl")
    remote = Path("/lib/systemd/systemd-journal-remote")
    if not remote.exists():
        require_tool("systemd-journal-remote")  # skipped locally, a failure under CI
    journal = tmp_path / "kernel.journal"
    subprocess.run(
        [str(remote), f"--output={journal}", str(FIXTURES / "hgx-h200_journal-export_xid.txt")],
        check=True,
        capture_output=True,
    )
    (sim_root / "proc/sys/kernel/random/boot_id").write_text("6cb7f0e1-a2c9-4e5b-8d3f-0a1b2c3d4e5f\n")
    assert Path(journalctl).name == "journalctl"
    real = LocalSystem(Path("/"))
    w = Watched(sim_root, tmp_path / "data", Failing2(sim_system(sim_root), real), chunk=4)
    (tmp_path / "data").mkdir()
    w.watcher.journal_extra = (f"--file={journal}",)
    trio.run(w.watcher.poll)
    assert {a: dict(g.codes) for a, g in w.watcher.state.gpus.items()} == {
        "0000:2a:00": {13: 2, 43: 1},
        "0000:3a:00": {31: 1, 32: 1},
        "0000:ab:00": {62: 1, 154: 1},
        "0000:ba:00": {79: 2},
        "0000:db:00": {31: 1, 94: 1},
    }
    assert w.watcher.polls == 4  # 14 matching entries, 4 a call
    assert w.reasons == [gpu_uuid(i) for i in (1, 2, 5, 6, 7)]  # the simulated host's inventory
    assert boot_id(sim_root) == "6cb7f0e1a2c94e5b8d3f0a1b2c3d4e5f"


class Failing2:
    """The simulated host, except that journalctl is the real one."""

    def __init__(self, inner: System, real: System) -> None:
        self.inner, self.real = inner, real

    def run(self, argv: Sequence[str], **kw: Any) -> CommandResult:
        return (self.real if argv[0] == "journalctl" else self.inner).run(argv, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_an_operator_raises_an_xid_on_the_simulated_host(sim_root: Path, capsys: Any) -> None:
    """`python -m bcd_simhost.kernellog DIR GPU XID`: what docs/sim.md tells a `bcd sim` user."""
    from bcd_simhost.kernellog import entries, main

    assert main([str(sim_root), "3", "48", "An uncorrectable double bit error (DBE)"]) == 0
    (entry,) = entries(sim_root)
    assert entry["MESSAGE"] == (
        "NVRM: Xid (PCI:0000:5d:00): 48, pid='<unknown>', name=<unknown>,"
        " An uncorrectable double bit error (DBE)"
    )
    assert entry["_TRANSPORT"] == "kernel" and entry["SYSLOG_FACILITY"] == "0"
    assert entry["_BOOT_ID"] == boot_id(sim_root)
    assert capsys.readouterr().out.strip() == entry["MESSAGE"]
    with pytest.raises(SystemExit):
        main([str(sim_root), "8", "79"])


async def test_a_gpu_that_fell_off_the_bus_keeps_its_uuid(sim_root: Path, tmp_path: Path) -> None:
    """nvidia-smi stops listing a GPU after XID 79: the watcher keeps the UUID the last inventory gave
    its address, so the condition and diag.nvml still name the GPU."""
    w = Watched(sim_root, tmp_path)
    listed = collect_gpus(w.system)
    w.watcher.inventory = lambda: listed
    await w.watcher.poll()
    w.watcher.inventory = lambda: attrs.evolve(listed, gpus=tuple(g for g in listed.gpus if g.index != 3))
    xid(sim_root, 3, 79)
    await w.watcher.poll()
    assert w.reasons == [gpu_uuid(3)]
    assert w.watcher.by_gpu() == {gpu_uuid(3): (79,)}


class Hanging:
    """journalctl that does not return until released."""

    def __init__(self, inner: System) -> None:
        self.inner = inner
        self.release = threading.Event()
        self.returned = False

    def run(self, argv: Sequence[str], **kw: Any) -> CommandResult:
        if argv[0] == "journalctl":
            self.release.wait(30)
            self.returned = True
        return self.inner.run(argv, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def test_a_hung_journalctl_does_not_hold_the_resets_result(
    sim_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The clear goes ahead after RESET_DRAIN_S with what was read: gpu.reset's result is not held by a
    journalctl that does not answer (it is still running when the clear is done)."""
    from bcd_agent.nodeparts import xid as watcher_module

    monkeypatch.setattr(watcher_module, "RESET_DRAIN_S", 0.1)
    w = Watched(sim_root, tmp_path)
    xid(sim_root, 2, 79)
    await w.watcher.poll()
    hanging = Hanging(w.system)
    w.watcher.system = hanging
    try:
        await w.watcher.gpus_reset(reset_result((2, True, True)))
        assert not hanging.returned and w.reasons == []
    finally:
        hanging.release.set()


class Refusing:
    def __init__(self, inner: System) -> None:
        self.inner = inner

    def run(self, argv: Sequence[str], **kw: Any) -> CommandResult:
        if argv[0] == "journalctl":
            raise PermissionError(13, "Permission denied", "journalctl")
        return self.inner.run(argv, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def test_a_journalctl_that_cannot_run_leaves_the_watcher_running(
    sim_root: Path, tmp_path: Path
) -> None:
    w = Watched(sim_root, tmp_path, Refusing(sim_system(sim_root)), poll_interval_s=0.01)
    async with trio.open_nursery() as nursery:
        await nursery.start(w.watcher.run)
        with trio.fail_after(30):
            for _ in range(3):  # three polls: the failure is not fatal to the service
                await w.watcher.poll()
        nursery.cancel_scope.cancel()
    assert "Permission denied" in w.watcher.blind
