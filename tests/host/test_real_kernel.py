"""The host units against the real kernel of the machine the tests run on: opt-in, Linux, as root.

Runs only with BCD_HOSTCONFIG_REAL=1 (the seed's TestRealKernel): it changes live kernel settings of
the machine for a moment, so it never runs by default, in CI or elsewhere. Each setting is put back
(in `finally`), and the sysctl drop-in bcd writes is removed by the unit's own clean-up.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from bcd_agent.sections.host import DirectExecutor
from bcd_shared.errors import StepError
from bcd_shared.rootsystem import root_guard
from bcd_shared.system import LocalSystem
from bcd_shared.units import UnitResult

REAL = sys.platform == "linux" and os.environ.get("BCD_HOSTCONFIG_REAL") == "1" and os.geteuid() == 0
pytestmark = [
    pytest.mark.realhost,
    pytest.mark.skipif(not REAL, reason="the real kernel only with BCD_HOSTCONFIG_REAL=1, on Linux, as root"),
]

SWAPPINESS = Path("/proc/sys/vm/swappiness")
PRINTK = Path("/proc/sys/kernel/printk")
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
PAGES_2M = Path("/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages")
DROPIN = Path("/etc/sysctl.d/90-bcd.conf")


@pytest.fixture
def host() -> Iterator[DirectExecutor]:
    if DROPIN.exists():
        pytest.fail(f"{DROPIN} exists: this machine's kernel settings are bcd's already; not touching it")
    yield DirectExecutor(LocalSystem(Path("/")))
    assert not DROPIN.exists()


def _ok(result: UnitResult) -> UnitResult:
    assert not result.issues, result.issues
    return result


def _thp() -> str:
    m = re.search(r"\[(\w+)\]", THP.read_text())
    assert m is not None
    return m.group(1)


def test_HST_LVL_18_real_kernel_sysctl_thp_and_2m_pages_set_and_put_back(host: DirectExecutor) -> None:
    """A sysctl set live and through its drop-in, then put back and the drop-in removed; a tab-separated
    multi-value tunable at its current value converges in one pass with nothing written; the
    transparent huge page policy and two more 2 MiB pages, each put back; and root's writes refused
    under /tmp, a world-writable directory and a symlinked one."""
    swappiness = int(SWAPPINESS.read_text())
    other = 61 if swappiness != 61 else 59
    try:
        r = _ok(host.converge("sysctl", f'{{"vm.swappiness":{other}}}'))
        assert r.changed and int(SWAPPINESS.read_text()) == other
        assert f"vm.swappiness = {other}" in DROPIN.read_text()
        assert not _ok(host.converge("sysctl", f'{{"vm.swappiness":{other}}}')).changed
    finally:
        host.converge("sysctl", f'{{"vm.swappiness":{swappiness}}}')
        host.converge("sysctl", None)
    assert int(SWAPPINESS.read_text()) == swappiness and not DROPIN.exists()

    printk = " ".join(PRINTK.read_text().split())  # the kernel shows it tab-separated
    try:
        r = _ok(host.converge("sysctl", f'{{"kernel.printk":"{printk.replace(" ", "  ")}"}}'))
        assert r.steps_done == ("write /etc/sysctl.d/90-bcd.conf",)  # the live value already matched
    finally:
        host.converge("sysctl", None)

    policy = _thp()
    other_policy = "never" if policy != "never" else "madvise"
    try:
        _ok(host.converge("hugepages", f'{{"transparent":"{other_policy}"}}'))
        assert _thp() == other_policy
    finally:
        host.converge("hugepages", f'{{"transparent":"{policy}"}}')
    assert _thp() == policy

    pages = int(PAGES_2M.read_text())
    try:
        _ok(host.converge("hugepages", f'{{"pages2m":{pages + 2}}}'))
        assert int(PAGES_2M.read_text()) == pages + 2
    finally:
        host.converge("hugepages", f'{{"pages2m":{pages}}}')
    assert int(PAGES_2M.read_text()) == pages

    guard = root_guard(Path("/"))
    with tempfile.TemporaryDirectory(prefix="bcd-real-kernel-", dir="/var/lib") as d:  # root's, down from /
        shared = Path(d) / "shared"
        shared.mkdir()
        os.chmod(shared, 0o777)
        (Path(d) / "link").symlink_to(Path(d) / "root-only")
        (Path(d) / "root-only").mkdir()
        os.chmod(d, 0o755)
        for path in ("/tmp/bcd-never", "/var/tmp/bcd-never", f"{shared}/f", f"{d}/link/f"):
            with pytest.raises(StepError, match="is not a directory only root can write"):
                guard(path)
        guard(f"{d}/root-only/f")  # a directory only root can write, down from /
