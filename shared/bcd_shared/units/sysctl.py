"""sysctl: kernel parameters, in /etc/sysctl.d/90-bcd.conf and live (HST-SYS-*).

Names match ^[a-z0-9_]+(?:\\.[a-z0-9_-]+)+$; values are numbers, booleans (1/0) or single-line
strings of at most 4096 characters, whitespace collapsed. Refused keys (the denylist) and hardened
keys set below their safe value fail the unit terminally, before anything is written; a key the
kernel lacks is retried after the others are applied.

Decisions: Q-HST-SYS-01 a denylisted key reads `<key> is refused: <why>`. Q-HST-SYS-02 a key the
kernel lacks is still written to the drop-in (it applies at the next boot once its module loads).
Q-HST-SYS-03 non-integer numbers are written as Python's repr of the float (`0.5`); hardened values
compare as integers, whatever JSON type carried them ("0", 0 and false are the same), and a
hardened key with a non-integer value is refused; a string is an integer only in plain decimal ASCII
(no leading zero, sign `+`, `_` or other digits: the kernel reads "01024" as octal 532).
"""

from __future__ import annotations

import fnmatch
import re
from typing import Any

from attrs import frozen

from bcd_shared.system import System

from ._base import Issue, Plan, RemoveFile, Run, Step, WriteFile, header, refuse
from ._unit import ConfigUnit, UnitContext

NAME = "sysctl"
DROPIN = "/etc/sysctl.d/90-bcd.conf"
KEY_RE = r"^[a-z0-9_]+(?:\.[a-z0-9_-]+)+$"
MAX_VALUE = 4096

_PROGRAM = "it names or controls a program the kernel runs as root"
_BINFMT = "it registers interpreters the kernel runs"
_DEFENSE = "it would lower the host's defenses"
_ONEWAY = "it cannot be undone without a reboot"
_USERNS = "it changes who may create namespaces"

# Refused whatever the value (patterns use fnmatch: `*` is any suffix).
DENYLIST: tuple[tuple[str, str], ...] = (
    ("kernel.core_pattern", _PROGRAM),
    ("kernel.modprobe", _PROGRAM),
    ("kernel.usermodehelper.*", _PROGRAM),
    ("kernel.poweroff_cmd", _PROGRAM),
    ("kernel.hotplug", _PROGRAM),
    ("fs.binfmt_misc.*", _BINFMT),
    ("fs.suid_dumpable", _DEFENSE),
    ("fs.protected_*", _DEFENSE),
    ("kernel.randomize_va_space", _DEFENSE),
    ("kernel.kptr_restrict", _DEFENSE),
    ("kernel.dmesg_restrict", _DEFENSE),
    ("kernel.yama.*", _DEFENSE),
    ("kernel.kexec_load_disabled", _DEFENSE),
    ("kernel.unprivileged_bpf_disabled", _DEFENSE),
    ("kernel.perf_event_paranoid", _DEFENSE),
    ("kernel.sysrq", _DEFENSE),
    ("vm.mmap_min_addr", _DEFENSE),
    ("vm.unprivileged_userfaultfd", _DEFENSE),
    ("net.core.bpf_jit_harden", _DEFENSE),
    ("kernel.modules_disabled", _ONEWAY),
    ("user.*", _USERNS),
    ("kernel.unprivileged_userns_clone", _USERNS),
    ("kernel.apparmor_restrict_unprivileged_userns", _USERNS),
    # Address-space randomization bits: any value the node picks is at best what the kernel chose.
    ("vm.mmap_rnd_bits", _DEFENSE),
    ("vm.mmap_rnd_compat_bits", _DEFENSE),
)

# Keys that take only their hardened values: key pattern (fnmatch) -> (allowed range, description).
HARDENED: dict[str, tuple[tuple[int, int], str]] = {
    "dev.tty.legacy_tiocsti": ((0, 0), "0 only"),
    "dev.tty.ldisc_autoload": ((0, 0), "0 only"),
    "kernel.io_uring_disabled": ((1, 2), "1 or 2"),
    # With io_uring_disabled = 1 this group may still create io_uring instances; the default -1 is
    # CAP_SYS_ADMIN only (red team round 8: the node named its own group).
    "kernel.io_uring_group": ((-1, -1), "-1 only"),
    "net.ipv4.ip_unprivileged_port_start": ((1024, 1 << 31), "1024 or above"),
    # 0 lets unprivileged processes leave AppArmor's unconfined profile / load userns policy.
    "kernel.apparmor_restrict_unprivileged_unconfined": ((1, 1), "1 only"),
    "kernel.unprivileged_userns_apparmor_policy": ((1, 1), "1 only"),
    # 1 routes 127/8 from the wire to local services bound to loopback (any interface, all, default).
    "net.ipv4.conf.*.route_localnet": ((0, 0), "0 only"),
    # Source-routed packets steer around filtering: IPv4 0 only; IPv6 0 or -1 (refuse all).
    "net.ipv4.conf.*.accept_source_route": ((0, 0), "0 only"),
    "net.ipv6.conf.*.accept_source_route": ((-1, 0), "0 or -1"),
    # 0 removes the limit after which oopses/warnings panic (a bug is then re-triggered at will);
    # above the kernel's default (10000) is as good as none.
    "kernel.oops_limit": ((1, 10000), "1 to 10000"),
    "kernel.warn_limit": ((1, 10000), "1 to 10000"),
}


