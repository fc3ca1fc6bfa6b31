"""The one OPS table: every operation the helper serves. Deny by default: an op not here is refused.

Each row: the op's module, request type (decoded strictly) and handler, by name (the module is
imported on the op's first call: a start imports no op family), timeout in seconds, the locks held
while it runs (taken in LOCK_ORDER), flags, the arguments shown in the audit log (the rest is pinned
by a digest) and a one-line summary. docs/helper-rpc.md documents every row (a test checks it). The libvirt.*,
ch.* and nft.* operations of the instances section slot in as rows of the same shape.

Locks: `units` (host.unit: one unit at a time), `access` (access.apply: one render at a time),
`gpus` (what changes the GPUs' holders: cdi files,
gpu.reset, VM starts; host.unit takes it itself for mig-layout only, after `units`),
`system` (node.reboot, daemon.swap and daemon.confirm: a reboot never lands in the middle of a swap).
Flag `nowait`: a held lock refuses the request as `busy` instead of waiting (a reboot never waits
behind a driver install).
"""

from __future__ import annotations

import importlib
from typing import Any, cast

from attrs import frozen

from bcd_helper.ops.base import Handler

LOCK_ORDER = ("units", "access", "gpus", "slices", "libvirt", "nft", "ch", "system")
MINUTE = 60.0
# Every op's module is one of the helper's own operation modules (a row names it by its last part).
OPS_PACKAGE = "bcd_helper.ops"


@frozen
class OpSpec:
    """One row. The op's module is named, not imported: it is imported on the op's first call
    (importlib, then the interpreter's module cache), so that a start loads none of the op families
    (libvirt's XML checks, the nft rule builder, ...). tests/helper/test_helper_server.py resolves every
    row, so that a misspelt name fails a test, not a call."""

    module: str
    request_name: str
    handler_name: str
    timeout_s: float
    locks: tuple[str, ...]
    flags: frozenset[str]
    shown: tuple[str, ...]
    summary: str

    @property
    def request(self) -> type[Any]:
        """The op's request type (decoded strictly); imports the op's module on first use."""
        return cast(type[Any], getattr(importlib.import_module(self.module), self.request_name))

    @property
    def handler(self) -> Handler:
        """The op's handler, looked up at each call (so a test may replace it in its module)."""
        return cast(Handler, getattr(importlib.import_module(self.module), self.handler_name))


def _op(
    module: str,
    request: str,
    handler: str,
    timeout_s: float,
    locks: tuple[str, ...] = (),
    flags: tuple[str, ...] = (),
    shown: tuple[str, ...] = (),
    summary: str = "",
) -> OpSpec:
    return OpSpec(
        f"{OPS_PACKAGE}.{module}", request, handler, timeout_s, locks, frozenset(flags), shown, summary
    )


