"""A tiny real guest for the booted-guest test: Debian's cloud kernel and a busybox initramfs.

The kernel comes from Debian's package (`apt-get download linux-image-<ver>-cloud-amd64`, `dpkg-deb -x`;
the version is what the `linux-image-cloud-amd64` metapackage depends on). The initramfs is busybox-static
plus the virtio modules of that kernel, loaded in the order ../shared/notes/instances-facts.md gives,
and ACPI's `button` and `evdev`, so that a power-button press (`virsh shutdown`, ACPI mode) reaches the
guest as an input event. Its /init mounts the virtio disk (/dev/vda, ext4, read-only), prints markers
on the serial console (ttyS0), prints a tick every second, and powers off when any input device sees an
event (the ACPI power button) or when the kernel command line says `bcd.poweroff_after=N` seconds.
Each tick it prints its disks (name, sysfs serial, sectors) and MemTotal when they changed, and runs the
identity rebind script of docs/instances.md (`rebind_script`) when a disk with serial `bc-rebind`
appears (issue 11: tests/instances/test_guest_part2_real.py).

Both are cached under /var/tmp/bcd-test-guest/<kernel version>/ (the kernel once per version; the
initramfs keyed by a digest of its init, modules and script; the download is 26 MB).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

CACHE = Path("/var/tmp/bcd-test-guest")
# Load order measured on Debian 12's cloud kernel (instances-facts.md "KVM and guests"); button and evdev
# make the ACPI power button an input event the guest's /init waits on.
MODULES = (
    "virtio_ring",
    "virtio",
    "virtio_pci_modern_dev",
    "virtio_pci_legacy_dev",
    "virtio_pci",
    "virtio_blk",
    "failover",
    "net_failover",
    "virtio_net",
    "virtio_balloon",
    "button",
    "evdev",
)
MARK = "BCD-GUEST"

INIT = f"""#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in {" ".join(MODULES)}; do insmod /lib/modules/$m.ko; done
i=0
while [ ! -b /dev/vda ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done
mkdir -p /mnt
if mount -t ext4 -o ro /dev/vda /mnt; then echo "{MARK}-DISK $(cat /mnt/marker)"; fi
for n in /sys/class/net/eth*; do [ -e "$n" ] && echo "{MARK}-NIC $(cat $n/address)"; done
echo "{MARK}-UP"
rm -f /pwr
for e in /dev/input/event*; do (head -c 1 "$e" >/dev/null && touch /pwr) & done
after=$(sed -n 's/.*bcd.poweroff_after=\\([0-9]*\\).*/\\1/p' /proc/cmdline)
t=0
state=""
rebound=""
while [ ! -e /pwr ]; do
  echo "{MARK}-TICK $t"
  # Disks (name:serial:sectors) and MemTotal, printed when they change (hot-adds, resizes, the balloon).
  s=""
  for b in /sys/block/vd*; do
    [ -e "$b/size" ] && s="$s${{b##*/}}:$(cat $b/serial 2>/dev/null):$(cat $b/size) "
  done
  s="${{s}}mem:$(sed -n 's/^MemTotal: *\\([0-9]*\\).*/\\1/p' /proc/meminfo)"
  if [ "$s" != "$state" ]; then echo "{MARK}-STATE $s"; state="$s"; fi
  # The identity rebind: what udev and bc-rebind@.service do on a real guest (docs/instances.md).
  # Each hot-add is a new device even when the kernel reuses its name (udev sees an add event each
  # time): the sysfs directory's inode, which kernfs never reuses, tells two attaches apart.
  now=""
  for b in /sys/block/vd*; do
    [ "$(cat $b/serial 2>/dev/null)" = bc-rebind ] && now="${{b##*/}}:$(stat -L -c %i $b)"
  done
  if [ -n "$now" ] && [ "$now" != "$rebound" ]; then
    if /usr/local/sbin/bc-rebind "/dev/${{now%%:*}}"; then
      echo "{MARK}-REBOUND $(ls /etc/ssh/auth_principals) $(cat /etc/ssh/auth_principals/* | tr '\\n' ,)"
      c=/etc/ssh/ssh_host_bcd_key-cert.pub
      [ -f $c ] && echo "{MARK}-HOSTCERT $(cut -d' ' -f1 $c)"
    else
      echo "{MARK}-REBIND-FAILED"
    fi
  fi
  rebound="$now"
  sleep 1
  t=$((t+1))
  if [ -n "$after" ] && [ $t -ge "$after" ]; then break; fi
done
echo "{MARK}-POWEROFF"
sync
# QEMU's exit hangs up the console's pty, and the kernel drops what the reader has not read yet: a
# second for the test to read the marker above on a loaded machine.
sleep 1
poweroff -f
"""


def rebind_script() -> str:
    """The guest half's script, verbatim from docs/instances.md (DLV-REB-19): the booted guest runs it."""
    text = (Path(__file__).resolve().parents[2] / "docs/instances.md").read_text()
    found = re.search(r"```sh\n(#!/bin/sh\n# bc-rebind DEVICE:.*?)```", text, re.S)
    if found is None:
        raise RuntimeError("docs/instances.md has no bc-rebind script")
    return found.group(1)


def kernel_version() -> str:
    out = subprocess.run(
        ["apt-cache", "depends", "linux-image-cloud-amd64"], capture_output=True, text=True, check=True
    ).stdout
    found = re.findall(r"Depends: linux-image-([0-9][^\s]*-cloud-amd64)\b", out)
    if not found:
        raise RuntimeError(f"no cloud kernel in `apt-cache depends linux-image-cloud-amd64`: {out[:300]!r}")
    return found[0]


def _modules(tree: Path, version: str) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for ko in (tree / "lib/modules" / version / "kernel").rglob("*.ko"):
        found.setdefault(ko.name[: -len(".ko")], ko)
    missing = [m for m in MODULES if m not in found]
    if missing:
        raise RuntimeError(f"modules {missing} not in linux-image-{version}")
    return found


def _initramfs(tree: Path, version: str, out: Path) -> None:
    busybox = shutil.which("busybox")
    if busybox is None:
        raise RuntimeError("busybox is missing (busybox-static)")
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        root = Path(tmp) / "root"
        for d in ("bin", "proc", "sys", "dev", "mnt", "lib/modules", "usr/local/sbin", "etc/ssh", "tmp"):
            (root / d).mkdir(parents=True)
        (root / "usr/local/sbin/bc-rebind").write_text(rebind_script())
        os.chmod(root / "usr/local/sbin/bc-rebind", 0o755)
        shutil.copy(busybox, root / "bin/busybox")
        for name, ko in _modules(tree, version).items():
            if name in MODULES:
                shutil.copy(ko, root / "lib/modules" / f"{name}.ko")
        (root / "init").write_text(INIT)
        os.chmod(root / "init", 0o755)
        files = subprocess.run(
            ["find", ".", "-mindepth", "1"], cwd=root, capture_output=True, check=True
        ).stdout
        cpio = subprocess.run(
            ["cpio", "-o", "-H", "newc", "--quiet"], cwd=root, input=files, capture_output=True, check=True
        ).stdout
        out.with_suffix(".tmp").write_bytes(cpio)
        os.replace(out.with_suffix(".tmp"), out)


def guest_boot_files() -> tuple[Path, Path]:
    """(vmlinuz, initramfs), built once per kernel version under CACHE."""
    import hashlib

    version = kernel_version()
    cache = CACHE / version
    # The initramfs is keyed by what goes into it (the init, the modules, the rebind script).
    key = hashlib.sha256((INIT + " ".join(MODULES) + rebind_script()).encode()).hexdigest()[:12]
    kernel, initrd = cache / "vmlinuz", cache / f"initramfs-{key}.cpio"
    if kernel.exists() and initrd.exists():
        return kernel, initrd
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        work = Path(tmp)
        os.chmod(work, 0o755)  # apt-get download runs as _apt where it can
        subprocess.run(
            ["apt-get", "download", "-qq", f"linux-image-{version}"],
            cwd=work,
            check=True,
            capture_output=True,
        )
        (deb,) = work.glob("linux-image-*.deb")
        tree = work / "x"
        subprocess.run(["dpkg-deb", "-x", str(deb), str(tree)], check=True)
        _initramfs(tree, version, initrd)
        shutil.copy(tree / "boot" / f"vmlinuz-{version}", kernel.with_suffix(".tmp"))
        os.replace(kernel.with_suffix(".tmp"), kernel)
    return kernel, initrd
