"""The cloud-hypervisor VMM's confined transient unit (the seeds' runtime.CHLaunch), built identically by
the node (as root) and by the helper's `ch.launch` (with root's own binary): docs/instances.md.

- Files: `data_dir/cloud-hypervisor/instances/<id>/` (vm.json, disk.qcow2, seed.iso, api.sock,
  serial.sock) and `data_dir/cloud-hypervisor/images/<sha256>.<format>` (DLV-RT-02).
- VMM users: one per instance, uid from VMM_UID_BASE (0x7FFD0000) for VMM_UID_COUNT uids, group of the
  same number, account `bcd-vmm-<n>` (systemd 252 refuses `User=` without a passwd entry: root
  creates and removes real accounts, `account_add_argv`/`account_del_argv`).
- The unit: `bcd-ch-<id>.service` in `bcd-instances.slice` with the property table of "The
  cloud-hypervisor unit" (`properties`), started by `systemd-run` (`run_argv`); `unit_file` renders the
  same properties as a unit file for `systemd-analyze verify` and `security --offline=true`.
"""

from __future__ import annotations

from attrs import frozen

from bcd_shared.instancenames import valid_instance_id

VMM_UID_BASE = 0x7FFD0000
# Q-DLV-CHH-01: 65,536 uids, ending below 0x7FFE0000, where systemd's own ranges for foreign and
# dynamic container ids begin; far more instances than one host runs.
VMM_UID_COUNT = 0x10000
SLICE = "bcd-instances.slice"
FIRMWARE = "/usr/share/cloud-hypervisor/CLOUDHV.fd"
MIB = 1 << 20
SYSCALL_DENY = "~@debug @mount @reboot @swap @module @raw-io @clock @cpu-emulation @obsolete"
# `-`: a path this host lacks (no libvirt, no ssh) is skipped, not a failed start.
INACCESSIBLE = ("/etc/bcd", "/etc/ssh", "/etc/libvirt", "/etc/shadow", "/etc/gshadow")


def ch_dir(data_dir: str) -> str:
    return f"{data_dir.rstrip('/')}/cloud-hypervisor"


def ch_instance_dir(data_dir: str, instance_id: str) -> str:
    return f"{ch_dir(data_dir)}/instances/{instance_id}"


def ch_images_dir(data_dir: str) -> str:
    return f"{ch_dir(data_dir)}/images"


def unit_name(instance_id: str) -> str:
    """DLV-CHU-01/03: always `.service`, whatever the id (which is checked: no `/`, no `..`)."""
    if not valid_instance_id(instance_id):
        raise ValueError(f"{instance_id[:80]!r} is not an instance id")
    return f"bcd-ch-{instance_id}.service"


def valid_vmm_uid(uid: int) -> bool:
    return VMM_UID_BASE <= uid < VMM_UID_BASE + VMM_UID_COUNT


def vmm_user_name(uid: int) -> str:
    if not valid_vmm_uid(uid):
        raise ValueError(f"uid {uid} is outside bcd's VMM range")
    return f"bcd-vmm-{uid - VMM_UID_BASE}"


def account_add_argv(uid: int, prefix: str | None = None) -> list[list[str]]:
    """groupadd then useradd of the VMM account: no home, no login, group of the same number."""
    name = vmm_user_name(uid)
    pre = ["--prefix", prefix] if prefix else []
    return [
        ["groupadd", *pre, "--gid", str(uid), name],
        [
            "useradd",
            *pre,
            "--uid",
            str(uid),
            "--gid",
            str(uid),
            "--no-create-home",
            "--no-user-group",
            "--home-dir",
            "/nonexistent",
            "--shell",
            "/usr/sbin/nologin",
            "--comment",
            "bcd cloud-hypervisor VMM",
            name,
        ],
    ]


def account_del_argv(uid: int, prefix: str | None = None) -> list[list[str]]:
    name = vmm_user_name(uid)
    pre = ["--prefix", prefix] if prefix else []
    return [["userdel", *pre, name], ["groupdel", *pre, name]]


@frozen
class CHLaunch:
    """What the unit is built from. Paths are host paths; every one is checked by the caller."""

    instance_id: str
    uid: int
    data_dir: str
    binary: str
    vcpus: int
    memory_bytes: int
    base_image: str | None = None
    volumes_rw: tuple[str, ...] = ()
    volumes_ro: tuple[str, ...] = ()
    vfio: bool = False
    hugepages: bool = False  # the guest's memory is in huge pages (DLV-PLC-15)
    restored_memory: bool = False  # a memory restore drops hugepages (DLV-CHU-29)
    under_helper: bool = False
    cpus: str = ""  # AllowedCPUs (placement)
    mems: str = ""  # AllowedMemoryNodes
    # (path the VMM sees, path systemd binds there) for the base image and volumes: under the helper,
    # root's hard link of the inode it checked (bcd_helper.chbinds), so that systemd, resolving the
    # source as root after root's checks, never walks a directory of the node's; absent, the path itself.
    bind_sources: tuple[tuple[str, str], ...] = ()

    @property
    def instance_dir(self) -> str:
        return ch_instance_dir(self.data_dir, self.instance_id)

    @property
    def unit(self) -> str:
        return unit_name(self.instance_id)


