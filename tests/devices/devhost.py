"""The devices tests' simulated GPU host: a signer, a section, a slice-aware systemctl, paths."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from bcd_agent.converge.section import Observation, PassContext
from bcd_agent.converge.types import DesiredSpec, SectionOutcome
from bcd_agent.sections.devices.apply import DirectExecutor
from bcd_agent.sections.devices.events import MemorySink
from bcd_agent.sections.devices.model import DevicesSpec
from bcd_agent.sections.devices.section import DevicesSection
from bcd_shared.pki import KeyPair, Purpose
from bcd_shared.simhost import TOOLS, _LazyTool
from bcd_shared.system import CommandResult, LocalSystem

DATA_DIR = "/var/lib/bcd"
REPO = Path(__file__).resolve().parents[2]
REFERENCE = REPO.parent / "shared" / "reference"
IN_CI = os.environ.get("CI") == "true"


class Signer:
    node_id = "node-test-1"
    boot_id = "boot-test-1"

    def __init__(self) -> None:
        self.key = KeyPair(os.urandom(32))

    def sign(self, purpose: Purpose, data: bytes) -> bytes:
        return self.key.sign(purpose, data)


SLICES = "/sys/fs/cgroup/bcd.slice/bcd-alloc.slice"


def slice_systemctl(system: LocalSystem, argv: Sequence[str], stdin: bytes | None) -> CommandResult:
    """systemctl(1) for hold slices only (systemd 252 shapes): start creates the slice's cgroup with
    `cgroup.events` `populated 0`, set-property --runtime records properties, stop removes the cgroup
    (systemd would kill what is inside: bcd must only stop empty slices). Calls are logged."""
    args = [a for a in argv[1:] if a not in ("--no-block", "--quiet")]
    log = system.read_bytes("/var/lib/bcd-sim/slice-calls") or b""
    system.write_atomic("/var/lib/bcd-sim/slice-calls", log + (" ".join(args) + "\n").encode())
    verb, rest = args[0], [a for a in args[1:] if a != "--runtime"]
    name = rest[0] if rest else ""
    cg = f"{SLICES}/{name}"
    if verb == "start":
        if not system.exists(f"{cg}/cgroup.events"):
            system.write_atomic(f"{cg}/cgroup.events", b"populated 0\nfrozen 0\n")
        return CommandResult(tuple(argv), 0)
    if verb == "set-property":
        if not system.exists(f"{cg}/cgroup.events"):
            return CommandResult(tuple(argv), 5, b"", f"Unit {name} not loaded.\n".encode())
        old = system.read_text(f"{cg}/properties") or ""
        system.write_atomic(f"{cg}/properties", (old + "\n".join(rest[1:]) + "\n").encode())
        return CommandResult(tuple(argv), 0)
    if verb == "stop":
        events = system.read_text(f"{cg}/cgroup.events") or ""
        if "populated 1" in events:
            system.write_atomic("/var/lib/bcd-sim/killed-workloads", name.encode())
        real = system.host_path(cg)
        if real.is_dir():
            for f in real.iterdir():
                f.unlink()
            real.rmdir()
        return CommandResult(tuple(argv), 0)
    return CommandResult(tuple(argv), 1, b"", f"unknown verb {verb}\n".encode())


def gpu_system(root: Path) -> LocalSystem:
    tools = {name: _LazyTool(spec) for name, spec in TOOLS.items()}
    tools["systemctl"] = slice_systemctl
    return LocalSystem(root=root, tools=tools)


class Host:
    """A simulated GPU host with one devices section on it (rebuilt by `restart`)."""

    def __init__(self, root: Path, **kw: object) -> None:
        self.root = root
        self.system = gpu_system(root)
        self.sink = MemorySink()
        self.signer = Signer()
        self.kw = kw
        self.section = self._build()

    def _build(self) -> DevicesSection:
        return DevicesSection(
            self.system, DirectExecutor(self.system), self.sink, self.signer, DATA_DIR, **self.kw
        )  # type: ignore[arg-type]

    def restart(self, **kw: object) -> None:
        self.kw.update(kw)
        self.section = self._build()

    def run(self, spec: DevicesSpec) -> SectionOutcome:
        ctx = PassContext(DesiredSpec(spec.generation, "h"), 1, frozenset(), 0.0)
        return self.section.converge(spec, Observation(), ctx)

    def events(self, kind: str | None = None) -> list[object]:
        evs = [e.event for e in self.sink.events]
        return [e for e in evs if kind is None or type(e).__name__ == kind]

    def path(self, host_path: str) -> Path:
        return self.root / host_path.lstrip("/")
