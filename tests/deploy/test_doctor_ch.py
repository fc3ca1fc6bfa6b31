"""`bcd doctor`'s cloud-hypervisor checks (docs/instances.md): the VMM's version against the runtime's
minimum (v51), /dev/kvm, and bcd's VMM uid range free of other accounts."""

from __future__ import annotations

from pathlib import Path

from bcd_agent.doctor import HostView, check_all
from bcd_shared.system import CommandResult
from test_doctor import by_check, write_config


def _host(tmp_path: Path, version: str | None, kvm: bool = True, passwd: str = "") -> HostView:
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc/passwd").write_text("root:x:0:0::/root:/bin/sh\n" + passwd)
    if kvm:
        (root / "dev").mkdir()
        (root / "dev/kvm").write_text("")
    return HostView(
        root=root,
        euid=990,
        which=lambda name: "/usr/bin/cloud-hypervisor" if name == "cloud-hypervisor" else None,
        wall_clock=lambda: 1_800_000_000.0,
        run=lambda argv: CommandResult(tuple(argv), 0 if version else 1, (version or "").encode(), b""),
    )


def test_the_vmm_version_is_checked_against_the_minimum_dlv_chu_31(tmp_path: Path) -> None:
    """DLV-CHU-31: a VMM below v51 (or of no readable version) is reported; v51 and later pass."""
    cfg = write_config(tmp_path)
    cases = {
        "cloud-hypervisor v51.1": "ok",
        "cloud-hypervisor v52.0-dirty": "ok",
        "cloud-hypervisor v50.2": "warn",
        "cloud-hypervisor v40.0": "warn",
        None: "warn",
    }
    for i, (version, level) in enumerate(cases.items()):
        [f] = by_check(check_all(cfg, _host(tmp_path / str(i), version)))["ch-vmm"]
        assert f.level == level, (version, f)
    [f] = by_check(check_all(cfg, _host(tmp_path / "nokvm", "cloud-hypervisor v51.0", kvm=False)))["ch-vmm"]
    assert f.level == "warn" and "/dev/kvm" in f.message


def test_the_uid_range_must_hold_only_bcds_accounts(tmp_path: Path) -> None:
    cfg = write_config(tmp_path)
    ok = _host(
        tmp_path / "a", "v51.0", passwd="bcd-vmm-3:x:2147287043:2147287043::/nonexistent:/usr/sbin/nologin\n"
    )
    assert [f.level for f in by_check(check_all(cfg, ok))["ch-uid-range"]] == ["ok"]
    bad = _host(tmp_path / "b", "v51.0", passwd="mallory:x:2147287050:100::/home/m:/bin/sh\n")
    [f] = by_check(check_all(cfg, bad))["ch-uid-range"]
    assert f.level == "fail" and "mallory (2147287050)" in f.message


def test_no_vmm_no_findings(tmp_path: Path) -> None:
    cfg = write_config(tmp_path)
    host = HostView(root=tmp_path, euid=990, which=lambda name: None, wall_clock=lambda: 1_800_000_000.0)
    found = by_check(check_all(cfg, host))
    assert "ch-vmm" not in found and "ch-uid-range" not in found
