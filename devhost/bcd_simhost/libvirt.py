"""Fake `virsh`, `qemu-img`, `genisoimage` and the image server of the simulated host.

A file-backed libvirt (the seeds' fakehw runtime, DLV-RT-16): each domain is
`<root>/var/lib/bcd-sim/libvirt/<name>.xml` plus `<name>.json` (`{"state", "boot_id"}`), so domains
outlive the process; a domain recorded running under another boot id is shut off (a host reboot).
Starts are bounded by vCPU and memory totals (`capacity.json`, default: the host's CPUs x 4 and
MemTotal): a start beyond them fails with libvirt's "Cannot allocate memory". Output formats follow
virsh 9.0 (`list --all` table, `domstate` words, `dumpxml` of the defined XML).

`qemu-img create/resize` write real qcow2 v3 headers (with the backing file name and the backing
format extension), so bcd's header checks run on them, and `convert` (a snapshot's flattening, every
driver and backing stated in a `json:` name) writes a flat one of the overlay's size; `virsh save`
writes a stand-in save image (libvirt's 92-byte header, the domain XML, a fake stream) and shuts the
domain off, `restore --xml` honours `--paused`; `genisoimage` writes a stand-in ISO (the
`CD001` signature and the files). `https://images.sim.bcd/<name>.qcow2` serves a flat 1 GiB qcow2,
`IMAGE_SHA256` its digest. A `virsh -c test:///default` call goes to the real virsh: libvirt's test
driver keeps its state in the connection and touches nothing on the host.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path

from bcd_shared.system import CommandResult, LocalSystem, atomic_write

STATE = "/var/lib/bcd-sim/libvirt"
NO_MEMORY = "error: internal error: qemu unexpectedly closed the monitor: Cannot allocate memory\n"
_STATE_WORDS = {"running": "running", "paused": "paused", "shut off": "shut off"}


def qcow2_bytes(size: int, backing: str | None = None, backing_format: str | None = None) -> bytes:
    """A qcow2 v3 header (cluster 64 KiB) with optional backing file and backing format extension."""
    exts = b""
    if backing_format:
        fmt = backing_format.encode()
        exts += struct.pack(">II", 0xE2792ACA, len(fmt)) + fmt + b"\0" * (-len(fmt) % 8)
    exts += struct.pack(">II", 0, 0)
    name = backing.encode() if backing else b""
    backing_offset = 104 + len(exts) if name else 0
    header = struct.pack(
        ">4sIQIIQIIQQIIQQQQII",
        b"QFI\xfb", 3, backing_offset, len(name), 16, size, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4, 104,
    )  # fmt: skip
    return header + exts + name


IMAGE_BYTES = qcow2_bytes(1 << 30)
IMAGE_SHA256 = hashlib.sha256(IMAGE_BYTES).hexdigest()
# Hostile images the server also serves, by name: a qcow2 naming a host file as its backing file.
HOSTILE_IMAGES = {"backing.qcow2": qcow2_bytes(1 << 30, "/etc/shadow", "raw")}


def _r(argv: Sequence[str], rc: int = 0, out: str = "", err: str = "") -> CommandResult:
    return CommandResult(tuple(argv), rc, out.encode(), err.encode())


def _state_dir(system: LocalSystem, create: bool = False) -> Path:
    d = system.host_path(STATE)
    if create:  # libvirtd's own directory: written by whoever changes a domain (root under the helper)
        d.mkdir(parents=True, exist_ok=True)
        os.chmod(d, 0o755)  # noqa: S103 - the fake of libvirt's read-only socket: all may read
    return d


def _boot(system: LocalSystem) -> str:
    try:
        return system.boot_id()
    except FileNotFoundError:
        return ""


def _load(
    system: LocalSystem, name: str, boot: str | None = None, d: Path | None = None
) -> tuple[bytes, dict[str, str]] | None:
    d = _state_dir(system) if d is None else d
    boot = _boot(system) if boot is None else boot
    try:
        xml = (d / f"{name}.xml").read_bytes()
        rec = json.loads((d / f"{name}.json").read_text())
    except (FileNotFoundError, ValueError):
        return None
    if rec.get("state") != "shut off" and rec.get("boot_id") != boot:
        rec = {"state": "shut off", "boot_id": boot}
    return xml, rec


def _save(system: LocalSystem, name: str, state: str, xml: bytes | None = None) -> None:
    # Readable by all: the fake of libvirt's read-only socket (`virsh -r`) for an unprivileged node.
    d = _state_dir(system, create=True)
    if xml is not None:
        atomic_write(d / f"{name}.xml", xml, 0o644)
    atomic_write(d / f"{name}.json", json.dumps({"state": state, "boot_id": _boot(system)}).encode(), 0o644)


def _pty(name: str) -> str:
    return f"/dev/pts/{int(hashlib.sha256(name.encode()).hexdigest()[:6], 16) % 1000 + 10}"


def _names(system: LocalSystem) -> list[str]:
    d = _state_dir(system)
    return sorted(p.name[:-4] for p in d.glob("*.xml")) if d.is_dir() else []


def _size(xml: bytes) -> tuple[int, int]:
    root = ET.fromstring(xml)  # noqa: S314 (bcd's own XML on the simulated host)
    mem = root.find("memory")
    kib = int((mem.text or "0").strip()) if mem is not None else 0
    return int((root.findtext("vcpu") or "1").strip()), kib * 1024


def _capacity(system: LocalSystem) -> tuple[int, int]:
    data = system.read_bytes(f"{STATE}/capacity.json")
    if data is not None:
        doc = json.loads(data)
        return int(doc["vcpus"]), int(doc["memory_bytes"])
    cpus = (system.read_text("/sys/devices/system/cpu/online") or "0-0").strip().split("-")[-1]
    meminfo = system.read_text("/proc/meminfo") or ""
    m = re.search(r"^MemTotal:\s+(\d+) kB", meminfo, re.M)
    return (int(cpus) + 1) * 4, (int(m.group(1)) * 1024 if m else 1 << 40)


TEST_URI = "test:///default"


def _real_test_driver(argv: Sequence[str]) -> CommandResult:
    """libvirt's test driver touches nothing on the host: the real virsh serves it (tests, benches)."""
    import shutil
    import subprocess

    real = shutil.which("virsh")
    if real is None:
        return _r(argv, 127, err="virsh: not found (the test driver needs the real virsh)\n")
    proc = subprocess.run([real, *argv[1:]], capture_output=True, timeout=120, check=False)
    return CommandResult(tuple(argv), proc.returncode, proc.stdout, proc.stderr)


