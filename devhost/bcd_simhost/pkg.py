"""Fake package managers of the simulated host: apt-get, apt-mark, dnf, zypper.

The package database is <root>/var/lib/bcd-sim/packages.json ({name: {"version", "held"}}).
Installing a package the simulated repositories carry lays down what the real one would that the
units look at (binaries, systemd unit files, the driver's kernel module state in driver.json).
A package the repositories do not carry fails as apt-get does ("E: Unable to locate package X",
status 100) or dnf/zypper do.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from bcd_shared.system import CommandResult, LocalSystem

from ._state import fail, load, ok, put, save

DRIVER_VERSIONS = {
    "535": "535.216.01",
    "550": "550.127.05",
    "570": "570.148.08",
    "580": "580.95.05",
    "590": "590.48.01",
}
K8S_PATCH = "1"


def _bin(system: LocalSystem, name: str) -> None:
    put(system, f"/usr/bin/{name}", "#!/bin/sh\n# simulated binary\n", 0o755)


def _service(system: LocalSystem, unit: str, exec_start: str) -> None:
    put(
        system,
        f"/lib/systemd/system/{unit}",
        f"[Unit]\nDescription={unit}\n\n[Service]\nExecStart={exec_start}\n\n[Install]\nWantedBy=multi-user.target\n",
    )


def _driver(system: LocalSystem, branch: str, open_: bool) -> None:
    state = load(system, "driver.json", {})
    state["installed"] = {
        "branch": branch,
        "version": DRIVER_VERSIONS.get(branch, f"{branch}.0.0"),
        "open": open_,
    }
    save(system, "driver.json", state)
    _bin(system, "nvidia-persistenced")
    _bin(system, "nvidia-cuda-mps-control")
    _service(system, "nvidia-persistenced.service", "/usr/bin/nvidia-persistenced")


def _effect(system: LocalSystem, name: str, repo_minor: str | None) -> str | None:
    """Lay the package down; return its version, or None when no repository carries it."""
    m = re.fullmatch(r"nvidia-headless-(\d{3})-server(-open)?", name)
    if m:
        _driver(system, m.group(1), bool(m.group(2)))
        return DRIVER_VERSIONS.get(m.group(1), "0")
    m = re.fullmatch(r"nvidia-open-(\d{3})|cuda-drivers-(\d{3})", name)
    if m:
        _driver(system, m.group(1) or m.group(2), bool(m.group(1)))
        return "1"
    m = re.fullmatch(r"@nvidia-driver:(\d{3})-(open|dkms)", name)
    if m:
        _driver(system, m.group(1), m.group(2) == "open")
        return "1"
    if name in ("nvidia-open-driver-G06-signed-kmp-default", "nvidia-driver-G06-kmp-default"):
        _driver(system, "580", name.startswith("nvidia-open"))
        return "1"
    if re.fullmatch(r"nvidia-utils-\d{3}-server|nvidia-compute-utils-G06", name):
        _bin(system, "nvidia-cuda-mps-control")
        return "1"
    if re.fullmatch(r"nvidia-fabricmanager-\d{3}|nvidia-fabric-manager", name):
        _bin(system, "nv-fabricmanager")
        _service(system, "nvidia-fabricmanager.service", "/usr/bin/nv-fabricmanager")
        return "1"
    if name == "nvidia-container-toolkit":
        _bin(system, "nvidia-ctk")
        _bin(system, "nvidia-container-runtime")
        put(
            system,
            "/etc/nvidia-container-runtime/config.toml",
            "#accept-nvidia-visible-devices-as-volume-mounts = false\n"
            "#accept-nvidia-visible-devices-envvar-when-unprivileged = true\n"
            "disable-require = false\n",
        )
        return "1.17.8"
    if name in ("kubeadm", "kubelet", "kubectl"):
        if repo_minor is None:
            return None
        _bin(system, name)
        if name == "kubelet":
            _service(system, "kubelet.service", "/usr/bin/kubelet")
        return f"{repo_minor}.{K8S_PATCH}"
    if name == "containerd":
        _bin(system, "containerd")
        _service(system, "containerd.service", "/usr/bin/containerd")
        return "1.7.24"
    return None


def _repo_minor(system: LocalSystem) -> str | None:
    for path in ("/etc/apt/sources.list.d/bcd-kubernetes.list", "/etc/yum.repos.d/bcd-kubernetes.repo"):
        m = re.search(r"pkgs\.k8s\.io/core:/stable:/v(\d+\.\d+)/", system.read_text(path) or "")
        if m:
            return m.group(1)
    return None


def _install(
    system: LocalSystem, argv: Sequence[str], names: list[str], missing: Callable[[str], CommandResult]
) -> CommandResult:
    db = load(system, "packages.json", {})
    minor = _repo_minor(system)
    for n in names:
        if n in db:
            continue
        version = _effect(system, n, minor)
        if version is None:
            return missing(n)
        db[n] = {"version": version, "held": False}
    save(system, "packages.json", db)
    return ok(argv, "".join(f"Setting up {n} ...\n" for n in names))


def apt_get(system: LocalSystem, argv: Sequence[str], stdin: bytes | None) -> CommandResult:
    args = list(argv[1:])
    if "update" in args:
        return ok(argv, "Reading package lists... Done\n")
    if "install" in args:
        i = args.index("install")
        names = []
        skip = False
        for a in args[i + 1 :]:
            if skip:
                skip = False
                continue
            if a == "-o":
                skip = True
                continue
            if not a.startswith("-"):
                names.append(a)
        return _install(system, argv, names, lambda n: fail(argv, f"E: Unable to locate package {n}\n", 100))
    return fail(argv, "E: Invalid operation\n", 100)


def apt_mark(system: LocalSystem, argv: Sequence[str], stdin: bytes | None) -> CommandResult:
    db = load(system, "packages.json", {})
    if list(argv[1:2]) == ["hold"]:
        for n in argv[2:]:
            if n in db:
                db[n]["held"] = True
        save(system, "packages.json", db)
        return ok(argv, "".join(f"{n} set on hold.\n" for n in argv[2:]))
    return fail(argv, "E: unsupported\n", 100)


def dnf(system: LocalSystem, argv: Sequence[str], stdin: bytes | None) -> CommandResult:
    names = [a for a in argv[1:] if not a.startswith("-") and a != "install"]
    return _install(
        system,
        argv,
        names,
        lambda n: fail(argv, f"No match for argument: {n}\nError: Unable to find a match: {n}\n"),
    )


def zypper(system: LocalSystem, argv: Sequence[str], stdin: bytes | None) -> CommandResult:
    names = [a for a in argv[1:] if not a.startswith("-") and a != "install"]
    return _install(system, argv, names, lambda n: fail(argv, f"No provider of '{n}' found.\n", 104))
