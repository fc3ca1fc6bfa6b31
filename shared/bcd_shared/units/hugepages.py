"""hugepages: the persistent 2 MiB and 1 GiB pools and the transparent huge page policy (HST-HP-*).

2 MiB pages are allocated at runtime and read back (a shortfall is retried). 1 GiB pages are tried
at runtime; when the kernel cannot find the memory, they are reserved on the kernel command line
(GRUB drop-in or grubby), recorded in /var/lib/bcd-hostconfig/hugepages-1g-boot, and the unit
waits for a reboot. With pages1g > 0 a hugetlbfs of 1 GiB pages is mounted at /dev/hugepages1G
(a systemd mount unit where systemd runs, else `mount` itself).

Decisions: Q-HST-HP-01 an unset count or `transparent` is left unmanaged; perNuma defaults to false.
Q-HST-HP-02 no boot loader tool is retryable; update-grub wins; the drop-in appends to
GRUB_CMDLINE_LINUX like cpu's. Q-HST-HP-03 the reboot message is `hugepages: <n> pages of 1 GiB
could not be allocated now (<m> allocated); the boot loader reserves them from the next boot:
reboot the node`; a 2 MiB shortfall reads `hugepages: <path> holds <m> pages, not <n> (memory
fragmented or short)`. Q-HST-HP-04 pages1g: 0 leaves an existing mount unit in place (a VMM may
still use the mount); it is not removed.
"""

from __future__ import annotations

from typing import Any

from attrs import frozen

from bcd_shared.errors import RetryableError
from bcd_shared.system import System

from ._base import (
    STATE_DIR,
    ApplyContext,
    Fields,
    Issue,
    Plan,
    RebootRequired,
    Run,
    Step,
    WriteFile,
    WriteKernel,
    header,
    read_text_record,
    systemd_running,
)
from ._unit import ConfigUnit, UnitContext
from .bootargs import BootloaderView, SetBootArgs, observe_bootloader

NAME = "hugepages"
MAX_PAGES = 1 << 24
THP = "/sys/kernel/mm/transparent_hugepage/enabled"
BOOT_RECORD = f"{STATE_DIR}/hugepages-1g-boot"
MOUNT_UNIT = "/etc/systemd/system/dev-hugepages1G.mount"
MOUNT_POINT = "/dev/hugepages1G"
GRUB_DROPIN = "/etc/default/grub.d/90-bcd-hugepages.cfg"
SIZES = {"2m": "hugepages-2048kB", "1g": "hugepages-1048576kB"}


def pool_path(size: str, node: int | None) -> str:
    if node is None:
        return f"/sys/kernel/mm/hugepages/{SIZES[size]}/nr_hugepages"
    return f"/sys/devices/system/node/node{node}/hugepages/{SIZES[size]}/nr_hugepages"


def mount_unit_text() -> bytes:
    return (
        header(NAME)
        + "[Unit]\n"
        + "Description=Huge pages of 1 GiB for VMMs (bcd hugepages unit)\n"
        + "DefaultDependencies=no\n"
        + "Before=sysinit.target\n"
        + "ConditionPathExists=/sys/kernel/mm/hugepages/hugepages-1048576kB\n"
        + "\n[Mount]\n"
        + "What=hugetlbfs\n"
        + f"Where={MOUNT_POINT}\n"
        + "Type=hugetlbfs\n"
        + "Options=pagesize=1G\n"
        + "\n[Install]\n"
        + "WantedBy=sysinit.target\n"
    ).encode()


def boot_args(total: int) -> str:
    return f"hugepagesz=1G hugepages={total}" if total else ""


@frozen
class HugepagesSettings:
    pages2m: int | None = None
    pages1g: int | None = None
    transparent: str | None = None
    per_numa: bool = False


@frozen
class HugepagesObserved:
    has_1g: bool
    thp: str | None  # the bracketed policy, None without THP
    numa_nodes: tuple[int, ...]
    counts: tuple[tuple[str, int | None], ...]  # pool path -> nr_hugepages
    boot_record: str | None
    bootloader: BootloaderView
    systemd: bool
    mount_unit: bytes | None
    mounted: bool
    mount_enabled: bool


@frozen
class Set1GPages:
    """Try 1 GiB pages at runtime; on a shortfall reserve them on the kernel command line."""

    paths: tuple[tuple[str, int], ...]
    boot_total: int
    previous_args: str
    bootloader: BootloaderView

    def describe(self) -> str:
        return f"set 1 GiB pages ({', '.join(f'{p}={n}' for p, n in self.paths)})"

    def apply(self, system: System, actx: ApplyContext) -> None:
        short = []
        for path, count in self.paths:
            WriteKernel(path, str(count)).apply(system, actx)
            got = (system.read_text(path) or "0").strip()
            if got != str(count):
                short.append((path, count, got))
        if not short:
            return
        args = boot_args(self.boot_total)
        if args != self.previous_args:
            SetBootArgs(
                NAME, GRUB_DROPIN, BOOT_RECORD, self.previous_args, args, args, self.bootloader
            ).apply(system, actx)
        want = sum(c for _, c, _ in short)
        got_sum = sum(int(g) if g.isdigit() else 0 for _, _, g in short)
        raise RebootRequired(
            f"hugepages: {want} pages of 1 GiB could not be allocated now ({got_sum} allocated); "
            "the boot loader reserves them from the next boot: reboot the node"
        )