_NOT_ASSOCIATED = "error: invalid argument: file descriptor group '{}' was not associated with the domain\n"


def virsh(system: LocalSystem, argv: Sequence[str], stdin: bytes | None) -> CommandResult:
    if TEST_URI in argv:
        return _real_test_driver(argv)
    args = list(argv[1:])
    while args and args[0] in ("-r", "-c", "-q"):
        args = args[2:] if args[0] == "-c" else args[1:]
    if not args:
        return _r(argv, 1, err="error: no command\n")
    if len(args) == 1 and ";" in args[0]:
        return _chain(system, argv, args[0], stdin)
    return _one(system, argv, args, stdin, {})


def _chain(system: LocalSystem, argv: Sequence[str], line: str, stdin: bytes | None) -> CommandResult:
    """virsh's `;`-separated commands in one connection: `dom-fd-associate NAME GROUP FD
    [--seclabel-writable]` (libvirt >= 9.0) holds the caller's descriptor (this process's: the simulated
    tool runs in the helper) for the commands after it; the first failure ends the chain."""
    import shlex

    assoc: dict[str, str] = {}
    out = b""
    for part in line.split(";"):
        words = shlex.split(part)
        if not words:
            continue
        if words[0] == "dom-fd-associate":
            if len(words) < 4 or not words[3].isdigit():
                return _r(argv, 1, err="error: dom-fd-associate NAME GROUP FD\n")
            try:
                os.fstat(int(words[3]))
            except OSError:
                return _r(argv, 1, err=f"error: Unable to get file descriptor {words[3]}\n")
            assoc[words[2]] = f"/proc/self/fd/{words[3]}"
            continue
        result = _one(system, argv, words, stdin, assoc)
        out += result.stdout
        if not result.ok:
            return CommandResult(tuple(argv), result.returncode, out, result.stderr)
    return CommandResult(tuple(argv), 0, out, b"")


