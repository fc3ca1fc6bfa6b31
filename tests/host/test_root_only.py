"""The root-only rule for `bcd node` acting as root without a helper (HST-ROOT-*): the host section's
DirectExecutor wraps the System in `units.RootOnlySystem` and gives the units a rootpath guard.

On the simulated host the walk starts at the simulated root, so its directories must be root's and
writable by no one else, as `bcd sim` seeds them (as root, umask 022). These tests need root.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from bcd_agent.converge.types import SectionState
from bcd_agent.sections.host import DirectExecutor, HostSection, converge_host
from bcd_shared.errors import RetryableError
from bcd_shared.units import ApplyContext, RootOnlySystem, UnitContext, for_root, root_guard
from hostunits_support import ALLOWED, FakeTokens, make_host

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="the root-only rule applies to a process acting as root"
)
REFUSED = "is not a directory only root can write: bcd will not write as root under it"


def _executor(system: object) -> DirectExecutor:
    return DirectExecutor(system, UnitContext(allowed_clusters=ALLOWED), ApplyContext(tokens=FakeTokens()))  # type: ignore[arg-type]


def _spec() -> HostSection:
    return HostSection((("sysctl", json.dumps({"vm.swappiness": 7})),))


def test_HST_ROOT_01_root_owned_simulated_host_converges(tmp_path: Path) -> None:
    """Covers HST-ROOT-01/02: every directory from the simulated root down is root's, 0755."""
    root, system = make_host(tmp_path)
    for d in (root, root / "etc", root / "etc/sysctl.d"):
        st = d.stat()
        assert st.st_uid == 0 and not st.st_mode & 0o022
    out = converge_host(_spec(), _executor(system))
    assert out.state is SectionState.CONVERGED, out.message
    dropin = root / "etc/sysctl.d/90-bcd.conf"
    assert "vm.swappiness = 7" in dropin.read_text() and stat.S_IMODE(dropin.stat().st_mode) == 0o644


def test_HST_ROOT_07_a_directory_others_can_write_is_refused(tmp_path: Path) -> None:
    """Covers HST-ROOT-03/07: a directory on the way that is not root's (0755, owned by nobody), or
    that others can write, stops the write with the seeds' message (retryable: PROGRESSING), nothing
    is written, and it goes once fixed."""
    root, system = make_host(tmp_path)
    d = root / "etc/sysctl.d"
    for broken, fixed in (
        (lambda: os.chown(d, 65534, 0), lambda: os.chown(d, 0, 0)),  # HST-ROOT-03: mode 0755 kept
        (lambda: d.chmod(0o777), lambda: d.chmod(0o755)),
    ):
        broken()
        out = converge_host(_spec(), _executor(system))
        assert out.state is SectionState.PROGRESSING
        assert out.message == f"sysctl: /etc/sysctl.d {REFUSED}"
        assert not (d / "90-bcd.conf").exists()
        fixed()
    assert stat.S_IMODE(d.stat().st_mode) == 0o755 and d.stat().st_uid == 0
    assert converge_host(_spec(), _executor(system)).state is SectionState.CONVERGED


def test_HST_ROOT_05_a_symlinked_directory_is_refused(tmp_path: Path) -> None:
    root, system = make_host(tmp_path)
    target = tmp_path / "elsewhere"
    target.mkdir()
    (root / "etc/sysctl.d").rmdir()
    (root / "etc/sysctl.d").symlink_to(target)
    out = converge_host(_spec(), _executor(system))
    assert out.state is SectionState.PROGRESSING and REFUSED in out.message
    assert list(target.iterdir()) == []


def test_root_only_system_and_guard(tmp_path: Path) -> None:
    root, system = make_host(tmp_path)
    wrapped = for_root(system)
    assert isinstance(wrapped, RootOnlySystem) and for_root(wrapped) is wrapped
    wrapped.write_atomic("/etc/bcd-test/x", b"1\n")
    assert (root / "etc/bcd-test/x").read_bytes() == b"1\n"
    assert stat.S_IMODE((root / "etc/bcd-test").stat().st_mode) == 0o755
    assert wrapped.remove("/etc/bcd-test/x") and not wrapped.remove("/etc/bcd-test/x")
    (root / "tmp").chmod(0o1777)
    guard = root_guard(root)
    with pytest.raises(RetryableError, match=f"/tmp {REFUSED}"):
        guard("/tmp/x")
    with pytest.raises(RetryableError, match=f"/tmp {REFUSED}"):
        wrapped.write_atomic("/tmp/x", b"")
    guard("/etc/sysctl.d/90-bcd.conf")  # root-only: no error
