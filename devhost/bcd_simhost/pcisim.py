"""PCI devices, IOMMU groups and driver binding on the simulated host, for the helper's ch.vfio.

`lay_out_pci(root, devices)` writes a sysfs shaped like the kernel's: `/sys/bus/pci/devices/<addr>/`
with `class`, `iommu_group` -> `/sys/kernel/iommu_groups/<n>` (whose `devices/` lists the group) and
`driver` -> `/sys/bus/pci/drivers/<name>`, and the drivers present (`vfio-pci` only when `vfio=True`,
as when the module is loaded). `pci_write(system, path, value)` is what the simulated `tee` does for
the kernel's binding files: `driver_override`, `<dev>/driver/unbind`, `drivers_probe` (which binds to
the override, or back to the device's host driver, kept in /var/lib/bcd-sim/pci/<addr>.driver, and
makes `/dev/vfio/<group>` when a device moves to vfio-pci)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from bcd_shared.system import LocalSystem

STATE = "/var/lib/bcd-sim/pci"
_DEV = re.compile(
    r"^/sys/bus/pci/devices/([0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7])/(driver_override|driver/unbind)$"
)


def lay_out_pci(root: Path, devices: list[tuple[str, str, int, str]], *, vfio: bool = True) -> None:
    """devices: (address, class, IOMMU group, host driver)."""
    drivers = {d for _a, _c, _g, d in devices} | ({"vfio-pci"} if vfio else set())
    for drv in drivers:
        (root / "sys/bus/pci/drivers" / drv).mkdir(parents=True, exist_ok=True)
    for addr, cls, group, drv in devices:
        dev = root / "sys/bus/pci/devices" / addr
        dev.mkdir(parents=True, exist_ok=True)
        (dev / "class").write_text(cls + "\n")
        (dev / "driver_override").write_text("\n")
        gdir = root / f"sys/kernel/iommu_groups/{group}/devices"
        gdir.mkdir(parents=True, exist_ok=True)
        for link, target in ((dev / "iommu_group", f"../../../../kernel/iommu_groups/{group}"),
                             (gdir / addr, f"../../../../bus/pci/devices/{addr}"),
                             (dev / "driver", f"../../drivers/{drv}")):  # fmt: skip
            if link.is_symlink():
                link.unlink()
            os.symlink(target, link)
        state = root / STATE.lstrip("/")
        state.mkdir(parents=True, exist_ok=True)
        (state / f"{addr}.driver").write_text(drv)


def pci_write(system: LocalSystem, host: str, value: str) -> bool:
    """Act as the kernel on a PCI binding file; False when `host` is not one."""
    m = _DEV.match(host)
    if m is not None and m.group(2) == "driver_override":
        system.host_path(host).write_text(value.strip() + "\n")
        return True
    if m is not None:  # <dev>/driver/unbind
        link = system.host_path(f"/sys/bus/pci/devices/{m.group(1)}/driver")
        if link.is_symlink():
            link.unlink()
        return True
    if host == "/sys/bus/pci/drivers_probe":
        addr = value.strip()
        dev = system.host_path(f"/sys/bus/pci/devices/{addr}")
        if not dev.is_dir() or (dev / "driver").is_symlink():
            return True
        override = (dev / "driver_override").read_text().strip()
        drv = override or (system.read_text(f"{STATE}/{addr}.driver") or "").strip()
        if drv and system.host_path(f"/sys/bus/pci/drivers/{drv}").is_dir():
            os.symlink(f"../../drivers/{drv}", dev / "driver")
            if drv == "vfio-pci":
                group = os.path.basename(os.readlink(dev / "iommu_group"))
                node = system.host_path(f"/dev/vfio/{group}")
                node.parent.mkdir(parents=True, exist_ok=True)
                if not node.exists():
                    node.write_bytes(b"")
                    os.chmod(node, 0o600)
        return True
    return False
