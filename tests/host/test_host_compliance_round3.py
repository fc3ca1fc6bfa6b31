"""Host-config catalogue items that had no test naming them (docs/compliance.md), third round.

Everything runs on the simulated host (hostunits_support.make_host), whose tools answer in the formats
their modules document (bcd_simhost): plan, apply, plan again. `Recording` wraps the simulated host's
System to see the programs a unit runs, in order.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bcd_shared.system import CommandResult, LocalSystem
from bcd_shared.units import STATE_DIR, UnitContext
from hostunits_support import ALLOWED, PIN, SERVER, FakeTokens, make_host, run

K8S = {
    "server": SERVER,
    "caCertSha256": PIN,
    "tokenRef": "secret://pool/k8s-token",
    "kubernetesVersion": "1.34.1",
}


class Recording:
    """The simulated host's System, recording each program it runs."""

    def __init__(self, inner: LocalSystem) -> None:
        self.inner = inner
        self.argvs: list[list[str]] = []

    def run(self, argv: Sequence[str], **kw: Any) -> CommandResult:
        self.argvs.append(list(argv))
        return self.inner.run(argv, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def files(root: Path) -> dict[str, str]:
    """Every file and link under root: its content's digest, or the link's target."""
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            if os.path.islink(path):
                out[rel] = "-> " + os.readlink(path)
            else:
                with open(path, "rb") as f:
                    out[rel] = hashlib.sha256(f.read()).hexdigest()
    return out


# -- root's records


def test_HST_REC_02_no_unit_record_in_data_dir(tmp_path: Path) -> None:
    """Every unit that keeps a record (cpu, iommu, hugepages' boot reservation, container-toolkit's
    stamp, k8s-join) keeps it under /var/lib/bcd-hostconfig, and nothing in bcd's data_dir
    (/var/lib/bcd), where the node planted links named like the records, is read, written or followed."""
    root, system = make_host(tmp_path)
    (root / "var/lib/bcd-sim/hugepages-1g-limit").write_text("0\n")  # 1 GiB pages only at boot
    planted = root / "etc/planted"
    planted.mkdir()
    data_dir = root / "var/lib/bcd"
    data_dir.mkdir()
    for name in ("bootargs", "hugepages-1g-boot", "cdi-nvidia.stamp", "k8s-join.json", "k8s"):
        (data_dir / name).symlink_to(f"../../../etc/planted/{name}")  # relative: inside the simulated root
    before = files(root)
    run(system, "cpu", {"isolate": "4-7"})
    run(system, "iommu", {})
    run(system, "hugepages", {"pages1g": 4})
    assert run(system, "container-toolkit", {}).ok
    ctx = UnitContext(allowed_clusters=ALLOWED)
    for _ in range(2):  # packages first, then the join
        run(system, "k8s-join", K8S, ctx=ctx, tokens=FakeTokens())
    after = files(root)
    changed = {p for p in before.keys() | after.keys() if before.get(p) != after.get(p)}
    records = {p for p in changed if p.startswith(STATE_DIR.lstrip("/") + "/")}
    assert {
        "var/lib/bcd-hostconfig/bootargs/cpu",
        "var/lib/bcd-hostconfig/bootargs/iommu",
        "var/lib/bcd-hostconfig/hugepages-1g-boot",
        "var/lib/bcd-hostconfig/cdi-nvidia.stamp",
        "var/lib/bcd-hostconfig/k8s-join.json",
    } <= records
    assert not [p for p in changed if p.startswith("var/lib/bcd/")]
    assert list(planted.iterdir()) == []
    # Under /var/lib only root's records and the simulated host's own state (its packages, systemd) move.
    other = [p for p in changed if p.startswith("var/lib/") and not p.startswith(("var/lib/bcd-sim/",))]
    assert sorted(other) == sorted(records), other