def _unassociated(xml: bytes, assoc: dict[str, str]) -> str | None:
    """The first fdgroup of the definition no descriptor was associated with (libvirt refuses then)."""
    for src in ET.fromstring(xml).iter("source"):  # noqa: S314 (the simulation's own copy)
        group = src.get("fdgroup")
        if group is not None and group not in assoc:
            return group
    return None


def _one(
    system: LocalSystem, argv: Sequence[str], args: list[str], stdin: bytes | None, assoc: dict[str, str]
) -> CommandResult:
    cmd, rest = args[0], args[1:]
    if cmd == "list":
        lines = [" Id   Name   State", "-" * 30]
        boot = _boot(system)
        d = _state_dir(system)
        for i, name in enumerate(_names(system), start=1):
            got = _load(system, name, boot, d)
            if got is not None:
                state = got[1]["state"]
                lines.append(f" {i if state != 'shut off' else '-'}    {name}   {state}")
        return _r(argv, out="\n".join(lines) + "\n\n")
    if cmd == "define":
        path = next(a for a in rest if not a.startswith("--"))
        xml = Path(path).read_bytes()
        name = (ET.fromstring(xml).findtext("name") or "").strip()  # noqa: S314
        old = _load(system, name)
        if old is not None:  # libvirt: a name is defined again only under its own UUID
            new_uuid = (ET.fromstring(xml).findtext("uuid") or "").strip()  # noqa: S314
            old_uuid = (ET.fromstring(old[0]).findtext("uuid") or "").strip()  # noqa: S314
            if new_uuid != old_uuid:
                shown = old_uuid or "(none)"
                err = f"error: operation failed: domain '{name}' already exists with uuid {shown}\n"
                return _r(argv, 1, err=f"error: Failed to define domain from {path}\n{err}")
        _save(system, name, old[1]["state"] if old else "shut off", xml)
        return _r(argv, out=f"Domain '{name}' defined from {path}\n")
    if cmd == "domstats":
        return _r(argv, out=_domstats(system))
    if cmd == "restore":  # bcd restores only with its own definition (--xml), never the state file's
        if "--xml" not in rest:
            return _r(argv, 1, err="error: the simulation restores only with --xml\n")
        xml_path = rest[rest.index("--xml") + 1]
        xml = Path(xml_path).read_bytes()
        name = (ET.fromstring(xml).findtext("name") or "").strip()  # noqa: S314
        group = _unassociated(xml, assoc)
        if group is not None:
            return _r(argv, 1, err=_NOT_ASSOCIATED.format(group))
        if not Path(rest[0]).is_file():
            return _r(argv, 1, err=f"error: Failed to restore domain from {rest[0]}\n")
        _save(system, name, "paused" if "--paused" in rest else "running", xml)
        return _r(argv, out=f"Domain restored from {rest[0]}\n")
    name = rest[0] if rest else ""
    got = _load(system, name)
    if got is None:
        return _r(argv, 1, err=f"error: failed to get domain '{name}'\n")
    xml, rec = got
    state = rec["state"]
    if cmd == "dumpxml":
        text = xml.decode()
        if state != "shut off":  # libvirt names the serial port's pty while the domain runs
            text = text.replace(
                '<serial type="pty">', f'<serial type="pty">\n      <source path="{_pty(name)}" />', 1
            )
        return _r(argv, out=text)
    if cmd == "domstate":
        return _r(argv, out=f"{state}\n\n")
    if cmd == "start":
        if state != "shut off":
            return _r(
                argv,
                1,
                err="error: Requested operation is not valid: domain is already running\n",
            )
        group = _unassociated(xml, assoc)
        if group is not None:
            return _r(argv, 1, err=_NOT_ASSOCIATED.format(group))
        vcpus, mem = _size(xml)
        cap_cpu, cap_mem = _capacity(system)
        for other in _names(system):
            o = _load(system, other)
            if o is not None and other != name and o[1]["state"] != "shut off":
                v, m = _size(o[0])
                vcpus, mem = vcpus + v, mem + m
        if vcpus > cap_cpu or mem > cap_mem:
            return _r(
                argv,
                1,
                err=f"error: Failed to start domain '{name}'\n{NO_MEMORY}",
            )
        _save(system, name, "paused" if "--paused" in rest else "running")
        pty = system.host_path(_pty(name))  # the pty stands as a plain file on the simulated host
        pty.parent.mkdir(parents=True, exist_ok=True)
        pty.touch(mode=0o620)
        return _r(argv, out=f"Domain '{name}' started\n")
    if cmd in ("shutdown", "destroy"):
        if state == "shut off":
            return _r(argv, 1, err="error: Requested operation is not valid: domain is not running\n")
        _save(system, name, "shut off")
        return _r(argv, out=f"Domain '{name}' {'is being shutdown' if cmd == 'shutdown' else 'destroyed'}\n")
    if cmd == "setmem":
        if state == "shut off":
            return _r(argv, 1, err="error: Requested operation is not valid: domain is not running\n")
        if ET.fromstring(xml).find("devices/memballoon[@model='virtio']") is None:  # noqa: S314
            return _r(argv, 1, err="error: Requested operation is not supported: no balloon device\n")
        kib = int(rest[1].rstrip("K"))
        atomic_write(_state_dir(system) / f"{name}.balloon", f"{kib}\n".encode(), 0o644)
        return _r(argv)
    if cmd == "attach-disk":  # the rebind disk; the simulated guest is a compliant one (DLV-REB-21)
        if state != "running":
            return _r(argv, 1, err="error: Requested operation is not valid: domain is not running\n")
        marker = _state_dir(system) / f"{name}.attached"
        if marker.exists():
            return _r(argv, 1, err="error: Requested operation is not valid: target vdz already exists\n")
        marker.write_text(rest[1] + "\n")
        if not (_state_dir(system) / f"{name}.silent").exists():
            _rebind_guest(Path(rest[1]))
        return _r(argv, out="Disk attached successfully\n")
    if cmd == "attach-device":  # the helper's rebind disk: its XML on stdin (virsh reads /dev/stdin)
        if state != "running":
            return _r(argv, 1, err="error: Requested operation is not valid: domain is not running\n")
        if rest[1:2] != ["/dev/stdin"] or stdin is None:
            return _r(argv, 1, err="error: the simulation attaches a device only from /dev/stdin\n")
        src = ET.fromstring(stdin).find("source")  # noqa: S314 (the helper's own XML)
        path = src.get("file", "") if src is not None else ""
        marker = _state_dir(system) / f"{name}.attached"
        if marker.exists():
            return _r(argv, 1, err="error: Requested operation is not valid: target vdz already exists\n")
        marker.write_text(path + "\n")
        if not (_state_dir(system) / f"{name}.silent").exists():
            _rebind_guest(Path(path))
        return _r(argv, out="Device attached successfully\n")
    if cmd == "detach-disk":
        marker = _state_dir(system) / f"{name}.attached"
        if not marker.exists():
            return _r(argv, 1, err="error: No disk found whose source path or target is vdz\n")
        marker.unlink()
        return _r(argv, out="Disk detached successfully\n")
    if cmd == "save":  # libvirt's save image: its 92-byte header, the domain XML, then QEMU's stream
        if state == "shut off":
            return _r(argv, 1, err="error: Requested operation is not valid: domain is not running\n")
        import struct

        data = xml + b"\0" * (4096 - len(xml) % 4096)
        head = struct.pack("<16s5I56x", b"LibvirtQemudSave", 2, len(data), int(state == "running"), 0, 0)
        Path(rest[1]).write_bytes(head + data + b"QEVM-simulated-stream")
        _save(system, name, "shut off")
        return _r(argv, out=f"\nDomain '{name}' saved to {rest[1]}\n")
    if cmd == "suspend":
        _save(system, name, "paused")
        return _r(argv, out=f"Domain '{name}' suspended\n")
    if cmd == "resume":
        _save(system, name, "running")
        return _r(argv, out=f"Domain '{name}' resumed\n")
    if cmd == "undefine":
        if state != "shut off":
            return _r(argv, 1, err="error: cannot undefine a running domain in the simulation\n")
        d = _state_dir(system)
        (d / f"{name}.xml").unlink()
        (d / f"{name}.json").unlink()
        return _r(argv, out=f"Domain '{name}' has been undefined\n")
    if cmd == "blockresize":
        root = ET.fromstring(xml)  # noqa: S314
        target = rest[1] if len(rest) > 1 else "vda"
        disk = next((d for d in root.findall("devices/disk") if _dev(d) == target), None)
        if disk is None:
            return _r(argv, 1, err=f"error: invalid argument: disk '{target}' was not found in domain\n")
        src = disk.find("source")
        path = src.get("file", "") if src is not None else ""
        size = int(rest[2].rstrip("B"))
        driver = disk.find("driver")
        if driver is not None and driver.get("type") == "raw":
            # A raw volume: bcd truncated the file already; QEMU's block_resize only tells the guest.
            # The simulation records what the guest was told, one line per resize.
            with (_state_dir(system) / f"{name}.resized").open("a") as f:
                f.write(f"{target} {size}\n")
        else:
            _resize(system.host_path(path) if not Path(path).exists() else Path(path), size)
        return _r(argv, out=f"Block device '{target}' is resized\n")
    return _r(argv, 1, err=f"error: unknown command: '{cmd}'\n")