def memory_max(spec: CHLaunch) -> int:
    """DLV-CHU-26: memory + memory/32 + 256 MiB; only the overhead when the memory is huge pages
    (not charged to the unit, DLV-PLC-15), unless a memory restore dropped them (DLV-CHU-29)."""
    overhead = spec.memory_bytes // 32 + 256 * MIB
    if spec.hugepages and not spec.restored_memory:
        return overhead
    return spec.memory_bytes + overhead


def properties(spec: CHLaunch) -> list[tuple[str, str]]:
    """The seed's property table, in order (DLV-CHU-11..28)."""
    if not valid_vmm_uid(spec.uid):
        raise ValueError(f"uid {spec.uid} is outside bcd's VMM range")
    if spec.vcpus < 1 or spec.memory_bytes < MIB:
        raise ValueError("a VMM needs at least one vCPU and 1 MiB of memory")
    d = spec.instance_dir
    data = spec.data_dir.rstrip("/")
    props: list[tuple[str, str]] = [
        ("User", str(spec.uid)),
        ("Group", str(spec.uid)),
        ("CapabilityBoundingSet", ""),
        ("AmbientCapabilities", ""),
        ("NoNewPrivileges", "yes"),
        ("LimitMEMLOCK", "infinity"),
        ("UMask", "0007" if spec.under_helper else "0077"),
        ("DevicePolicy", "closed"),
        ("DeviceAllow", "/dev/kvm rw"),
    ]
    if spec.vfio:
        props += [("DeviceAllow", "/dev/vfio/vfio rw"), ("DeviceAllow", "char-vfio rw")]
    props += [
        ("ProtectSystem", "strict"),
        ("ProtectHome", "yes"),
        ("PrivateTmp", "yes"),
        ("ProtectProc", "invisible"),
        ("TemporaryFileSystem", "/run:ro"),
        ("TemporaryFileSystem", "/var:ro"),
    ]
    if not (data == "/var" or data.startswith("/var/")):
        # data_dir itself too (round 11): every bind's destination then lies on the unit's own tmpfs,
        # never resolved through a directory of the node's (a `volumes` swapped for a symlink had
        # systemd, as root, create the mount point at the link's target on the host), as under /var.
        props += [
            ("TemporaryFileSystem", f"{data}:ro"),
            ("TemporaryFileSystem", f"{ch_dir(data)}/instances:ro"),
            ("TemporaryFileSystem", f"{ch_images_dir(data)}:ro"),
        ]
    props += [("InaccessiblePaths", f"-{p}") for p in INACCESSIBLE]
    props += [("BindPaths", d), ("ReadWritePaths", d)]
    sources = dict(spec.bind_sources)

    def bind(dest: str) -> str:
        """`SRC:DEST` where the source is not the path itself (neither has a `:`: checked names)."""
        src = sources.get(dest, dest)
        if ":" in src or ":" in dest:
            raise ValueError(f"a bind path with ':' ({src[:80]!r}, {dest[:80]!r})")
        return dest if src == dest else f"{src}:{dest}"

    if spec.base_image:
        props.append(("BindReadOnlyPaths", bind(spec.base_image)))
    for vol in spec.volumes_rw:
        props += [("BindPaths", bind(vol)), ("ReadWritePaths", vol)]
    for vol in spec.volumes_ro:
        props.append(("BindReadOnlyPaths", bind(vol)))
    props += [
        (key, "yes")
        for key in (
            "ProtectKernelTunables",
            "ProtectKernelModules",
            "ProtectKernelLogs",
            "ProtectControlGroups",
            "ProtectClock",
            "ProtectHostname",
            "RestrictSUIDSGID",
            "RestrictRealtime",
            "RestrictNamespaces",
            "LockPersonality",
        )
    ]
    props += [
        ("SystemCallFilter", SYSCALL_DENY),
        ("SystemCallArchitectures", "native"),
        ("PrivateNetwork", "yes"),
        ("RestrictAddressFamilies", "AF_UNIX"),
        ("IPAddressDeny", "any"),
        ("MemoryMax", str(memory_max(spec))),
        ("TasksMax", str(4 * spec.vcpus + 128)),
        ("CPUQuota", f"{(spec.vcpus + 1) * 100}%"),
    ]
    if spec.cpus:
        props.append(("AllowedCPUs", spec.cpus))
    if spec.mems:
        props.append(("AllowedMemoryNodes", spec.mems))
    return props


def exec_argv(spec: CHLaunch) -> list[str]:
    """The VMM's own command line: only its API socket; everything else comes over the API."""
    return [spec.binary, "--api-socket", f"path={spec.instance_dir}/api.sock"]


def run_argv(spec: CHLaunch, systemd_run: str = "systemd-run") -> list[str]:
    """DLV-CH-01: systemd-run --unit=bcd-ch-<id>.service --collect --slice=bcd-instances.slice."""
    argv = [systemd_run, f"--unit={spec.unit}", "--collect", f"--slice={SLICE}", "--quiet"]
    argv += [f"--property={k}={v}" for k, v in properties(spec)]
    return [*argv, "--", *exec_argv(spec)]


def unit_file(spec: CHLaunch) -> str:
    """The same unit as a file (what systemd-run creates transiently), for systemd-analyze."""
    lines = ["[Unit]", f"Description=bcd cloud-hypervisor VMM for instance {spec.instance_id}", ""]
    lines += ["[Service]", "Type=simple", f"Slice={SLICE}", "ExecStart=" + " ".join(exec_argv(spec))]
    lines += [f"{k}={v}" for k, v in properties(spec)]
    return "\n".join(lines) + "\n"
