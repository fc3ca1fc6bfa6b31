"""The devices tests' simulated GPU host: a signer, a section, the shared simulated host, paths."""

from __future__ import annotations

import os
from pathlib import Path

from bcd_agent.converge.section import Observation, PassContext
from bcd_agent.converge.types import DesiredSpec, SectionOutcome
from bcd_agent.sections.devices.apply import DirectExecutor
from bcd_agent.sections.devices.events import KeyReportSigner, MemorySink
from bcd_agent.sections.devices.model import DevicesSpec
from bcd_agent.sections.devices.section import DevicesSection
from bcd_shared.system import LocalSystem
from bcd_simhost import sim_system
from testsupport import SHARED

DATA_DIR = "/var/lib/bcd"
REPO = Path(__file__).resolve().parents[2]
REFERENCE = SHARED / "reference"
IN_CI = os.environ.get("CI") == "true"


def gpu_system(root: Path) -> LocalSystem:
    """The plain simulated host: its systemctl simulates hold slices (simhost/slices.py) and logs
    every state-changing call to /var/lib/bcd-sim/systemd/log."""
    return sim_system(root)


def systemctl_calls(root: Path) -> list[str]:
    """The state-changing systemctl calls so far (argv after `systemctl`), in order."""
    log = root / "var/lib/bcd-sim/systemd/log"
    return log.read_text().splitlines() if log.exists() else []


class Host:
    """A simulated GPU host with one devices section on it (rebuilt by `restart`)."""

    def __init__(self, root: Path, **kw: object) -> None:
        self.root = root
        self.system = gpu_system(root)
        self.sink = MemorySink()
        self.signer = KeyReportSigner.fresh("node-test-1", "boot-test-1")
        self.kw = kw
        self.section = self._build()

    def _build(self) -> DevicesSection:
        return DevicesSection(
            self.system,
            DirectExecutor(self.system),
            self.sink,
            self.signer,
            DATA_DIR,
            **self.kw,  # type: ignore[arg-type]
        )

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