def _domstats(system: LocalSystem) -> str:
    """`virsh domstats --balloon` of the running domains: a virtio balloon's current size (what setmem
    left the guest) and, where a test wrote `<name>.used` (KiB), the guest's available and usable."""
    out = []
    d = _state_dir(system)
    for name in _names(system):
        got = _load(system, name)
        if got is None or got[1]["state"] == "shut off":
            continue
        _vcpus, mem = _size(got[0])
        kib = mem // 1024
        lines = [f"Domain: '{name}'"]
        virtio = ET.fromstring(got[0]).find("devices/memballoon[@model='virtio']") is not None  # noqa: S314
        current = int((d / f"{name}.balloon").read_text()) if (d / f"{name}.balloon").exists() else kib
        lines += [f"  balloon.current={current if virtio else kib}", f"  balloon.maximum={kib}"]
        if virtio and (d / f"{name}.used").exists():
            used = int((d / f"{name}.used").read_text())
            lines += [f"  balloon.available={current}", f"  balloon.usable={max(0, current - used)}"]
        out.append("\n".join(lines) + "\n")
    return "\n".join(out) + "\n"


def _rebind_guest(path: Path) -> None:
    """The simulated guest's half of the identity rebind: read the tar, answer `BCREBOUND <nonce>` at
    the start of the disk's last 4 KiB (what the published guest script does)."""
    import io
    import tarfile

    data = path.read_bytes()
    try:
        with tarfile.open(fileobj=io.BytesIO(data[: len(data) - 4096])) as tar:
            member = tar.extractfile("nonce")
            nonce = member.read().decode().strip() if member is not None else ""
    except (tarfile.TarError, KeyError):
        return  # no bundle on the disk: the guest has nothing to answer
    with path.open("r+b") as f:
        f.seek(len(data) - 4096)
        f.write(f"BCREBOUND {nonce}\n".encode())