OPS: dict[str, OpSpec] = {
    "helper.ping": _op("host", "Ping", "ping", 5, summary="answers the peer's uid; for health checks"),
    "audit.head": _op(
        "auditops",
        "AuditHead",
        "audit_head",
        5,
        summary="the audit log's head (seq, sha256) for the node's StatusReport; lines up to it may rotate",
    ),
    "file.write": _op(
        "files",
        "FileWrite",
        "file_write",
        MINUTE,
        locks=("gpus",),
        shown=("kind", "id", "encoding"),
        summary="write a file of a known kind; the helper builds the path and checks the content",
    ),
    "file.remove": _op(
        "files",
        "FileRemove",
        "file_remove",
        MINUTE,
        locks=("gpus",),
        shown=("kind", "id"),
        summary="remove a file of a known kind",
    ),
    "slice.apply": _op(
        "slices",
        "SliceApply",
        "slice_apply",
        2 * MINUTE,
        locks=("slices",),
        shown=(
            "name",
            "cpus",
            "mems",
            "cpu_millis",
            "memory_bytes",
            "hugepages_2mi",
            "hugepages_1gi",
            "reset",
        ),
        summary="start a hold slice, set its limits and reset the limits it names",
    ),
    "slice.remove": _op(
        "slices",
        "SliceRemove",
        "slice_remove",
        2 * MINUTE,
        # gpus too: its hold-file check and a hold write's slice check (file.write, gpus) never interleave
        locks=("gpus", "slices"),
        shown=("name",),
        summary="stop a hold slice once root sees it empty",
    ),
    "host.unit": _op(
        "hostunit",
        "HostUnit",
        "host_unit",
        30 * MINUTE,
        locks=("units",),
        shown=("unit", "busy_gpus"),
        summary="re-plan and apply one config unit as root from its name and settings",
    ),
    "access.apply": _op(
        "access",
        "AccessApply",
        "access_apply",
        2 * MINUTE,
        locks=("access",),
        summary="render and write the access section's sshd files from the signed spec; reload sshd",
    ),
    "gpu.reset": _op(
        "host",
        "GpuReset",
        "gpu_reset",
        10 * MINUTE,
        locks=("gpus",),
        flags=("destructive",),
        shown=("gpu_uuids",),
        summary="reset GPUs no hold and no process uses",
    ),
    "daemon.swap": _op(
        "daemon",
        "DaemonSwap",
        "daemon_swap",
        10 * MINUTE,
        locks=("system",),
        shown=("version", "url", "sha256", "artifact", "confirm_timeout_s", "rollback"),
        summary="verify a signed release and swap it in, keeping the previous one for rollback",
    ),
    "daemon.confirm": _op(
        "daemon",
        "DaemonConfirm",
        "daemon_confirm",
        2 * MINUTE,
        locks=("system",),
        shown=("version", "healthy"),
        summary="confirm the swapped release, or roll it back when it is unhealthy",
    ),
    "audit.tail": _op(
        "logs",
        "AuditTail",
        "audit_tail",
        30,
        shown=("max_bytes",),
        summary="the newest lines of root's audit log, for logs.collect",
    ),
    "node.reboot": _op(
        "host",
        "NodeReboot",
        "node_reboot",
        2 * MINUTE,
        locks=("units", "system"),
        flags=("destructive", "nowait"),
        summary="reboot the machine, unless a unit or swap is running",
    ),
    "libvirt.define": _op(
        "libvirt",
        "LibvirtDefine",
        "libvirt_define",
        2 * MINUTE,
        locks=("gpus", "libvirt"),
        shown=("name",),
        summary="define a domain whose XML passes root's default-deny check (and the signed spec)",
    ),
    "libvirt.start": _op(
        "libvirt",
        "LibvirtStart",
        "libvirt_start",
        5 * MINUTE,
        locks=("gpus", "libvirt"),
        shown=("name", "paused"),
        summary="start bcd's domain (paused when asked), re-validated against the signed spec",
    ),
    "libvirt.shutdown": _op(
        "libvirt",
        "LibvirtName",
        "libvirt_shutdown",
        2 * MINUTE,
        locks=("libvirt",),
        shown=("name",),
        summary="ask bcd's domain to shut down (ACPI)",
    ),
    "libvirt.destroy": _op(
        "libvirt",
        "LibvirtName",
        "libvirt_destroy",
        2 * MINUTE,
        locks=("libvirt",),
        shown=("name",),
        summary="power off bcd's domain",
    ),
    "libvirt.suspend": _op(
        "libvirt",
        "LibvirtName",
        "libvirt_suspend",
        2 * MINUTE,
        locks=("libvirt",),
        shown=("name",),
        summary="pause bcd's domain",
    ),
    "libvirt.resume": _op(
        "libvirt",
        "LibvirtResume",
        "libvirt_resume",
        2 * MINUTE,
        locks=("libvirt",),
        shown=("name",),
        summary="resume bcd's paused domain (with roots: the signed spec wants it RUNNING)",
    ),
    "libvirt.undefine": _op(
        "libvirt",
        "LibvirtName",
        "libvirt_undefine",
        2 * MINUTE,
        locks=("libvirt",),
        shown=("name",),
        summary="undefine bcd's domain",
    ),
    "libvirt.blockresize": _op(
        "libvirt",
        "LibvirtBlockresize",
        "libvirt_blockresize",
        2 * MINUTE,
        locks=("libvirt",),
        shown=("name", "target", "size_bytes"),
        summary="grow a running domain's disk",
    ),
    "libvirt.setmem": _op(
        "libvirt",
        "LibvirtSetmem",
        "libvirt_setmem",
        2 * MINUTE,
        locks=("libvirt",),
        shown=("name", "kib"),
        summary="set a running domain's balloon, within its memory",
    ),
    "libvirt.rebind": _op(
        "libvirt",
        "LibvirtRebind",
        "libvirt_attach_rebind",
        2 * MINUTE,
        locks=("libvirt",),
        shown=("name",),
        summary="hot-add the instance's 1 MiB identity rebind disk (vdz, serial bc-rebind) root checked",
    ),
    "libvirt.unrebind": _op(
        "libvirt",
        "LibvirtName",
        "libvirt_detach_rebind",
        2 * MINUTE,
        locks=("libvirt",),
        shown=("name",),
        summary="remove the identity rebind disk (vdz) from bcd's running domain",
    ),
    "libvirt.restore": _op(
        "libvirt",
        "LibvirtRestore",
        "libvirt_restore",
        10 * MINUTE,
        locks=("gpus", "libvirt"),
        shown=("name", "paused"),
        summary="restore the instance's saved state with root's checked definition (--xml)",
    ),
    # No lock: a save writes the guest's memory (minutes for a large one) and would hold every other
    # libvirt.* op behind it; libvirt's own job lock keeps other changes off that domain meanwhile.
    "libvirt.save": _op(
        "libvirt",
        "LibvirtSave",
        "libvirt_save",
        30 * MINUTE,
        shown=("name",),
        summary="save bcd's running domain's memory state for a snapshot and hand it to the node",
    ),
    "libvirt.console": _op(
        "libvirt",
        "LibvirtName",
        "libvirt_console",
        MINUTE,
        shown=("name",),
        summary="hand back bcd's domain's serial console pty as a file descriptor",
    ),
    "nft.apply": _op(
        "nft",
        "NftApply",
        "nft_apply",
        3 * MINUTE,
        locks=("nft",),
        summary="build and load the instances' nftables rules from typed per-NIC policies (never nft text)",
    ),
    "nft.check": _op(
        "nft",
        "NftCheck",
        "nft_check",
        MINUTE,
        locks=("nft",),
        summary="whether the instances' nftables tables are exactly what nft.apply loaded",
    ),
    # cloud-hypervisor (issue 12): docs/helper-rpc.md, bcd_helper/ops/ch.py
    "ch.taps": _op(
        "ch",
        "ChTaps",
        "ch_taps",
        2 * MINUTE,
        locks=("libvirt", "ch"),  # a define's tap-name check and this one's never pass together
        shown=("name", "bridges"),
        summary="create the instance's taps, owned by the node, on bridges of [helper] instance_bridges",
    ),
    "ch.untaps": _op(
        "ch",
        "ChName",
        "ch_untaps",
        2 * MINUTE,
        locks=("ch",),
        shown=("name",),
        summary="delete the instance's taps (only taps of its names)",
    ),
    "ch.launch": _op(
        "ch",
        "ChLaunch",
        "ch_launch",
        5 * MINUTE,
        locks=("gpus", "ch"),
        shown=("name",),
        summary="start the instance's confined VMM unit from root's own reading of vm.json",
    ),
    "ch.vfio": _op(
        "ch",
        "ChLaunch",
        "ch_vfio",
        5 * MINUTE,
        locks=("gpus", "ch"),
        shown=("name",),
        summary="bind the record's GPUs' IOMMU groups to vfio-pci and hand /dev/vfio to the VMM's user",
    ),
    "ch.unvfio": _op(
        "ch",
        "ChName",
        "ch_unvfio",
        5 * MINUTE,
        locks=("gpus", "ch"),
        shown=("name",),
        summary="give the record's GPUs' groups back to root and their host drivers",
    ),
    "ch.stop": _op(
        "ch",
        "ChName",
        "ch_stop",
        5 * MINUTE,
        locks=("gpus", "ch"),
        shown=("name",),
        summary="stop the instance's VMM unit, answer its state, take back its ACL entries",
    ),
}

# The wait for an answer a client should allow: the op's timeout plus a minute on the connection.
CONNECTION_SLACK_S = MINUTE


def lock_names() -> tuple[str, ...]:
    return LOCK_ORDER