@frozen
class Set2MPages:
    path: str
    count: int

    def describe(self) -> str:
        return f"set {self.path} to {self.count}"

    def apply(self, system: System, actx: ApplyContext) -> None:
        WriteKernel(self.path, str(self.count)).apply(system, actx)
        got = (system.read_text(self.path) or "0").strip()
        if got != str(self.count):
            raise RetryableError(
                "HugepagesShort",
                f"hugepages: {self.path} holds {got} pages, not {self.count} (memory fragmented or short)",
            )


class Hugepages(ConfigUnit[HugepagesSettings, HugepagesObserved]):
    name = NAME

    def decode(self, obj: dict[str, Any]) -> HugepagesSettings:
        f = Fields(obj)
        s = HugepagesSettings(
            pages2m=f.integer("pages2m", 0, MAX_PAGES),
            pages1g=f.integer("pages1g", 0, MAX_PAGES),
            transparent=f.choice("transparent", ("always", "madvise", "never")),
            per_numa=bool(f.boolean("perNuma")),
        )
        f.done()
        return s

    def observe(
        self, system: System, settings: HugepagesSettings | None, ctx: UnitContext
    ) -> HugepagesObserved:
        nodes = tuple(
            sorted(
                int(n[4:])
                for n in system.listdir("/sys/devices/system/node")
                if n.startswith("node") and n[4:].isdigit()
            )
        )
        paths = [pool_path(size, None) for size in SIZES] + [
            pool_path(size, n) for size in SIZES for n in nodes
        ]
        counts = []
        for p in paths:
            t = (system.read_text(p) or "").strip()
            counts.append((p, int(t) if t.isdigit() else None))
        thp_text = system.read_text(THP)
        thp = None
        if thp_text is not None:
            thp = next((w[1:-1] for w in thp_text.split() if w.startswith("[")), "")
        mounts = system.read_text("/proc/mounts") or ""
        sysd = systemd_running(system)
        unit_state = system.run(["systemctl", "is-enabled", "dev-hugepages1G.mount"]) if sysd else None
        enabled = unit_state is not None and unit_state.ok
        # A started mount unit is active exactly while mounted; /proc/mounts is the kernel's word.
        active = sysd and system.run(["systemctl", "is-active", "--quiet", "dev-hugepages1G.mount"]).ok
        return HugepagesObserved(
            has_1g=system.exists("/sys/kernel/mm/hugepages/hugepages-1048576kB"),
            thp=thp,
            numa_nodes=nodes,
            counts=tuple(counts),
            boot_record=read_text_record(system, BOOT_RECORD),
            bootloader=observe_bootloader(system),
            systemd=sysd,
            mount_unit=system.read_bytes(MOUNT_UNIT),
            mounted=active
            or any(line.split()[1:2] == [MOUNT_POINT] for line in mounts.splitlines() if line.strip()),
            mount_enabled=enabled,
        )

    def plan(self, settings: HugepagesSettings | None, observed: HugepagesObserved) -> Plan:
        if settings is None:
            return Plan()  # HST-RMV-04: pools and boot arguments stay
        s = settings
        issues: list[Issue] = []
        if s.pages1g and not observed.has_1g:
            issues.append(Issue("terminal", "this kernel has no 1 GiB huge pages (no hugepages-1048576kB)"))
        if s.transparent is not None and observed.thp is None:
            issues.append(Issue("terminal", "this kernel has no transparent huge pages"))
        if s.per_numa and not observed.numa_nodes:
            issues.append(Issue("terminal", "perNuma: this kernel shows no NUMA nodes"))
        if issues:
            return Plan((), tuple(issues))
        counts = dict(observed.counts)
        nodes: tuple[int | None, ...] = observed.numa_nodes if s.per_numa else (None,)
        steps: list[Step] = []
        if s.transparent is not None and observed.thp != s.transparent:
            steps.append(WriteKernel(THP, s.transparent))
        if s.pages2m is not None:
            for n in nodes:
                p = pool_path("2m", n)
                if counts.get(p) != s.pages2m:
                    steps.append(Set2MPages(p, s.pages2m))
        previous = observed.boot_record or ""
        if s.pages1g is not None:
            total = s.pages1g * (len(nodes) if s.per_numa else 1)
            if s.pages1g > 0:  # the mount first: it also serves pages reserved for the next boot
                steps.extend(self._mount_steps(observed))
            short = tuple(
                (pool_path("1g", n), s.pages1g) for n in nodes if counts.get(pool_path("1g", n)) != s.pages1g
            )
            if short:
                steps.append(Set1GPages(short, total, previous, observed.bootloader))
            elif previous and previous != boot_args(total):
                # HST-HP-17/18: a boot reservation is kept in step with the count; 0 removes it.
                args = boot_args(total)
                steps.append(
                    SetBootArgs(NAME, GRUB_DROPIN, BOOT_RECORD, previous, args, args, observed.bootloader)
                )
        return Plan(tuple(steps))

    def _mount_steps(self, o: HugepagesObserved) -> list[Step]:
        steps: list[Step] = []
        if o.systemd:
            want = mount_unit_text()
            if o.mount_unit != want:
                steps.append(WriteFile(MOUNT_UNIT, want))
                steps.append(Run(("systemctl", "daemon-reload")))
            if o.mount_unit != want or not o.mount_enabled:
                steps.append(Run(("systemctl", "enable", "dev-hugepages1G.mount")))
            if not o.mounted:
                steps.append(Run(("systemctl", "start", "dev-hugepages1G.mount")))
        elif not o.mounted:
            steps.append(Run(("mkdir", "-p", MOUNT_POINT)))
            steps.append(Run(("mount", "-t", "hugetlbfs", "-o", "pagesize=1G", "hugetlbfs", MOUNT_POINT)))
        return steps


UNIT = Hugepages()