def _dev(disk: ET.Element) -> str:
    t = disk.find("target")
    return t.get("dev", "") if t is not None else ""


def _resize(path: Path, size: int) -> None:
    data = bytearray(path.read_bytes())
    struct.pack_into(">Q", data, 24, size)
    atomic_write(path, bytes(data), os.stat(path).st_mode & 0o7777)


def qemu_img(system: LocalSystem, argv: Sequence[str], stdin: bytes | None) -> CommandResult:
    args = list(argv[1:])
    if not args:
        return _r(argv, 1, err="qemu-img: Not enough arguments\n")
    cmd, rest = args[0], args[1:]
    opts: dict[str, str] = {}
    pos: list[str] = []
    i = 0
    while i < len(rest):
        a = rest[i]
        if a in ("-f", "-b", "-F", "-o", "-O"):
            opts[a] = rest[i + 1]
            i += 2
            continue
        if a in ("-u", "-U"):
            opts[a] = ""
        else:
            pos.append(a)
        i += 1
    if cmd == "create":
        if opts.get("-f") != "qcow2":
            return _r(argv, 1, err="qemu-img: the simulation creates qcow2 only\n")
        path, size = Path(pos[0]), int(pos[1])
        atomic_write(path, qcow2_bytes(size, opts.get("-b"), opts.get("-F")), 0o600)
        return _r(argv, out=f"Formatting '{path}', fmt=qcow2 size={size}\n")
    if cmd == "resize":
        target = pos[0]
        if target.startswith("json:"):
            doc = json.loads(target[5:])
            if doc.get("driver") != "qcow2" or "backing" not in doc:
                return _r(argv, 1, err="qemu-img: the simulation resizes qcow2 with backing stated only\n")
            target = doc["file"]["filename"]
        elif opts.get("-f") != "qcow2":
            return _r(argv, 1, err="qemu-img: resize needs a stated format in bcd's usage\n")
        _resize(Path(target), int(pos[1]))
        return _r(argv, out="Image resized.\n")
    if cmd == "convert":  # bcd flattens an overlay for a snapshot: every driver and backing stated
        if opts.get("-O") != "qcow2" or not pos or not pos[0].startswith("json:"):
            return _r(argv, 1, err="qemu-img: the simulation converts a stated json: chain to qcow2 only\n")
        doc = json.loads(pos[0][5:])
        if doc.get("driver") != "qcow2" or "backing" not in doc:
            return _r(argv, 1, err="qemu-img: the simulation converts qcow2 with backing stated only\n")
        head = Path(doc["file"]["filename"]).read_bytes()[:32]
        size = struct.unpack(">Q", head[24:32])[0]
        atomic_write(Path(pos[1]), qcow2_bytes(size, None, None), 0o644)
        return _r(argv)
    return _r(argv, 1, err=f"qemu-img: Command not found: {cmd}\n")


def genisoimage(system: LocalSystem, argv: Sequence[str], stdin: bytes | None) -> CommandResult:
    args = list(argv[1:])
    out = args[args.index("-output") + 1]
    files = [a for a in args if a.startswith("/") and a != out]
    body = b"\0" * 32768 + b"\x01CD001\x01" + b"".join(Path(f).read_bytes() for f in files)
    atomic_write(Path(out), body, 0o600)
    return _r(argv)


def serve_image(system: LocalSystem, argv: Sequence[str], url: str) -> CommandResult | None:
    """curl's answer for the simulated image server, or None for another URL."""
    if not url.startswith("https://images.sim.bcd/"):
        return None
    args = list(argv)
    out = args[args.index("-o") + 1]
    name = url.rsplit("/", 1)[-1]
    atomic_write(Path(out), HOSTILE_IMAGES.get(name, IMAGE_BYTES), 0o600)
    return _r(argv)