_DECIMAL = re.compile(r"-?(0|[1-9][0-9]*)", re.ASCII)  # read the same by the kernel and by int()


def hardened_rule(key: str) -> tuple[tuple[int, int], str] | None:
    for pattern, rule in HARDENED.items():
        if fnmatch.fnmatchcase(key, pattern):
            return rule
    return None


def outside_allowlist(key: str, prefixes: tuple[str, ...]) -> bool:
    """True when `prefixes` (root's `[host] sysctl_allow`) is set and no entry equals `key` or is a whole
    leading run of its name components (`net.core` and `net.core.` take `net.core.somaxconn`, not
    `net.corex`)."""
    if not prefixes:
        return False
    for p in prefixes:
        stem = p.rstrip(".")
        if key == stem or key.startswith(stem + "."):
            return False
    return True


def refused_reason(key: str) -> str | None:
    for pattern, why in DENYLIST:
        if fnmatch.fnmatchcase(key, pattern):
            return why
    return None


def render_value(key: str, v: Any) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return str(int(v)) if v.is_integer() else repr(v)
    if isinstance(v, str):
        if len(v) > MAX_VALUE:
            raise refuse(f"{key}: at most {MAX_VALUE} characters, not {len(v)}")
        if "\n" in v or "\r" in v:
            raise refuse(f"{key}: the value must be a single line")
        return " ".join(v.split())
    raise refuse(f"{key}: the value must be a number, a boolean or a string, not {type(v).__name__}")


@frozen
class SysctlSettings:
    values: tuple[tuple[str, str], ...]  # sorted by name, values rendered


def proc_path(key: str) -> str:
    return "/proc/sys/" + key.replace(".", "/")


def dropin(settings: SysctlSettings) -> bytes | None:
    if not settings.values:
        return None
    return (header(NAME) + "".join(f"{k} = {v}\n" for k, v in settings.values)).encode()


@frozen
class SysctlObserved:
    dropin: bytes | None
    live: tuple[tuple[str, str | None], ...]


class Sysctl(ConfigUnit[SysctlSettings, SysctlObserved]):
    name = NAME
    cleans = True

    def decode(self, obj: dict[str, Any]) -> SysctlSettings:
        out = []
        for key in sorted(obj):
            if not re.fullmatch(KEY_RE, key):
                raise refuse(f"{key}: not a sysctl name ({KEY_RE})")
            why = refused_reason(key)
            if why:
                raise refuse(f"{key} is refused: {why}")
            value = render_value(key, obj[key])
            rule = hardened_rule(key)
            if rule is not None:
                (lo, hi), desc = rule
                # Only a plain decimal integer: the kernel reads a sysctl integer in base 0 (a leading 0
                # is octal, 0x hex), and Python's int() also takes `+`, `_` and any script's digits, so
                # "01024" was 1024 here and 532 to the kernel (red team round 11).
                n = int(value) if _DECIMAL.fullmatch(value) else None
                if n is None or not lo <= n <= hi:
                    raise refuse(f"{key} = {value} is refused: it would lower the host's defenses ({desc})")
            out.append((key, value))
        return SysctlSettings(tuple(out))

    def observe(self, system: System, settings: SysctlSettings | None, ctx: UnitContext) -> SysctlObserved:
        live = []
        for key, _ in settings.values if settings else ():
            text = system.read_text(proc_path(key))
            live.append((key, None if text is None else " ".join(text.split())))
        return SysctlObserved(system.read_bytes(DROPIN), tuple(live))

    def plan(self, settings: SysctlSettings | None, observed: SysctlObserved) -> Plan:
        steps: list[Step] = []
        want = dropin(settings) if settings else None
        if want is None and observed.dropin is not None:
            steps.append(RemoveFile(DROPIN))
        elif want is not None and want != observed.dropin:
            steps.append(WriteFile(DROPIN, want))
        if settings is None:
            return Plan(tuple(steps))
        issues = []
        live = dict(observed.live)
        for key, value in settings.values:
            now = live.get(key)
            if now is None:
                issues.append(
                    Issue("retryable", f"this kernel has no {key} (is the module that provides it loaded?)")
                )
            elif now != value:
                steps.append(Run(("sysctl", "-w", f"{key}={value}"), message=f"cannot set {key}"))
        return Plan(tuple(steps), tuple(issues))


UNIT = Sysctl()
