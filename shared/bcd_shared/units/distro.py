"""Distribution detection from /etc/os-release and each family's package commands (argv lists).

Q-HST-DRV-02 answered: the family comes from `ID` first, then from the words of `ID_LIKE`:
ubuntu (ID=ubuntu), debian (debian or ID_LIKE with debian/ubuntu), rhel (rhel, rocky, almalinux,
fedora, centos, or ID_LIKE with rhel/fedora/centos), suse (sles, opensuse*, or ID_LIKE with suse).
Anything else has no packages: a unit that needs to install fails terminally.
"""

from __future__ import annotations

import shlex
from typing import Literal

from attrs import frozen

from bcd_shared.system import System

Family = Literal["ubuntu", "debian", "rhel", "suse", "unknown"]

_RHEL = {"rhel", "rocky", "almalinux", "fedora", "centos"}


@frozen
class Distro:
    id: str
    version_id: str
    family: Family

    @property
    def debian_like(self) -> bool:
        return self.family in ("ubuntu", "debian")


def parse_os_release(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, _, value = line.partition("=")
        try:
            parts = shlex.split(value)
        except ValueError:
            continue
        out[key.strip()] = parts[0] if parts else ""
    return out


def family_of(fields: dict[str, str]) -> Family:
    ident = fields.get("ID", "").lower()
    like = set(fields.get("ID_LIKE", "").lower().split())
    if ident == "ubuntu":
        return "ubuntu"
    if ident == "debian" or like & {"debian", "ubuntu"}:
        return "debian"
    if ident in _RHEL or like & {"rhel", "fedora", "centos"}:
        return "rhel"
    if ident in ("sles", "sled", "suse") or ident.startswith("opensuse") or "suse" in like:
        return "suse"
    return "unknown"


def detect(system: System) -> Distro:
    text = system.read_text("/etc/os-release") or system.read_text("/usr/lib/os-release") or ""
    fields = parse_os_release(text)
    return Distro(fields.get("ID", ""), fields.get("VERSION_ID", ""), family_of(fields))


def install_commands(distro: Distro, packages: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    """The argv lists that install `packages` (HST-DRV-15..17). Empty for an unknown family."""
    if distro.debian_like:
        return (
            ("apt-get", "update"),
            (
                "env",
                "DEBIAN_FRONTEND=noninteractive",
                "apt-get",
                "install",
                "-y",
                "--no-install-recommends",
                "-o",
                "Dpkg::Options::=--force-confold",
                *packages,
            ),
        )
    if distro.family == "rhel":
        return (("dnf", "-y", "install", *packages),)
    if distro.family == "suse":
        return (("zypper", "--non-interactive", "install", *packages),)
    return ()
