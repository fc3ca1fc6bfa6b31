"""Fake `modprobe` and `modinfo` of the simulated host.

Loading creates /sys/module/<name> (dashes as underscores) with refcnt 0 and each option of
/etc/modprobe.d/*.conf under parameters/, as the kernel shows them; br_netfilter brings its
/proc/sys/net/bridge keys; nvidia loads only when a driver package is installed (state in
<root>/var/lib/bcd-sim/driver.json) and then shows /proc/driver/nvidia/version in the real format
("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build ..."). A
module with refcnt above 0 refuses `modprobe -r` with modprobe's "Module X is in use." Modules named
in <root>/var/lib/bcd-sim/missing-modules do not exist.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence

from bcd_shared.system import CommandResult, LocalSystem

from ._state import fail, load, ok, put

KVER = "6.1.0-27-amd64"
NVIDIA_MODULES = ("nvidia", "nvidia_uvm", "nvidia_drm", "nvidia_modeset")


def proc_version(driver: dict[str, object]) -> str:
    flavor = "Open Kernel Module for x86_64" if driver.get("open") else "x86_64 Kernel Module"
    return (
        f"NVRM version: NVIDIA UNIX {flavor}  {driver['version']}  Release Build  "
        "(dvs-builder@U16-I3-B03-4-3)  Tue Sep 23 10:00:00 UTC 2025\n"
        "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n"
    )


def _options(system: LocalSystem, module: str) -> list[tuple[str, str]]:
    out = []
    for name in system.listdir("/etc/modprobe.d"):
        for line in (system.read_text(f"/etc/modprobe.d/{name}") or "").splitlines():
            words = line.split()
            if len(words) >= 3 and words[0] == "options" and words[1].replace("-", "_") == module:
                for w in words[2:]:
                    k, _, v = w.partition("=")
                    out.append((k, v))
    return out


def load_module(system: LocalSystem, name: str) -> str | None:
    mod = name.replace("-", "_")
    if mod in (system.read_text("/var/lib/bcd-sim/missing-modules") or "").split():
        return f"modprobe: FATAL: Module {name} not found in directory /lib/modules/{KVER}\n"
    if mod in NVIDIA_MODULES:
        driver = load(system, "driver.json", {}).get("installed")
        if not driver:
            return f"modprobe: FATAL: Module {name} not found in directory /lib/modules/{KVER}\n"
    base = f"/sys/module/{mod}"
    if system.exists(base):
        return None
    put(system, f"{base}/refcnt", "0\n")
    put(system, f"{base}/initstate", "live\n")
    for k, v in _options(system, mod):
        put(system, f"{base}/parameters/{k}", f"{v}\n")
    if mod == "br_netfilter":
        for key in ("bridge-nf-call-iptables", "bridge-nf-call-ip6tables", "bridge-nf-call-arptables"):
            put(system, f"/proc/sys/net/bridge/{key}", "1\n")
    if mod == "nvidia":
        driver = load(system, "driver.json", {})["installed"]
        put(system, f"{base}/version", f"{driver['version']}\n")
        put(system, "/proc/driver/nvidia/version", proc_version(driver))
        state = load(system, "driver.json", {})
        state["loaded"] = driver
        from ._state import save

        save(system, "driver.json", state)
    return None


def unload_module(system: LocalSystem, name: str) -> str | None:
    mod = name.replace("-", "_")
    base = system.host_path(f"/sys/module/{mod}")
    if not base.exists():
        return None
    ref = (system.read_text(f"/sys/module/{mod}/refcnt") or "0").strip()
    if ref != "0":
        return f"modprobe: FATAL: Module {mod} is in use.\n"
    shutil.rmtree(base)
    if mod == "br_netfilter":
        shutil.rmtree(system.host_path("/proc/sys/net/bridge"), ignore_errors=True)
    if mod == "nvidia":
        system.remove("/proc/driver/nvidia/version")
    return None


def modprobe(system: LocalSystem, argv: Sequence[str], stdin: bytes | None) -> CommandResult:
    args = list(argv[1:])
    remove = "-r" in args or "--remove" in args
    names = [a for a in args if not a.startswith("-")]
    if not names:
        return fail(argv, "modprobe: FATAL: no module name given\n")
    for n in names:
        err = unload_module(system, n) if remove else load_module(system, n)
        if err:
            return fail(argv, err)
    return ok(argv)


def modinfo(system: LocalSystem, argv: Sequence[str], stdin: bytes | None) -> CommandResult:
    names = [a for a in argv[1:] if not a.startswith("-")]
    if names != ["nvidia"]:
        return fail(argv, f"modinfo: ERROR: Module {names[0] if names else ''} not found.\n")
    driver = load(system, "driver.json", {}).get("installed")
    if not driver:
        return fail(argv, "modinfo: ERROR: Module nvidia not found.\n")
    lic = "Dual MIT/GPL" if driver.get("open") else "NVIDIA"
    text = (
        f"filename:       /lib/modules/{KVER}/updates/dkms/nvidia.ko\n"
        "alias:          char-major-195-*\n"
        f"version:        {driver['version']}\n"
        "supported:      external\n"
        f"license:        {lic}\n"
        f"firmware:       nvidia/{driver['version']}/gsp_ga10x.bin\n"
        "depends:        \n"
        "name:           nvidia\n"
        f"vermagic:       {KVER} SMP preempt mod_unload modversions \n"
    )
    return ok(argv, text)
