"""libvirt.* called in process over a temporary root whose programs are scripted and recorded (opskit):
the exact `virsh` argv root runs, the files it stages, checks and hands over, each refusal word for word,
with and without command-signing roots (docs/mutation.md, "helper ops: libvirt, ch").

What root reads is realistic: its `virsh dumpxml` answers are libvirt 9.0's own serialisation of bcd's
definition (tests/fixtures/virsh/README.md), `nvidia-smi` answers are columns of the simulated HGX H200's
`--query-gpu` capture (tests/fixtures/nvidia-smi/README.md), virsh's messages are those virsh 9.0 prints
(`error: failed to get domain 'x'`; the qemu driver's `Domain not found: no domain with matching name`),
and the disks are qcow2 v3 headers (bcd_simhost.libvirt.qcow2_bytes; the same bytes `qemu-img create`
writes up to the header's end). Root's definition of a domain defined since the descriptor handover carries
an `fdgroup` and `relabel='no'` on every disk source (`fd_form`; libvirt 9.0's `dumpxml --inactive` shows
both, test_hostile_round4.py); `start` and `restore` then run `dom-fd-associate ... ; start` in one virsh
process, handed root's own descriptors (opskit.Handed records what each run was handed). The
real-process tests (test_helper_libvirt*.py, test_helper_rebind.py) drive the same handlers through
`bcd helper serve`; mutmut sees only these."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shlex
import stat
import struct
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from bcd_helper.ops import libvirt as lv
from bcd_helper.ops.base import HelperContext, Refused
from bcd_helper.ops.hostunit import SignedIntent
from bcd_shared import wire
from bcd_shared.instancenames import tap_name
from bcd_simhost.libvirt import qcow2_bytes
from intentkit import ControlPlane, Signer, intent
from opskit import NODE_UID, Programs, call, context, failed, make_root, programs, refused, req

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
DEFINE = (FIXTURES / "virsh/vm1_define.xml").read_text()
DUMPXML = (FIXTURES / "virsh/vm1_dumpxml-running_test-driver_9.0.0.xml").read_bytes()
NO_DRIVER = "NVIDIA-SMI has failed because it couldn't communicate with the driver"
SMI_CSV = (FIXTURES / "nvidia-smi/hgx-h200-8gpu_mig-on-gpu7_590.48.01_query-gpu_noheader.csv").read_text()
GPUS = [[f.strip() for f in line.split(",")] for line in SMI_CSV.splitlines()]  # index, uuid, name, bus, ...
GPU0, GPU1 = GPUS[0][1], GPUS[1][1]  # at 0000:18:00.0 and 0000:2a:00.0
URI = "qemu:///system"
DATA = "/var/lib/bcd"
INST = f"{DATA}/libvirt/instances/vm1"
SHA = "ab" * 32
BASE = f"{DATA}/libvirt/images/{SHA}.qcow2"
STAGE = "var/lib/bcd-hostconfig/libvirt"
NODE = "node-lv"
NODE_GID = 4343  # not the uid: owner and group are told apart
GIB = 1 << 30
MAC = "52:54:00:00:00:01"
HOSTDEV_DEF = """    <hostdev mode="subsystem" type="pci" managed="yes">
      <source>
        <address domain="0x0000" bus="0x18" slot="0x00" function="0x0" />
      </source>
    </hostdev>
"""
HOSTDEV_DUMP = """    <hostdev mode='subsystem' type='pci' managed='yes'>
      <source>
        <address domain='0x0000' bus='0x18' slot='0x00' function='0x0'/>
      </source>
    </hostdev>
"""
NO_GPU_DEFINE = DEFINE.replace(HOSTDEV_DEF, "")
NO_GPU_DUMP = DUMPXML.replace(HOSTDEV_DUMP.encode(), b"")
assert NO_GPU_DEFINE != DEFINE and NO_GPU_DUMP != DUMPXML
THEIRS = b"<domain type='kvm' id='1'>\n  <name>vm1</name>\n  <memory unit='KiB'>1024</memory>\n</domain>\n"
_SOURCE = re.compile(r"""<source file=(['"])([^'"]*)\1 ?/>""")


def fd_form(xml: str, groups: bool = True) -> str:
    """`xml` with each disk file source as root's staged definition has it (written out here, not by the
    code under test): `fdgroup='bcd<i>'` in document order (`groups`) and DAC relabelling off."""
    n = iter(range(100))

    def one(m: re.Match[str]) -> str:
        q, path = m.group(1), m.group(2)
        group = f" fdgroup={q}bcd{next(n)}{q}" if groups else ""
        return f"<source file={q}{path}{q}{group}><seclabel model={q}dac{q} relabel={q}no{q}/></source>"

    return _SOURCE.sub(one, xml)


def c14n(xml: str | bytes) -> str:
    """The XML's canonical form: what it says, whatever quotes and empty-element style it is written in."""
    text = xml.decode() if isinstance(xml, bytes) else xml
    return ET.canonicalize(text, strip_text=True)


FD_DUMP = fd_form(NO_GPU_DUMP.decode()).encode()  # disk.qcow2 bcd0, the base bcd1, seed.iso bcd2
FD_GPU_DUMP = fd_form(DUMPXML.decode()).encode()
assert FD_DUMP.count(b"fdgroup='bcd") == 3 and b"fdgroup='bcd2'" in FD_DUMP
NOT_ASSOCIATED = "error: invalid argument: file descriptor group '{}' was not associated with the domain\n"


def save_image(xml: bytes = b"<domain/>", version: int = 2, data_len: int = 4096) -> bytes:
    """libvirt's 92-byte save header (magic, version, data length, was_running, compressed, cookie, 15
    unused words) and its data area."""
    return struct.pack("<16s5I56x", b"LibvirtQemudSave", version, data_len, 1, 0, 0) + xml.ljust(
        data_len, b"\0"
    )


class Host:
    """Root's programs: a libvirtd with domains by name (`dumpxml` answers, in turn when a list), the
    GPUs of the simulated HGX H200, compute processes; `fail[verb]` answers a verb with an error.
    virsh runs `;`-separated commands in one process as libvirt 9.0's does: `dom-fd-associate NAME GROUP
    FD [--seclabel-writable]` takes only a descriptor the helper handed that virsh (`programs`), and a
    `start` or `restore` of a definition with an fdgroup no descriptor was associated with is refused
    (libvirt's words). `restore` records the state file libvirtd read (its path, inode and header).
    `race(argv)`, when set, runs before each program: the node's move inside root's window."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.domains: dict[str, Any] = {"vm1": NO_GPU_DUMP}
        self.fail: dict[str, tuple[int, bytes, bytes]] = {}
        self.apps = b""
        self.smi_rc = 0
        self.saved = b""
        self.staged_mode = -1
        self.programs: Programs | None = None
        self.restored: list[tuple[str, int, bytes]] = []
        self.race: Callable[[tuple[str, ...]], None] | None = None

    def __call__(self, argv: tuple[str, ...]) -> tuple[int, bytes, bytes]:
        if self.race is not None:
            self.race(argv)
        if argv[0] == "nvidia-smi":
            return self.smi(argv)
        assert argv[:3] == ("virsh", "-c", URI), argv
        if len(argv) == 4 and ";" in argv[3]:
            return self.chain(argv[3])
        return self.virsh(argv[3], argv[4:], {})

    def chain(self, line: str) -> tuple[int, bytes, bytes]:
        assert self.programs is not None
        passed = {h.fd for h in self.programs.handed[-1]}
        assoc: dict[str, int] = {}
        out = b""
        for part in line.split(";"):
            words = shlex.split(part)
            if words[0] == "dom-fd-associate":
                _name, group, fd, *_flags = words[1:]
                if int(fd) not in passed:
                    return 1, out, f"error: Unable to get file descriptor {fd}\n".encode()
                assoc[group] = int(fd)
                continue
            rc, o, e = self.virsh(words[0], tuple(words[1:]), assoc)
            out += o
            if rc:
                return rc, out, e
        return 0, out, b""

    def virsh(self, verb: str, args: tuple[str, ...], assoc: dict[str, int]) -> tuple[int, bytes, bytes]:
        if verb in self.fail:
            return self.fail[verb]
        if verb in ("start", "restore"):
            xml = (
                self.domains.get(args[0])
                if verb == "start"
                else Path(args[args.index("--xml") + 1]).read_bytes()
            )
            for src in ET.fromstring(xml if isinstance(xml, bytes) else b"<x/>").iter("source"):
                group = src.get("fdgroup")
                if group is not None and group not in assoc:
                    return 1, b"", NOT_ASSOCIATED.format(group).encode()
        if verb == "restore":  # libvirtd (root) reads the state through the path it is given
            with open(args[0], "rb") as f:
                self.restored.append((args[0], os.fstat(f.fileno()).st_ino, f.read(92)))
        if verb == "dumpxml":
            xml = self.domains.get(args[0])
            if xml is None:
                return 1, b"", f"error: failed to get domain '{args[0]}'\n".encode()
            if isinstance(xml, list):
                return 0, xml.pop(0), b""
            return 0, xml, b""
        if verb == "save":  # libvirtd writes the state into the file root named (as root)
            self.staged_mode = stat.S_IMODE(os.stat(args[1]).st_mode)
            Path(args[1]).write_bytes(self.saved or save_image(NO_GPU_DUMP))
            return 0, f"\nDomain '{args[0]}' saved to {args[1]}\n\n".encode(), b""
        return 0, f"\nDomain '{args[0] if args else ''}' {verb}\n\n".encode(), b""

    def smi(self, argv: tuple[str, ...]) -> tuple[int, bytes, bytes]:
        if self.smi_rc:
            return (
                self.smi_rc,
                b"",
                b"NVIDIA-SMI has failed because it couldn't communicate with the driver\n",
            )
        query = argv[1]
        if query == "--query-gpu=pci.bus_id":
            return 0, "".join(f"{g[3]}\n" for g in GPUS).encode(), b""
        if query == "--query-gpu=uuid,pci.bus_id":
            return 0, "".join(f"{g[1]}, {g[3]}\n" for g in GPUS).encode(), b""
        if query == "--query-compute-apps=gpu_uuid,pid":
            return 0, self.apps, b""
        raise AssertionError(argv)


def virsh(*args: str) -> tuple[str, ...]:
    return ("virsh", "-c", URI, *args)


BUS = ("nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader")
UUID_BUS = ("nvidia-smi", "--query-gpu=uuid,pci.bus_id", "--format=csv,noheader")
APPS = ("nvidia-smi", "--query-compute-apps=gpu_uuid,pid", "--format=csv,noheader")


def lay_out(root: Path) -> Path:
    """The node's instance directory (its uid, 0710), the base image and the overlay naming it, as the
    node's runtime leaves them before libvirt.define."""
    d = root / INST.lstrip("/")
    d.mkdir(parents=True)
    images = root / BASE.lstrip("/")
    images.parent.mkdir(parents=True)
    images.write_bytes(qcow2_bytes(GIB))
    (d / "disk.qcow2").write_bytes(qcow2_bytes(10 * GIB, str(images), "qcow2"))
    (d / "seed.iso").write_bytes(b"\0" * 0x8001 + b"CD001")
    for p in (d, d / "disk.qcow2", d / "seed.iso"):
        os.chown(p, NODE_UID, NODE_UID)
    os.chmod(d, 0o710)
    return d


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = make_root(tmp_path)
    lay_out(r)
    return r


@pytest.fixture
def host(root: Path) -> Host:
    return Host(root)


CONFIG = (
    f'[helper]\nsocket = "/run/bcd/helper.sock"\nnode_uid = {NODE_UID}\nnode_gid = {NODE_GID}\n'
    'instance_bridges = "br0"\n'
)


@pytest.fixture
def ctx(root: Path, host: Host) -> Iterator[HelperContext]:
    c = context(root, CONFIG, host)
    host.programs = programs(c)
    yield c
    c.audit.close()


def virsh_runs(ctx: HelperContext) -> list[tuple[str, ...]]:
    return [r[3:] for r in programs(ctx).runs if r[0] == "virsh"]


def inode(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def open_fds() -> list[str]:
    return sorted(os.listdir("/proc/self/fd"))


def associated(*held: tuple[str, int, bool], command: str, name: str = "vm1") -> tuple[str, ...]:
    """The one virsh process root runs with descriptors: each (group, fd, writable) associated, then
    `command` (quoted for virsh's shell-like parser)."""
    steps = [f"dom-fd-associate {name} {g} {fd}" + (" --seclabel-writable" if w else "") for g, fd, w in held]
    return virsh(" ; ".join([*steps, command]))


# --- names, managed domains, virsh's answers --------------------------------------------------------------


@pytest.mark.parametrize(
    "verb", ["shutdown", "destroy", "suspend", "resume", "undefine", "console", "unrebind"]
)
def test_a_name_that_is_no_instance_id_is_refused_before_any_program(ctx: HelperContext, verb: str) -> None:
    handlers = {"console": lv.libvirt_console, "unrebind": lv.libvirt_detach_rebind}
    handler = handlers[verb] if verb in handlers else getattr(lv, f"libvirt_{verb}")
    long = "a" * 70 + "/" + "b" * 40
    assert refused(handler, call(ctx), lv.LibvirtName(long)) == (
        "bad-name",
        f"libvirt.{verb}: {long[:80]!r} is not an instance id",
    )
    assert refused(handler, call(ctx), lv.LibvirtName("a..b"))[0] == "bad-name"
    assert programs(ctx).runs == []


@pytest.mark.parametrize("verb", ["shutdown", "destroy", "suspend", "resume"])
def test_a_simple_verb_runs_virsh_on_bcds_domain(ctx: HelperContext, verb: str) -> None:
    handler = getattr(lv, f"libvirt_{verb}")
    request = lv.LibvirtResume if verb == "resume" else lv.LibvirtName  # resume carries the signed spec
    assert handler(call(ctx), req(request, name="vm1")) == {"name": "vm1"}
    assert programs(ctx).runs == [virsh("dumpxml", "vm1"), virsh(verb, "vm1")]
    ctx_timeouts = programs(ctx).timeouts
    assert len(ctx_timeouts) == 2


@pytest.mark.parametrize("verb", ["shutdown", "destroy", "suspend", "resume", "undefine"])
def test_the_simple_verbs_handler_is_built_per_verb(ctx: HelperContext, host: Host, verb: str) -> None:
    """`_simple(verb)` builds the handler (at import for the module's own; built here again so what it
    builds is what runs): the op's name in its refusals, root's dumpxml, then `virsh VERB NAME`."""
    handler = lv._simple(verb)
    assert handler(call(ctx), req(lv.LibvirtName, name="vm1")) == {"name": "vm1"}
    assert programs(ctx).runs == [virsh("dumpxml", "vm1"), virsh(verb, "vm1")]
    assert refused(handler, call(ctx), lv.LibvirtName("x/y")) == (
        "bad-name",
        f"libvirt.{verb}: 'x/y' is not an instance id",
    )
    assert refused(handler, call(ctx), lv.LibvirtName("vm2")) == (
        "no-domain",
        f"libvirt.{verb}: no domain vm2",
    )
    host.fail[verb] = (1, b"", b"error: failed\n")
    assert failed(handler, call(ctx), lv.LibvirtName("vm1")) == ("virsh", f"virsh {verb} vm1: error: failed")
    host.domains["vm1"] = THEIRS
    assert refused(handler, call(ctx), lv.LibvirtName("vm1")) == (
        "unmanaged",
        f"libvirt.{verb}: domain vm1 is not bcd's: it is never changed",
    )
    assert virsh_runs(ctx)[-1] == ("dumpxml", "vm1")


def test_virsh_runs_with_the_configured_uri_and_two_minutes(root: Path, host: Host) -> None:
    uri = "test:///default"
    text = f'[helper]\nsocket = "/run/bcd/helper.sock"\nnode_uid = {NODE_UID}\nlibvirt_uri = "{uri}"\n'
    c = context(root, text, lambda argv: (0, NO_GPU_DUMP, b""))
    try:
        lv.libvirt_destroy(call(c, bounded=False), lv.LibvirtName("vm1"))
        assert programs(c).runs == [
            ("virsh", "-c", uri, "dumpxml", "vm1"),
            ("virsh", "-c", uri, "destroy", "vm1"),
        ]
        assert programs(c).timeouts == [120, 120]
    finally:
        c.audit.close()


def test_a_verb_libvirt_fails_is_answered_with_virshs_message(ctx: HelperContext, host: Host) -> None:
    host.fail["shutdown"] = (
        1,
        b"",
        b"error: Failed to shutdown domain 'vm1'\nerror: domain is not running\n",
    )
    assert failed(lv.libvirt_shutdown, call(ctx), lv.LibvirtName("vm1")) == (
        "virsh",
        "virsh shutdown vm1: error: Failed to shutdown domain 'vm1'\nerror: domain is not running",
    )
    # no stderr: stdout is the message; either is cut at 500 characters
    host.fail["destroy"] = (1, b"  " + b"x" * 600 + b"\n", b"  \n")
    assert failed(lv.libvirt_destroy, call(ctx), lv.LibvirtName("vm1")) == (
        "virsh",
        "virsh destroy vm1: " + "x" * 500,
    )
    host.fail["suspend"] = (1, b"", b"\xffbad\n")
    assert failed(lv.libvirt_suspend, call(ctx), lv.LibvirtName("vm1"))[1] == "virsh suspend vm1: \ufffdbad"
    host.fail["resume"] = (1, b"\xffworse\n", b"")
    assert failed(lv.libvirt_resume, call(ctx), lv.LibvirtResume("vm1"))[1] == "virsh resume vm1: \ufffdworse"


def test_no_domain_and_a_domain_not_bcds_are_refused_and_never_changed(
    ctx: HelperContext, host: Host
) -> None:
    assert refused(lv.libvirt_destroy, call(ctx), lv.LibvirtName("vm2")) == (
        "no-domain",
        "libvirt.destroy: no domain vm2",
    )
    # the qemu driver's words for the same (libvirt 9.0: "Domain not found: no domain with matching name")
    host.fail["dumpxml"] = (
        1,
        b"",
        b"error: failed to get domain 'vm1'\nerror: Domain not found: No Domain with matching name 'vm1'\n",
    )
    assert refused(lv.libvirt_destroy, call(ctx), lv.LibvirtName("vm1"))[0] == "no-domain"
    host.fail["dumpxml"] = (1, b"", b"error: Domain not found: no domain with matching name 'vm1'\n")
    assert refused(lv.libvirt_destroy, call(ctx), lv.LibvirtName("vm1"))[0] == "no-domain"
    host.fail["dumpxml"] = (1, b"error: failed to get domain 'vm1'\n", b"")  # stdout when stderr is empty
    assert refused(lv.libvirt_destroy, call(ctx), lv.LibvirtName("vm1"))[0] == "no-domain"
    host.fail["dumpxml"] = (1, b"", b"error: failed to connect to the hypervisor\n")
    assert failed(lv.libvirt_destroy, call(ctx), lv.LibvirtName("vm1")) == (
        "virsh",
        "virsh dumpxml vm1: error: failed to connect to the hypervisor",
    )
    del host.fail["dumpxml"]
    for xml in (THEIRS, b"<domain><metadata><other/></metadata></domain>", b"not xml <"):
        host.domains["vm1"] = xml
        assert refused(lv.libvirt_undefine, call(ctx), lv.LibvirtName("vm1")) == (
            "unmanaged",
            "libvirt.undefine: domain vm1 is not bcd's: it is never changed",
        )
    assert all(r[3] == "dumpxml" for r in programs(ctx).runs)


def test_bcds_domain_is_known_by_its_metadata_element() -> None:
    assert lv.is_bcds(DUMPXML) and lv.is_bcds(DEFINE.encode())
    ns = "https://better-compute.dev/libvirt/1"
    assert lv.is_bcds(f"<domain><metadata><i:instance xmlns:i='{ns}'/></metadata></domain>".encode())
    assert not lv.is_bcds(f"<domain><i:instance xmlns:i='{ns}'/></domain>".encode())
    assert not lv.is_bcds(f"<domain><metadata><i:other xmlns:i='{ns}'/></metadata></domain>".encode())
    assert not lv.is_bcds(b"<domain><metadata><instance/></metadata></domain>")


HANDLERS = [
    ("libvirt.start", lv.libvirt_start, lv.LibvirtStart),
    ("libvirt.shutdown", lv.libvirt_shutdown, lv.LibvirtName),
    ("libvirt.destroy", lv.libvirt_destroy, lv.LibvirtName),
    ("libvirt.suspend", lv.libvirt_suspend, lv.LibvirtName),
    ("libvirt.resume", lv.libvirt_resume, lv.LibvirtResume),
    ("libvirt.undefine", lv.libvirt_undefine, lv.LibvirtName),
    ("libvirt.blockresize", lv.libvirt_blockresize, lambda n: lv.LibvirtBlockresize(n, "vda", 1)),
    ("libvirt.setmem", lv.libvirt_setmem, lambda n: lv.LibvirtSetmem(n, 1)),
    ("libvirt.rebind", lv.libvirt_attach_rebind, lv.LibvirtRebind),
    ("libvirt.unrebind", lv.libvirt_detach_rebind, lv.LibvirtName),
    ("libvirt.save", lv.libvirt_save, lv.LibvirtSave),
    ("libvirt.console", lv.libvirt_console, lv.LibvirtName),
]


@pytest.mark.parametrize(("op", "handler", "make"), HANDLERS, ids=[h[0] for h in HANDLERS])
def test_every_verb_names_itself_in_its_refusals(
    ctx: HelperContext, host: Host, op: str, handler: Any, make: Any
) -> None:
    """A bad name, no domain, a domain bcd did not define: refused with the op's own name, and nothing
    but root's dumpxml runs."""
    assert refused(handler, call(ctx), make("x/y")) == ("bad-name", f"{op}: 'x/y' is not an instance id")
    assert refused(handler, call(ctx), make("vm2")) == ("no-domain", f"{op}: no domain vm2")
    host.domains["vm1"] = THEIRS
    assert refused(handler, call(ctx), make("vm1")) == (
        "unmanaged",
        f"{op}: domain vm1 is not bcd's: it is never changed",
    )
    assert virsh_runs(ctx) == [("dumpxml", "vm2"), ("dumpxml", "vm1")]


@pytest.mark.parametrize(
    ("op", "handler", "make"),
    [
        ("libvirt.define", lv.libvirt_define, lambda n: lv.LibvirtDefine(n, NO_GPU_DEFINE)),
        ("libvirt.restore", lv.libvirt_restore, lambda n: lv.LibvirtRestore(n, NO_GPU_DEFINE)),
    ],
)
def test_define_and_restore_name_themselves(ctx: HelperContext, op: str, handler: Any, make: Any) -> None:
    assert refused(handler, call(ctx), make("x/y")) == ("bad-name", f"{op}: 'x/y' is not an instance id")
    assert programs(ctx).runs == []


# --- define ----------------------------------------------------------------------------------------------


def test_define_checks_stages_0600_and_runs_define_validate(ctx: HelperContext, root: Path) -> None:
    got = lv.libvirt_define(call(ctx), req(lv.LibvirtDefine, name="vm1", xml=NO_GPU_DEFINE))
    staged = root / STAGE / "vm1.xml"
    assert got == {
        "name": "vm1",
        "disks": [f"{INST}/disk.qcow2", f"{INST}/seed.iso"],
        "taps": [tap_name("vm1", 0)],
    }
    # root's own definition: every disk source (the backing store's too) with its fdgroup, in document
    # order, and DAC relabelling off; nothing else changed (the bcd prefix kept, one trailing newline)
    data = staged.read_bytes()
    assert c14n(data) == c14n(fd_form(NO_GPU_DEFINE)) and stat.S_IMODE(os.stat(staged).st_mode) == 0o600
    assert data.count(b"<bcd:") == 7 and data.endswith(b"</domain>\n") and not data.endswith(b"\n\n")
    # no hostdev: nvidia-smi is not asked
    assert programs(ctx).runs == [virsh("define", "--validate", str(staged))]


def test_a_definition_whose_tap_names_another_live_instance_has_is_refused(
    ctx: HelperContext, root: Path
) -> None:
    """Tap names hash the id (44 bits; `vm-1762438` and `vm-3742940` collide): a define or restore with
    NICs is refused `tap-collision` when root's records say another live instance has those names: a
    cloud-hypervisor instance's claim (`taps/<stem>`, written by its ch.taps) or another domain root
    defined. Nothing is staged or run; the claim of the instance itself, or none, lets it through."""
    from bcd_shared.instancenames import tap_stem

    claim = root / "var/lib/bcd-hostconfig/taps" / tap_stem("vm1")
    claim.parent.mkdir(parents=True)
    claim.write_bytes(b"vm-twin\n")
    for op, handler, request in (
        ("libvirt.define", lv.libvirt_define, lv.LibvirtDefine("vm1", NO_GPU_DEFINE)),
        ("libvirt.restore", lv.libvirt_restore, lv.LibvirtRestore("vm1", NO_GPU_DEFINE)),
    ):
        reason, message = refused(handler, call(ctx), request)
        assert reason == "tap-collision" and message.startswith(f"{op}: instance vm1's taps"), message
        assert "are instance vm-twin's too" in message
        assert "instance vm1's taps" in message and "15 characters (IFNAMSIZ)" in message
    assert programs(ctx).runs == [] and not (root / STAGE).exists()
    claim.write_bytes(b"vm1\n")
    assert lv.libvirt_define(call(ctx), lv.LibvirtDefine("vm1", NO_GPU_DEFINE))["name"] == "vm1"
    claim.unlink()
    assert lv.libvirt_define(call(ctx), lv.LibvirtDefine("vm1", NO_GPU_DEFINE))["name"] == "vm1"


def test_define_for_another_driver_stages_paths_with_relabelling_off(root: Path) -> None:
    """libvirt's test driver refuses an fdgroup: any URI but qemu's keeps paths, relabelling off."""
    uri = "test:///default"
    c = context(root, CONFIG + f'libvirt_uri = "{uri}"\n', lambda argv: (0, b"", b""))
    try:
        assert lv.libvirt_define(call(c), lv.LibvirtDefine("vm1", NO_GPU_DEFINE))["name"] == "vm1"
        staged = root / STAGE / "vm1.xml"
        assert c14n(staged.read_bytes()) == c14n(fd_form(NO_GPU_DEFINE, groups=False))
        assert programs(c).runs == [("virsh", "-c", uri, "define", "--validate", str(staged))]
    finally:
        c.audit.close()


def test_root_definition_marks_only_disk_files_and_never_twice() -> None:
    xml = (
        b"<domain><devices><disk><source file='/d/a'><seclabel model='dac' relabel='no'/></source>"
        b"<backingStore><source file='/d/b'/></backingStore></disk><disk><source dev='/dev/sdb'/></disk>"
        b"<interface><source file='/d/nic'/></interface></devices></domain>"
    )
    want = (
        "<domain><devices><disk><source fdgroup='bcd0' file='/d/a'><seclabel model='dac' relabel='no'/>"
        "</source><backingStore><source fdgroup='bcd1' file='/d/b'><seclabel model='dac' relabel='no'/>"
        "</source></backingStore></disk><disk><source dev='/dev/sdb'/></disk>"
        "<interface><source file='/d/nic'/></interface></devices></domain>"
    )
    assert c14n(lv.root_definition(xml)) == c14n(want)
    assert c14n(lv.root_definition(xml, fdgroups=False)) == c14n(re.sub(r" fdgroup='bcd.'", "", want))


def test_define_with_a_gpu_asks_roots_nvidia_smi(ctx: HelperContext, root: Path, host: Host) -> None:
    got = lv.libvirt_define(call(ctx, bounded=False), lv.LibvirtDefine("vm1", DEFINE))
    assert got["name"] == "vm1"
    assert programs(ctx).runs == [BUS, virsh("define", "--validate", str(root / STAGE / "vm1.xml"))]
    assert programs(ctx).timeouts == [60, 120]
    # GPU 1's bus id is upper case in nvidia-smi (00000000:2A:00.0): the sysfs form is lower case
    other = DEFINE.replace('bus="0x18"', 'bus="0x2a"')
    assert lv.libvirt_define(call(ctx), lv.LibvirtDefine("vm1", other))["name"] == "vm1"
    # a hostdev that is no GPU of this host
    bad = DEFINE.replace('bus="0x18"', 'bus="0x19"')
    assert refused(lv.libvirt_define, call(ctx), lv.LibvirtDefine("vm1", bad)) == (
        "domain-hostdev",
        "libvirt.define: vm1: hostdev 0000:19:00.0 is not one of this host's GPUs",
    )
    host.smi_rc = 127  # no nvidia-smi: no GPU on this host
    assert refused(lv.libvirt_define, call(ctx), lv.LibvirtDefine("vm1", DEFINE))[0] == "domain-hostdev"
    host.smi_rc = 9
    assert failed(lv.libvirt_define, call(ctx), lv.LibvirtDefine("vm1", DEFINE)) == (
        "nvidia-smi",
        "cannot list GPUs: nvidia-smi exited 9: "
        "NVIDIA-SMI has failed because it couldn't communicate with the driver",
    )


def test_host_gpus_reads_nvidia_smi_in_sysfs_form(ctx: HelperContext, host: Host) -> None:
    assert lv.host_gpus(call(ctx)) == frozenset(
        ["0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0", "0000:5d:00.0", "0000:9a:00.0", "0000:ab:00.0",
         "0000:ba:00.0", "0000:db:00.0"]
    )  # fmt: skip
    c = context(ctx.root, "", lambda argv: (0, b"\n  00000001:AB:01.7  \n\n0000:1:2.3\n\xff\n", b""))
    try:
        assert lv.host_gpus(call(c)) == frozenset(["0001:ab:01.7", "0000:1:2.3", "\ufffd:"])
    finally:
        c.audit.close()


def test_a_definition_outside_the_rules_is_refused_naming_the_rule(ctx: HelperContext, root: Path) -> None:
    cases = [
        (NO_GPU_DEFINE.replace("<name>vm1</name>", "<name>vm2</name>"), "domain-name",
         "libvirt.define: vm1: the domain is named 'vm2', not 'vm1'"),
        (NO_GPU_DEFINE.replace('bridge="br0"', 'bridge="br1"'), "domain-tap",
         "libvirt.define: vm1: NIC 0: bridge 'br1' is not in [helper] instance_bridges"),
    ]  # fmt: skip
    for xml, reason, message in cases:
        assert refused(lv.libvirt_define, call(ctx), lv.LibvirtDefine("vm1", xml)) == (reason, message)
    # the host half: the overlay naming another base than the definition's
    (root / INST.lstrip("/") / "disk.qcow2").write_bytes(qcow2_bytes(GIB, "/etc/shadow", "raw"))
    reason, message = refused(lv.libvirt_define, call(ctx), lv.LibvirtDefine("vm1", NO_GPU_DEFINE))
    assert reason == "domain-disk"
    assert message.startswith("libvirt.define: vm1: ") and "names backing file '/etc/shadow' (raw)" in message
    assert programs(ctx).runs == [] and not (root / STAGE).exists()


def test_define_fails_with_virshs_message_after_staging(ctx: HelperContext, host: Host, root: Path) -> None:
    host.fail["define"] = (1, b"", b"error: operation failed: domain 'vm1' already exists with uuid x\n")
    assert failed(lv.libvirt_define, call(ctx), lv.LibvirtDefine("vm1", NO_GPU_DEFINE)) == (
        "virsh",
        "virsh define vm1: error: operation failed: domain 'vm1' already exists with uuid x",
    )


def test_root_keeps_at_most_max_staged_definitions(ctx: HelperContext, root: Path) -> None:
    stage = root / STAGE
    stage.mkdir(parents=True, mode=0o700)
    for i in range(lv.MAX_STAGED - 1):
        (stage / f"x{i}.xml").write_bytes(b"")
    assert lv.libvirt_define(call(ctx), lv.LibvirtDefine("vm1", NO_GPU_DEFINE))["name"] == "vm1"
    # at the limit: the name already staged is redefined, a new one is refused
    assert len(os.listdir(stage)) == lv.MAX_STAGED
    assert lv.libvirt_define(call(ctx), lv.LibvirtDefine("vm1", NO_GPU_DEFINE))["name"] == "vm1"
    os.rename(stage / "vm1.xml", stage / "other.xml")
    message = f"root keeps at most 1024 definitions in {lv.STAGE_DIR}"
    assert refused(lv.libvirt_define, call(ctx), lv.LibvirtDefine("vm1", NO_GPU_DEFINE)) == (
        "too-many-files",
        f"libvirt.define: {message}",
    )
    assert refused(lv.libvirt_restore, call(ctx), lv.LibvirtRestore("vm1", NO_GPU_DEFINE)) == (
        "too-many-files",
        f"libvirt.restore: {message}",
    )
    os.rename(stage / "other.xml", stage / "vm1.xml")  # its own name staged: a restore redefines it
    (root / STATE.lstrip("/")).write_bytes(save_image())
    assert lv.libvirt_restore(call(ctx), lv.LibvirtRestore("vm1", NO_GPU_DEFINE))["name"] == "vm1"


def test_a_staging_directory_root_does_not_own_alone_is_refused(ctx: HelperContext, root: Path) -> None:
    stage = root / STAGE
    stage.mkdir(parents=True)
    os.chown(stage, NODE_UID, NODE_UID)
    reason, message = refused(lv.libvirt_define, call(ctx), lv.LibvirtDefine("vm1", NO_GPU_DEFINE))
    assert reason == "root-only" and "/var/lib/bcd-hostconfig/libvirt" in message
    assert os.listdir(stage) == [] and programs(ctx).runs == []


# --- start -----------------------------------------------------------------------------------------------


def test_start_rechecks_roots_definition_and_starts(ctx: HelperContext, host: Host) -> None:
    """A domain defined before the descriptor handover (no fdgroup in root's view): paths, no descriptor."""
    assert lv.libvirt_start(call(ctx), req(lv.LibvirtStart, name="vm1")) == {"name": "vm1", "paused": False}
    assert programs(ctx).runs == [virsh("dumpxml", "vm1"), virsh("start", "vm1")]
    assert lv.libvirt_start(call(ctx), lv.LibvirtStart("vm1", paused=True)) == {"name": "vm1", "paused": True}
    assert programs(ctx).runs[-1] == virsh("start", "vm1", "--paused")
    host.fail["start"] = (1, b"", b"error: Failed to start domain 'vm1'\nerror: Cannot allocate memory\n")
    assert failed(lv.libvirt_start, call(ctx), lv.LibvirtStart("vm1")) == (
        "virsh",
        "virsh start vm1: error: Failed to start domain 'vm1'\nerror: Cannot allocate memory",
    )
    host.domains["vm1"] = THEIRS
    assert refused(lv.libvirt_start, call(ctx), lv.LibvirtStart("vm1")) == (
        "unmanaged",
        "libvirt.start: domain vm1 is not bcd's: it is never changed",
    )


def test_start_hands_qemu_roots_own_descriptors_of_the_checked_disks(
    ctx: HelperContext, root: Path, host: Host
) -> None:
    """Root opens each fdgroup source itself (the writable overlay read-write, its base and the cdrom
    read-only, none inheritable in root, all blocking) and hands exactly those to the one virsh that
    associates each group and starts; every descriptor is closed once virsh ran, answered or failed."""
    d = root / INST.lstrip("/")
    host.domains["vm1"] = FD_DUMP
    files = [d / "disk.qcow2", root / BASE.lstrip("/"), d / "seed.iso"]
    before = open_fds()
    assert lv.libvirt_start(call(ctx, bounded=False), req(lv.LibvirtStart, name="vm1")) == {
        "name": "vm1",
        "paused": False,
    }
    handed = programs(ctx).handed[-1]
    assert [(h.path, h.inode, h.access, h.inheritable, h.blocking) for h in handed] == [
        (str(files[0]), inode(files[0]), os.O_RDWR, False, True),
        (str(files[1]), inode(files[1]), os.O_RDONLY, False, True),
        (str(files[2]), inode(files[2]), os.O_RDONLY, False, True),
    ]
    fds = [h.fd for h in handed]
    assert programs(ctx).runs == [
        virsh("dumpxml", "vm1"),
        associated(
            ("bcd0", fds[0], True), ("bcd1", fds[1], False), ("bcd2", fds[2], False), command="start vm1"
        ),
    ]
    assert programs(ctx).handed[0] == () and programs(ctx).timeouts == [120, 120]
    assert open_fds() == before
    assert lv.libvirt_start(call(ctx), lv.LibvirtStart("vm1", paused=True))["paused"] is True
    fds = [h.fd for h in programs(ctx).handed[-1]]
    assert programs(ctx).runs[-1] == associated(
        ("bcd0", fds[0], True), ("bcd1", fds[1], False), ("bcd2", fds[2], False), command="start vm1 --paused"
    )
    host.fail["start"] = (1, b"", b"error: Failed to start domain 'vm1'\nerror: Cannot allocate memory\n")
    assert failed(lv.libvirt_start, call(ctx), lv.LibvirtStart("vm1")) == (
        "virsh",
        "virsh start vm1: error: Failed to start domain 'vm1'\nerror: Cannot allocate memory",
    )
    assert open_fds() == before


def test_a_read_only_disk_is_handed_read_only(ctx: HelperContext, root: Path, host: Host) -> None:
    """A disk marked <readonly/> (not a cdrom) is opened read-only and associated without
    --seclabel-writable."""
    host.domains["vm1"] = FD_DUMP.replace(
        b"<target dev='vda' bus='virtio'/>", b"<target dev='vda' bus='virtio'/><readonly/>"
    )
    assert b"<readonly/>" in host.domains["vm1"]
    lv.libvirt_start(call(ctx), lv.LibvirtStart("vm1"))
    handed = programs(ctx).handed[-1]
    assert [h.access for h in handed] == [os.O_RDONLY] * 3
    assert " --seclabel-writable" not in programs(ctx).runs[-1][3]


def test_a_start_libvirt_refuses_for_a_group_without_a_descriptor_is_answered(
    ctx: HelperContext, root: Path, host: Host
) -> None:
    """A source without an fdgroup is left to libvirt (its path), one without a file is never opened by
    root (nothing to check): its group stays unassociated, and libvirt's refusal of the start comes back
    word for word."""
    host.domains["vm1"] = FD_DUMP.replace(b" fdgroup='bcd1'", b"").replace(
        b"<serial type='pty'>",
        b"<disk type='file' device='cdrom'><source fdgroup='x'/></disk><serial type='pty'>",
    )
    assert failed(lv.libvirt_start, call(ctx), lv.LibvirtStart("vm1")) == (
        "virsh",
        "virsh start vm1: " + NOT_ASSOCIATED.format("x").strip(),
    )
    fds = [h.fd for h in programs(ctx).handed[-1]]
    assert programs(ctx).runs[-1] == associated(
        ("bcd0", fds[0], True), ("bcd2", fds[1], False), command="start vm1"
    )


def held_disk(path: str, fmt: str = "raw", extra: str = "", backing: str = "") -> bytes:
    return (
        f"<domain><devices><disk type='file' device='disk'><driver name='qemu' type='{fmt}'/>"
        f"<source file='{path}' fdgroup='bcd0'/>{backing}<target dev='vda' bus='virtio'/>{extra}</disk>"
        "</devices></domain>"
    ).encode()


def test_root_hands_over_only_what_it_opened_and_checked(
    ctx: HelperContext, root: Path, tmp_path: Path
) -> None:
    """`_held_files`: each fdgroup source opened by root under data_dir, through directories without a
    link, the file itself never a link, a regular file with one link; a refusal names the path (at most
    200 characters) and closes every descriptor opened before it."""
    d = root / INST.lstrip("/")
    held = lambda xml: lv._held_files(call(ctx), "libvirt.start", "vm1", xml)  # noqa: E731
    before = open_fds()
    long = f"{DATA}/" + "x" * 250
    cases = [
        ("/etc/shadow", "'/etc/shadow' is outside data_dir"),
        (f"{DATA}x/a.img", f"'{DATA}x/a.img' is outside data_dir"),
        ("/" + "y" * 300, f"{('/' + 'y' * 199)!r} is outside data_dir"),
        (f"{INST}/gone.img", f"'{INST}/gone.img': No such file or directory"),
        (long, f"{long[:200]!r}: No such file or directory"),
        (f"{INST}/nodir/a.img", f"'{INST}/nodir/a.img': a symlink on the way"),
        (f"{long}/a.img", f"{long[:200]!r}: a symlink on the way"),
        (f"{INST}/{'z' * 230}", f"{(INST + '/' + 'z' * 230)[:200]!r} must be a regular file with one link"),
        (f"{INST}/sub", f"'{INST}/sub': Is a directory"),  # a writable disk opened read-write
        (f"{INST}/link.img", f"'{INST}/link.img': Too many levels of symbolic links"),
        (f"{INST}/twice.img", f"'{INST}/twice.img' must be a regular file with one link"),
        (f"{INST}/fifo", f"'{INST}/fifo' must be a regular file with one link"),
    ]
    (d / "sub").mkdir()
    os.symlink(d / "seed.iso", d / "link.img")
    (tmp_path / "t").write_bytes(b"")
    os.link(tmp_path / "t", d / "twice.img")
    os.link(tmp_path / "t", d / ("z" * 230))
    os.mkfifo(d / "fifo")  # opened non-blocking (read-write: a writable disk) and refused on the descriptor
    for path, message in cases:
        # the seed (opened first, read-only) is closed again when the second disk is refused
        xml = held_disk(path).replace(
            b"<devices>",
            f"<devices><disk type='file' device='cdrom'><source file='{INST}/seed.iso' fdgroup='bcd9'/>"
            "<target dev='sdc' bus='sata'/><readonly/></disk>".encode(),
        )
        assert refused(held, xml) == ("domain-disk", f"libvirt.start: vm1: {message}")
        assert open_fds() == before
    # read-only, the FIFO is opened non-blocking too (a blocking open would wait for a writer forever)
    assert refused(held, held_disk(f"{INST}/fifo", extra="<readonly/>")) == (
        "domain-disk",
        f"libvirt.start: vm1: '{INST}/fifo' must be a regular file with one link",
    )
    # a cdrom is read-only whether or not the definition says <readonly/>
    cdrom = (
        f"<domain><devices><disk type='file' device='cdrom'><source file='{INST}/seed.iso' fdgroup='bcd0'/>"
    )
    got = held(f"{cdrom}</disk></devices></domain>".encode())
    try:
        assert [(h.group, h.writable) for h in got] == [("bcd0", False)]
        assert fcntl.fcntl(got[0].fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
    finally:
        os.close(got[0].fd)
    os.rename(d, tmp_path / "vm1")
    os.symlink(tmp_path / "vm1", d)
    assert refused(held, held_disk(f"{INST}/seed.iso")) == (
        "domain-disk",
        f"libvirt.start: vm1: '{INST}/seed.iso': a symlink on the way",
    )
    assert open_fds() == before


def test_root_reads_each_qcow2_header_through_its_descriptor(ctx: HelperContext, root: Path) -> None:
    """A qcow2 source's header is read through root's descriptor: flat, or naming exactly its explicit
    backing store (the file and its format); a header that is no qcow2 is refused with its reason."""
    d = root / INST.lstrip("/")
    base = root / BASE.lstrip("/")
    held = lambda xml: lv._held_files(call(ctx), "libvirt.start", "vm1", xml)  # noqa: E731
    before = open_fds()
    chain = (
        "<backingStore type='file'><format type='{}'/>"
        f"<source file='{BASE}' fdgroup='bcd1'/><backingStore/></backingStore>"
    )
    overlay = lambda fmt="qcow2": held_disk(f"{INST}/disk.qcow2", "qcow2", backing=chain.format(fmt))  # noqa: E731
    got = held(overlay())
    try:
        assert [(h.group, h.writable) for h in got] == [("bcd0", True), ("bcd1", False)]
        assert [os.fstat(h.fd).st_ino for h in got] == [
            os.stat(d / "disk.qcow2").st_ino,
            os.stat(base).st_ino,
        ]
    finally:
        for h in got:
            os.close(h.fd)
    # the overlay names the base as qcow2; the definition's chain says raw
    assert refused(held, overlay("raw")) == (
        "domain-disk",
        f"libvirt.start: vm1: {INST}/disk.qcow2 names backing file {str(base)!r}, not {str(base)!r}",
    )
    # a flat qcow2 disk (no chain named) whose header names a backing file
    assert refused(held, held_disk(f"{INST}/disk.qcow2", "qcow2")) == (
        "domain-disk",
        f"libvirt.start: vm1: {INST}/disk.qcow2 names backing file {str(base)!r}, not None",
    )
    # the base (the chain's last) must be flat itself
    base.write_bytes(qcow2_bytes(GIB, "/etc/shadow", "raw"))
    assert refused(held, overlay()) == (
        "domain-disk",
        f"libvirt.start: vm1: {BASE} names backing file '/etc/shadow', not None",
    )
    (d / "disk.qcow2").write_bytes(b"QFI\xfb\0\0\0\x07" + b"\0" * 100)
    assert refused(held, overlay()) == (
        "domain-disk",
        f"libvirt.start: vm1: {INST}/disk.qcow2: qcow2 version 7, only 2 and 3 are accepted",
    )
    assert open_fds() == before
    # a raw disk's bytes are never read as a header; a source without a group is root's to leave alone
    got = held(
        held_disk(f"{INST}/disk.qcow2", "raw", backing=chain.format("qcow2").replace(" fdgroup='bcd1'", ""))
    )
    assert [h.group for h in got] == ["bcd0"]
    os.close(got[0].fd)
    base.write_bytes(qcow2_bytes(GIB))
    (d / "disk.qcow2").write_bytes(qcow2_bytes(GIB))
    got = held(held_disk(f"{INST}/disk.qcow2", "qcow2"))  # a flat qcow2 with no chain named
    assert [h.group for h in got] == ["bcd0"]
    os.close(got[0].fd)


def test_root_follows_the_whole_explicit_chain(ctx: HelperContext, root: Path) -> None:
    """A chain of three (overlay, middle, base): every source opened and each qcow2 header checked
    against the next; a qcow2 backing store after a raw top is checked too."""
    d = root / INST.lstrip("/")
    base, mid, top = root / BASE.lstrip("/"), d / "mid.qcow2", d / "disk.qcow2"
    mid.write_bytes(qcow2_bytes(GIB, str(base), "qcow2"))
    top.write_bytes(qcow2_bytes(GIB, str(mid), "qcow2"))
    fmt = "<backingStore><format type='qcow2'/>"
    inner = f"{fmt}<source file='{BASE}' fdgroup='bcd2'/><backingStore/></backingStore>"
    chain = f"{fmt}<source file='{INST}/mid.qcow2' fdgroup='bcd1'/>{inner}</backingStore>"
    held = lambda xml: lv._held_files(call(ctx), "libvirt.start", "vm1", xml)  # noqa: E731
    got = held(held_disk(f"{INST}/disk.qcow2", "qcow2", backing=chain))
    try:
        assert [(h.group, os.fstat(h.fd).st_ino) for h in got] == [
            ("bcd0", os.stat(top).st_ino),
            ("bcd1", os.stat(mid).st_ino),
            ("bcd2", os.stat(base).st_ino),
        ]
    finally:
        for h in got:
            os.close(h.fd)
    base.write_bytes(qcow2_bytes(GIB, "/etc/shadow", "raw"))
    for fmt in ("qcow2", "raw"):  # the base's header is read after a raw top's too
        assert refused(held, held_disk(f"{INST}/disk.qcow2", fmt, backing=chain)) == (
            "domain-disk",
            f"libvirt.start: vm1: {BASE} names backing file '/etc/shadow', not None",
        )


def test_a_disk_swapped_inside_roots_window_is_never_handed_to_qemu(
    ctx: HelperContext, root: Path, host: Host, tmp_path: Path
) -> None:
    """Root rechecked the disks, then (here while it reads the GPUs) the node swaps the overlay for a
    symlink to a host file: root's own open refuses it; no virsh start runs, the host file is untouched."""
    d = root / INST.lstrip("/")
    host.domains["vm1"] = FD_GPU_DUMP
    secret = tmp_path / "secret.qcow2"
    secret.write_bytes(qcow2_bytes(GIB))

    def race(argv: tuple[str, ...]) -> None:
        if argv == UUID_BUS:
            os.replace(d / "disk.qcow2", tmp_path / "disk.qcow2")
            os.symlink(secret, d / "disk.qcow2")

    host.race = race
    before = open_fds()
    assert refused(lv.libvirt_start, call(ctx), lv.LibvirtStart("vm1")) == (
        "domain-disk",
        f"libvirt.start: vm1: '{INST}/disk.qcow2': Too many levels of symbolic links",
    )
    assert [r[3] for r in programs(ctx).runs if r[0] == "virsh"] == ["dumpxml"] and open_fds() == before
    assert os.stat(secret).st_uid == 0 and secret.read_bytes() == qcow2_bytes(GIB)


def test_start_refuses_a_disk_swapped_since_the_define(ctx: HelperContext, root: Path) -> None:
    d = root / INST.lstrip("/")
    os.rename(d / "disk.qcow2", d / "real.qcow2")
    os.symlink(d / "real.qcow2", d / "disk.qcow2")
    assert refused(lv.libvirt_start, call(ctx), lv.LibvirtStart("vm1")) == (
        "domain-disk",
        f"libvirt.start: vm1: '{INST}/disk.qcow2': a symlink on the way (disk.qcow2)",
    )
    os.unlink(d / "disk.qcow2")
    os.link(d / "real.qcow2", d / "disk.qcow2")
    assert refused(lv.libvirt_start, call(ctx), lv.LibvirtStart("vm1"))[1] == (
        f"libvirt.start: vm1: '{INST}/disk.qcow2' has 2 hard links"
    )
    assert [r[3] for r in programs(ctx).runs] == ["dumpxml", "dumpxml"]


def test_start_checks_the_chain_roots_definition_names(ctx: HelperContext, root: Path, host: Host) -> None:
    d = root / INST.lstrip("/")
    # the overlay now names another file than root's definition's backingStore
    (d / "disk.qcow2").write_bytes(qcow2_bytes(GIB, str(d / "seed.iso"), "raw"))
    reason, message = refused(lv.libvirt_start, call(ctx), lv.LibvirtStart("vm1"))
    assert reason == "domain-disk" and f"names backing file '{d}/seed.iso' (raw)" in message
    # a base that names a backing file itself is refused (the base must be flat)
    (d / "disk.qcow2").write_bytes(qcow2_bytes(GIB, str(root / BASE.lstrip("/")), "qcow2"))
    (root / BASE.lstrip("/")).write_bytes(qcow2_bytes(GIB, "/etc/shadow", "raw"))
    reason, message = refused(lv.libvirt_start, call(ctx), lv.LibvirtStart("vm1"))
    assert reason == "domain-disk" and "backing file" in message and "/etc/shadow" in message
    # a raw base: its header is not read, the overlay must name it with format raw
    (root / BASE.lstrip("/")).write_bytes(b"\0" * 512)
    raw = NO_GPU_DUMP.replace(b"<format type='qcow2'/>", b"<format type='raw'/>")
    host.domains["vm1"] = raw
    reason, message = refused(lv.libvirt_start, call(ctx), lv.LibvirtStart("vm1"))
    assert reason == "domain-disk" and "(qcow2)" in message and "(raw)" in message


def test_start_of_a_restored_flat_disk_and_an_empty_cdrom(ctx: HelperContext, root: Path, host: Host) -> None:
    d = root / INST.lstrip("/")
    chain = NO_GPU_DUMP[
        NO_GPU_DUMP.index(b"      <backingStore type") : NO_GPU_DUMP.index(b"      <target dev='vda'")
    ]
    flat = NO_GPU_DUMP.replace(chain, b"      <backingStore/>\n")
    flat = flat.replace(f"<source file='{INST}/seed.iso'/>".encode(), b"")  # an empty drive
    host.domains["vm1"] = flat
    (d / "disk.qcow2").write_bytes(qcow2_bytes(GIB))
    os.unlink(d / "seed.iso")
    assert lv.libvirt_start(call(ctx), lv.LibvirtStart("vm1"))["name"] == "vm1"
    # an explicit empty <backingStore/>: libvirt opens no backing file whatever the header names, so
    # root checks the file (no symlink, one link) and not its header
    (d / "disk.qcow2").write_bytes(qcow2_bytes(GIB, "/etc/shadow", "raw"))
    assert lv.libvirt_start(call(ctx), lv.LibvirtStart("vm1"))["name"] == "vm1"
    os.link(d / "disk.qcow2", d / "second")
    assert refused(lv.libvirt_start, call(ctx), lv.LibvirtStart("vm1"))[1] == (
        f"libvirt.start: vm1: '{INST}/disk.qcow2' has 2 hard links"
    )
    os.unlink(d / "second")
    # a disk (not a cdrom) without a file is never bcd's
    host.domains["vm1"] = flat.replace(f"<source file='{INST}/disk.qcow2'/>".encode(), b"")
    assert refused(lv.libvirt_start, call(ctx), lv.LibvirtStart("vm1")) == (
        "domain-disk",
        "libvirt.start: vm1: a disk without a file is never bcd's",
    )


def test_start_checks_every_disk_after_an_empty_drive(ctx: HelperContext, root: Path, host: Host) -> None:
    """An empty cdrom (no file: libvirt opens nothing) is skipped, and the disks after it are checked;
    a disk without a <driver> is checked as a file (its header is read only where a chain is named)."""
    d = root / INST.lstrip("/")
    empty = b"<disk type='file' device='cdrom'><target dev='sdd' bus='sata'/><readonly/></disk>\n"
    host.domains["vm1"] = NO_GPU_DUMP.replace(b"<devices>\n", b"<devices>\n" + empty, 1)
    assert lv.libvirt_start(call(ctx), lv.LibvirtStart("vm1"))["name"] == "vm1"
    os.link(d / "seed.iso", d / "second")
    assert refused(lv.libvirt_start, call(ctx), lv.LibvirtStart("vm1")) == (
        "domain-disk",
        f"libvirt.start: vm1: '{INST}/seed.iso' has 2 hard links",
    )
    os.unlink(d / "second")
    driverless = (
        b"<disk type='file' device='disk'><source file='" + f"{INST}/extra.img".encode() + b"'/></disk>\n"
    )
    host.domains["vm1"] = NO_GPU_DUMP.replace(b"<devices>\n", b"<devices>\n" + driverless, 1)
    assert refused(lv.libvirt_start, call(ctx), lv.LibvirtStart("vm1"))[1] == (
        f"libvirt.start: vm1: '{INST}/extra.img' does not exist"
    )
    (d / "extra.img").write_bytes(b"not a qcow2 header")
    assert lv.libvirt_start(call(ctx), lv.LibvirtStart("vm1"))["name"] == "vm1"


def test_start_checks_a_direct_kernel_and_initrd(ctx: HelperContext, root: Path, host: Host) -> None:
    d = root / INST.lstrip("/")
    boot = b"<boot dev='hd'/>"
    host.domains["vm1"] = NO_GPU_DUMP.replace(
        boot, boot + f"<kernel>{INST}/vmlinuz</kernel><initrd>{INST}/initrd.img</initrd>".encode()
    )
    (d / "vmlinuz").write_bytes(b"MZ")
    assert refused(lv.libvirt_start, call(ctx), lv.LibvirtStart("vm1")) == (
        "domain-disk",
        f"libvirt.start: vm1: '{INST}/initrd.img' does not exist",
    )
    (d / "initrd.img").write_bytes(b"\x1f\x8b")
    os.unlink(d / "vmlinuz")
    assert refused(lv.libvirt_start, call(ctx), lv.LibvirtStart("vm1"))[1] == (
        f"libvirt.start: vm1: '{INST}/vmlinuz' does not exist"
    )
    (d / "vmlinuz").write_bytes(b"MZ")
    assert lv.libvirt_start(call(ctx), lv.LibvirtStart("vm1"))["name"] == "vm1"


def test_start_never_takes_a_gpu_root_sees_busy_dlv_dev_21(
    ctx: HelperContext, root: Path, host: Host
) -> None:
    """DLV-DEV-21 as root: a live hold or compute processes on the domain's GPU refuse the start."""
    from bcd_shared import cdi

    host.domains["vm1"] = DUMPXML
    assert lv.libvirt_start(call(ctx, bounded=False), lv.LibvirtStart("vm1"))["name"] == "vm1"
    assert programs(ctx).runs == [virsh("dumpxml", "vm1"), UUID_BUS, APPS, virsh("start", "vm1")]
    assert programs(ctx).timeouts == [120, 60, 60, 120]
    host.apps = f"{GPU1}, 4242\n{GPU0}, 777\n".encode()
    assert refused(lv.libvirt_start, call(ctx), lv.LibvirtStart("vm1")) == (
        "gpu-busy",
        f"libvirt.start: vm1: GPU 0000:18:00.0 cannot be passed through: {GPU0} runs compute process 777",
    )
    host.apps = f"{GPU1}, 4242\n".encode()  # another GPU's processes
    assert lv.libvirt_start(call(ctx), lv.LibvirtStart("vm1"))["name"] == "vm1"
    hold = cdi.build_hold_spec(
        allocation_id="alloc_h", reservation_id="r", generation=1, kubernetes=False, cgroup_parent=None,
        devices=[cdi.HoldDevice(GPU0)], env=["BCD_ALLOCATION_ID=alloc_h"], vendor=None,
    )  # fmt: skip
    (root / "etc/cdi").mkdir(parents=True)
    (root / "etc/cdi/bcd-alloc_h.json").write_bytes(cdi.encode_spec(hold))
    assert refused(lv.libvirt_start, call(ctx), lv.LibvirtStart("vm1"))[1] == (
        f"libvirt.start: vm1: GPU 0000:18:00.0 cannot be passed through: {GPU0} is held by alloc_h"
    )
    # a GPU nvidia-smi does not list is refused whenever anything is busy (ALL answers for it)
    os.unlink(root / "etc/cdi/bcd-alloc_h.json")
    host.apps = b"MIG-5f1c2a90-0000-4000-8000-00000000000a, 99\n"
    assert refused(lv.libvirt_start, call(ctx), lv.LibvirtStart("vm1"))[0] == "gpu-busy"
    host.apps = b""
    host.domains["vm1"] = DUMPXML.replace(b"bus='0x18'", b"bus='0x77'")
    assert lv.libvirt_start(call(ctx), lv.LibvirtStart("vm1"))["name"] == "vm1"
    host.apps = f"{GPU1}, 4242\n".encode()  # a GPU nvidia-smi does not list is busy only when all are
    assert lv.libvirt_start(call(ctx), lv.LibvirtStart("vm1"))["name"] == "vm1"


def test_start_fails_closed_when_root_cannot_read_the_gpus(ctx: HelperContext, host: Host) -> None:
    host.domains["vm1"] = DUMPXML
    host.smi_rc = 9
    reason, message = failed(lv.libvirt_start, call(ctx), lv.LibvirtStart("vm1"))
    assert reason == "nvidia-smi"
    assert message == (f"libvirt.start: cannot list GPUs: nvidia-smi exited 9: {NO_DRIVER}")
    c = context(
        ctx.root,
        CONFIG,
        lambda a: (0, DUMPXML, b"") if a[0] == "virsh" else (2 if a == APPS else 0, b"", b"x"),
    )
    try:
        reason, message = failed(lv.libvirt_start, call(c), lv.LibvirtStart("vm1"))
        assert reason == "busy-unknown" and message.startswith(
            "libvirt.start: cannot list compute processes: "
        )
    finally:
        c.audit.close()


def test_a_malformed_hostdev_address_in_roots_view_is_skipped(ctx: HelperContext, host: Host) -> None:
    host.domains["vm1"] = DUMPXML.replace(b"bus='0x18'", b"bus='0xzz'")
    assert lv.libvirt_start(call(ctx), lv.LibvirtStart("vm1"))["name"] == "vm1"
    assert UUID_BUS not in programs(ctx).runs


def test_the_busy_check_reads_every_hostdev_and_nvidia_smis_forms(root: Path) -> None:
    """Addresses root cannot read are skipped and the next ones still checked; GPU 1's bus has hex
    letters (0x2a); older drivers print a 4-digit PCI domain; a byte that is not UTF-8 is no GPU."""
    bad = b"<hostdev mode='subsystem' type='pci' managed='yes'><source><address domain='0x0000' bus='0x19'/>"
    bad += b"</source></hostdev>\n"
    xml = DUMPXML.replace(b"bus='0x18'", b"bus='0x2a'").replace(b"<devices>\n", b"<devices>\n" + bad, 1)

    def script(argv: tuple[str, ...]) -> tuple[int, bytes, bytes]:
        if argv[0] == "virsh":
            return (0, xml, b"") if argv[3] == "dumpxml" else (0, b"", b"")
        if argv == UUID_BUS:
            return 0, f"\xff, x\n{GPU1}, 0000:2A:00.0\n".encode("latin-1"), b""
        return 0, f"{GPU1}, 4242\n".encode(), b""

    c = context(root, CONFIG, script)
    try:
        assert refused(lv.libvirt_start, call(c), lv.LibvirtStart("vm1")) == (
            "gpu-busy",
            "libvirt.start: vm1: GPU 0000:2a:00.0 cannot be passed through: "
            f"{GPU1} runs compute process 4242",
        )
    finally:
        c.audit.close()


# --- blockresize, setmem ---------------------------------------------------------------------------------


def test_blockresize_bounds_and_argv(ctx: HelperContext, host: Host) -> None:
    message = "libvirt.blockresize: target must be vdX and the size from 1 byte to 64 TiB"
    for target, size in [("vda", 0), ("vda", -1), ("vda", (64 << 40) + 1), ("sda", 1), ("vd", 1),
                         ("vdabc", 1),
                         ("vdA", 1), ("vda\n", 1), (" vda", 1)]:  # fmt: skip
        assert refused(lv.libvirt_blockresize, call(ctx), lv.LibvirtBlockresize("vm1", target, size)) == (
            "bad-arguments",
            message,
        )
    assert programs(ctx).runs == []
    for target, size in [("vda", 1), ("vdzz", 64 << 40)]:
        got = lv.libvirt_blockresize(
            call(ctx), req(lv.LibvirtBlockresize, name="vm1", target=target, size_bytes=size)
        )
        assert got == {"name": "vm1", "size_bytes": size}
        assert programs(ctx).runs[-1] == virsh("blockresize", "vm1", target, f"{size}B")
    host.fail["blockresize"] = (1, b"", b"error: Failed to resize block device 'vda'\n")
    assert failed(lv.libvirt_blockresize, call(ctx), lv.LibvirtBlockresize("vm1", "vda", 2)) == (
        "virsh",
        "virsh blockresize vm1: error: Failed to resize block device 'vda'",
    )
    assert refused(lv.libvirt_blockresize, call(ctx), lv.LibvirtBlockresize("x/y", "vda", 2))[0] == "bad-name"
    host.domains["vm1"] = THEIRS
    assert (
        refused(lv.libvirt_blockresize, call(ctx), lv.LibvirtBlockresize("vm1", "vda", 2))[0] == "unmanaged"
    )


def test_setmem_stays_within_the_domains_memory(ctx: HelperContext, host: Host) -> None:
    top = 1048576  # the domain's <memory unit='KiB'>
    for kib in (0, -1, top + 1):
        assert refused(lv.libvirt_setmem, call(ctx), lv.LibvirtSetmem("vm1", kib)) == (
            "bad-arguments",
            f"libvirt.setmem: {kib} KiB is not within the domain's {top} KiB",
        )
    for kib in (1, top):
        assert lv.libvirt_setmem(call(ctx), req(lv.LibvirtSetmem, name="vm1", kib=kib)) == {
            "name": "vm1",
            "kib": kib,
        }
        assert programs(ctx).runs[-1] == virsh("setmem", "vm1", f"{kib}K", "--live")
    host.fail["setmem"] = (1, b"", b"error: Requested operation is not valid: domain is not running\n")
    assert failed(lv.libvirt_setmem, call(ctx), lv.LibvirtSetmem("vm1", 5)) == (
        "virsh",
        "virsh setmem vm1: error: Requested operation is not valid: domain is not running",
    )
    del host.fail["setmem"]
    host.domains["vm1"] = NO_GPU_DUMP.replace(
        b"<memory unit='KiB'>1048576</memory>", b"<memory unit='KiB'> 7 </memory>"
    )
    assert lv.libvirt_setmem(call(ctx), lv.LibvirtSetmem("vm1", 7))["kib"] == 7
    assert refused(lv.libvirt_setmem, call(ctx), lv.LibvirtSetmem("vm1", 8))[0] == "bad-arguments"
    host.domains["vm1"] = NO_GPU_DUMP.replace(b"<memory unit='KiB'>1048576</memory>", b"")
    assert refused(lv.libvirt_setmem, call(ctx), lv.LibvirtSetmem("vm1", 1))[1] == (
        "libvirt.setmem: 1 KiB is not within the domain's 0 KiB"
    )
    host.domains["vm1"] = NO_GPU_DUMP.replace(
        b"<memory unit='KiB'>1048576</memory>", b"<memory unit='KiB'> </memory>"
    )
    assert refused(lv.libvirt_setmem, call(ctx), lv.LibvirtSetmem("vm1", 1))[0] == "bad-arguments"
    host.domains["vm1"] = THEIRS
    assert refused(lv.libvirt_setmem, call(ctx), lv.LibvirtSetmem("vm1", 1))[0] == "unmanaged"


# --- undefine --------------------------------------------------------------------------------------------


def test_undefine_drops_roots_staged_definition(ctx: HelperContext, root: Path, host: Host) -> None:
    lv.libvirt_define(call(ctx), lv.LibvirtDefine("vm1", NO_GPU_DEFINE))
    staged = root / STAGE / "vm1.xml"
    assert staged.exists()
    # A running or paused domain (libvirt's `id`) stays defined, and its staged copy stays (round 7).
    assert refused(lv.libvirt_undefine, call(ctx), lv.LibvirtName("vm1")) == (
        "domain-active",
        "libvirt.undefine: vm1 is running or paused: libvirt would keep it running as a transient domain "
        "whose taps root no longer records; destroy it first",
    )
    assert staged.exists() and virsh("undefine", "vm1") not in programs(ctx).runs
    host.domains["vm1"] = re.sub(rb" id='[0-9]+'", b"", NO_GPU_DUMP)  # shut off: libvirt gives no id
    assert lv.libvirt_undefine(call(ctx), req(lv.LibvirtName, name="vm1")) == {"name": "vm1"}
    assert not staged.exists() and programs(ctx).runs[-1] == virsh("undefine", "vm1")
    # nothing staged: the undefine still answers
    assert lv.libvirt_undefine(call(ctx), lv.LibvirtName("vm1")) == {"name": "vm1"}
    # libvirt refused: the staged copy stays
    lv.libvirt_define(call(ctx), lv.LibvirtDefine("vm1", NO_GPU_DEFINE))
    host.fail["undefine"] = (1, b"", b"error: Failed to undefine domain 'vm1'\n")
    assert failed(lv.libvirt_undefine, call(ctx), lv.LibvirtName("vm1")) == (
        "virsh",
        "virsh undefine vm1: error: Failed to undefine domain 'vm1'",
    )
    assert staged.exists()
    del host.fail["undefine"]
    os.chown(root / STAGE, NODE_UID, 0)
    reason, message = refused(lv.libvirt_undefine, call(ctx), lv.LibvirtName("vm1"))
    assert reason == "root-only" and "/var/lib/bcd-hostconfig/libvirt" in message


# --- the rebind disk -------------------------------------------------------------------------------------

REBIND = f"{INST}/rebind.img"


def rebind_xml(path: Path) -> bytes:
    """The disk `virsh attach-disk PATH vdz --targetbus virtio --driver qemu --subdriver raw --serial
    bc-rebind --live` makes (libvirt 9.0), with DAC relabelling off on its source, as root sends it."""
    return (
        b'<disk type="file" device="disk"><driver name="qemu" type="raw" />'
        + f'<source file="{path}"><seclabel model="dac" relabel="no" /></source>'.encode()
        + b'<target dev="vdz" bus="virtio" /><serial>bc-rebind</serial></disk>\n'
    )


def test_rebind_attaches_roots_own_path_target_and_serial_dlv_reb_09(
    ctx: HelperContext, root: Path, host: Host
) -> None:
    """DLV-REB-09: root builds the disk's path, target vdz and serial bc-rebind itself, and hot-adds it
    with attach-device (the device XML on stdin) so its source carries relabel='no'."""
    disk = root / REBIND.lstrip("/")
    disk.write_bytes(b"\0" * (1 << 20))
    assert lv.libvirt_attach_rebind(call(ctx, bounded=False), req(lv.LibvirtRebind, name="vm1")) == {
        "name": "vm1"
    }
    assert virsh_runs(ctx) == [("dumpxml", "vm1"), ("attach-device", "vm1", "/dev/stdin", "--live")]
    assert programs(ctx).inputs == [None, rebind_xml(disk)] and programs(ctx).timeouts == [120, 120]
    assert lv.rebind_device_xml(str(disk)) == rebind_xml(disk)
    host.fail["attach-device"] = (1, b"", b"error: Failed to attach device from /dev/stdin\n")
    assert failed(lv.libvirt_attach_rebind, call(ctx), lv.LibvirtRebind("vm1")) == (
        "virsh",
        "virsh attach-device vm1: error: Failed to attach device from /dev/stdin",
    )


def test_unrebind_detaches_vdz_live_dlv_reb_11(ctx: HelperContext, host: Host) -> None:
    """DLV-REB-11: `detach-disk vdz --live` of bcd's domain only."""
    assert lv.libvirt_detach_rebind(call(ctx), req(lv.LibvirtName, name="vm1")) == {"name": "vm1"}
    assert virsh_runs(ctx) == [("dumpxml", "vm1"), ("detach-disk", "vm1", "vdz", "--live")]
    host.fail["detach-disk"] = (1, b"", b"error: No disk found whose source path or target is vdz\n")
    assert failed(lv.libvirt_detach_rebind, call(ctx), lv.LibvirtName("vm1")) == (
        "virsh",
        "virsh detach-disk vm1: error: No disk found whose source path or target is vdz",
    )
    host.domains["vm1"] = THEIRS
    assert refused(lv.libvirt_detach_rebind, call(ctx), lv.LibvirtName("vm1"))[0] == "unmanaged"


def test_the_rebind_disk_is_checked_as_root(
    ctx: HelperContext, root: Path, host: Host, tmp_path: Path
) -> None:
    disk = root / REBIND.lstrip("/")
    assert refused(lv.libvirt_attach_rebind, call(ctx), lv.LibvirtRebind("vm1")) == (
        "no-rebind-disk",
        f"libvirt.rebind: {REBIND} does not exist",
    )
    rule = f"libvirt.rebind: {REBIND} must be a regular file of 1048576 bytes with one link"
    for size in ((1 << 20) - 1, (1 << 20) + 1):
        disk.write_bytes(b"\0" * size)
        assert refused(lv.libvirt_attach_rebind, call(ctx), lv.LibvirtRebind("vm1")) == ("rebind-disk", rule)
    disk.write_bytes(b"\0" * (1 << 20))
    os.link(disk, tmp_path / "second")
    assert refused(lv.libvirt_attach_rebind, call(ctx), lv.LibvirtRebind("vm1")) == ("rebind-disk", rule)
    os.unlink(tmp_path / "second")
    os.unlink(disk)
    disk.mkdir()
    assert refused(lv.libvirt_attach_rebind, call(ctx), lv.LibvirtRebind("vm1")) == ("rebind-disk", rule)
    disk.rmdir()
    (tmp_path / "r.img").write_bytes(b"\0" * (1 << 20))
    os.symlink(tmp_path / "r.img", disk)
    assert refused(lv.libvirt_attach_rebind, call(ctx), lv.LibvirtRebind("vm1")) == (
        "rebind-disk",
        f"libvirt.rebind: {REBIND}: a symlink on the way (rebind.img)",
    )
    # a symlink earlier on the way: the instance directory itself
    os.unlink(disk)
    inst = root / INST.lstrip("/")
    os.rename(inst, tmp_path / "vm1")
    os.symlink(tmp_path / "vm1", inst)
    assert refused(lv.libvirt_attach_rebind, call(ctx), lv.LibvirtRebind("vm1")) == (
        "rebind-disk",
        f"libvirt.rebind: {REBIND}: a symlink on the way (vm1)",
    )
    assert virsh_runs(ctx) == [("dumpxml", "vm1")] * 7
    host.domains["vm1"] = THEIRS
    assert refused(lv.libvirt_attach_rebind, call(ctx), lv.LibvirtRebind("vm1"))[0] == "unmanaged"


# --- restore ---------------------------------------------------------------------------------------------

STATE = f"{INST}/save.state"


def test_restore_without_a_definition_is_refused_dlv_hlp_08(ctx: HelperContext) -> None:
    """DLV-HLP-08: before anything runs."""
    assert refused(lv.libvirt_restore, call(ctx), req(lv.LibvirtRestore, name="vm1")) == (
        "no-definition",
        "libvirt.restore: a restore needs the domain's definition (never the state file's)",
    )
    assert programs(ctx).runs == []


def test_restore_stages_the_checked_definition_and_passes_xml_dlv_hlp_09_10(
    ctx: HelperContext, root: Path, host: Host
) -> None:
    """DLV-HLP-09, DLV-HLP-10: checked like a define and as the requested domain's, staged in root's
    directory (0600) and always given to `virsh restore` as --xml. The domain is defined (root's
    dumpxml): the staged definition carries the fdgroups, associated in the same virsh with root's
    descriptors of the checked disks; libvirtd reads the state through root's own descriptor."""
    state = root / STATE.lstrip("/")
    d = root / INST.lstrip("/")
    state.write_bytes(save_image(NO_GPU_DUMP))
    before = open_fds()
    got = lv.libvirt_restore(call(ctx, bounded=False), req(lv.LibvirtRestore, name="vm1", xml=NO_GPU_DEFINE))
    staged = root / STAGE / "vm1.xml"
    assert got == {"name": "vm1", "paused": False}
    assert c14n(staged.read_bytes()) == c14n(fd_form(NO_GPU_DEFINE))
    assert stat.S_IMODE(os.stat(staged).st_mode) == 0o600
    [(seen, ino, head)] = host.restored
    assert ino == os.stat(state).st_ino and head == save_image(NO_GPU_DUMP)[:92]
    assert re.fullmatch(f"/proc/{os.getpid()}/fd/[0-9]+", seen)
    handed = programs(ctx).handed[-1]
    files = [d / "disk.qcow2", root / BASE.lstrip("/"), d / "seed.iso"]
    assert [(h.path, h.inode, h.access, h.inheritable) for h in handed] == [
        (str(files[0]), inode(files[0]), os.O_RDWR, False),
        (str(files[1]), inode(files[1]), os.O_RDONLY, False),
        (str(files[2]), inode(files[2]), os.O_RDONLY, False),
    ]
    fds = [h.fd for h in handed]
    assert int(seen.rsplit("/", 1)[1]) not in fds  # libvirtd (root) opens it; QEMU is not handed it
    held = (("bcd0", fds[0], True), ("bcd1", fds[1], False), ("bcd2", fds[2], False))
    assert programs(ctx).runs == [
        virsh("dumpxml", "vm1"),
        associated(*held, command=f"restore {seen} --xml {staged}"),
    ]
    assert programs(ctx).timeouts == [120, 120] and open_fds() == before
    assert (
        lv.libvirt_restore(call(ctx), lv.LibvirtRestore("vm1", NO_GPU_DEFINE, paused=True))["paused"] is True
    )
    seen = host.restored[-1][0]
    fds = [h.fd for h in programs(ctx).handed[-1]]
    held = (("bcd0", fds[0], True), ("bcd1", fds[1], False), ("bcd2", fds[2], False))
    assert programs(ctx).runs[-1] == associated(*held, command=f"restore {seen} --xml {staged} --paused")
    other = NO_GPU_DEFINE.replace("<name>vm1</name>", "<name>vm2</name>")
    assert refused(lv.libvirt_restore, call(ctx), lv.LibvirtRestore("vm1", other)) == (
        "domain-name",
        "libvirt.restore: vm1: the domain is named 'vm2', not 'vm1'",
    )
    host.fail["restore"] = (1, b"", b"error: Failed to restore domain from x\n")
    assert failed(lv.libvirt_restore, call(ctx), lv.LibvirtRestore("vm1", NO_GPU_DEFINE)) == (
        "virsh",
        "virsh restore vm1: error: Failed to restore domain from x",
    )
    assert open_fds() == before


def test_restore_of_a_domain_libvirt_does_not_know_keeps_paths(
    ctx: HelperContext, root: Path, host: Host
) -> None:
    """Descriptors are associated with a defined domain only: a restore of a name libvirt does not know
    stages paths with relabelling off and runs virsh alone, handed nothing."""
    del host.domains["vm1"]
    state = root / STATE.lstrip("/")
    state.write_bytes(save_image())
    assert lv.libvirt_restore(call(ctx), lv.LibvirtRestore("vm1", NO_GPU_DEFINE))["name"] == "vm1"
    staged = root / STAGE / "vm1.xml"
    assert c14n(staged.read_bytes()) == c14n(fd_form(NO_GPU_DEFINE, groups=False))
    seen = host.restored[-1][0]
    assert programs(ctx).runs == [virsh("dumpxml", "vm1"), virsh("restore", seen, "--xml", str(staged))]
    assert programs(ctx).handed == [(), ()] and host.restored[-1][1] == os.stat(state).st_ino


def test_restore_for_another_driver_asks_no_dumpxml_and_keeps_paths(root: Path, host: Host) -> None:
    """libvirt's test driver refuses an fdgroup: no descriptor, so root need not ask whether the domain
    is defined."""
    uri = "test:///default"
    (root / STATE.lstrip("/")).write_bytes(save_image())
    c = context(root, CONFIG + f'libvirt_uri = "{uri}"\n', lambda argv: (0, b"", b""))
    try:
        assert lv.libvirt_restore(call(c), lv.LibvirtRestore("vm1", NO_GPU_DEFINE))["name"] == "vm1"
        staged = root / STAGE / "vm1.xml"
        assert c14n(staged.read_bytes()) == c14n(fd_form(NO_GPU_DEFINE, groups=False))
        [run] = programs(c).runs
        assert run[:4] == ("virsh", "-c", uri, "restore") and run[5:] == ("--xml", str(staged))
        assert re.fullmatch(f"/proc/{os.getpid()}/fd/[0-9]+", run[4]) and programs(c).handed == [()]
    finally:
        c.audit.close()


def test_restore_quotes_the_command_for_virshs_parser(tmp_path: Path) -> None:
    """The command after the associations is one line virsh parses shell-like: root's staged path with
    a space in it stays one argument."""
    (tmp_path / "a b").mkdir()
    r = make_root(tmp_path / "a b")
    lay_out(r)
    (r / STATE.lstrip("/")).write_bytes(save_image())
    host = Host(r)
    host.domains["vm1"] = FD_DUMP
    c = context(r, CONFIG, host)
    host.programs = programs(c)
    try:
        assert lv.libvirt_restore(call(c), lv.LibvirtRestore("vm1", NO_GPU_DEFINE))["name"] == "vm1"
        staged = str(r / STAGE / "vm1.xml")
        assert " " in staged and host.restored[-1][1] == os.stat(r / STATE.lstrip("/")).st_ino
        line = programs(c).runs[-1][3]
        assert line.endswith(f" ; restore {host.restored[-1][0]} --xml '{staged}'")
    finally:
        c.audit.close()


def test_restore_passes_gpus_through_only_when_free(ctx: HelperContext, root: Path, host: Host) -> None:
    """A restore passes its GPUs through as a start does: root's busy check first."""
    (root / STATE.lstrip("/")).write_bytes(save_image(DUMPXML))
    host.apps = f"{GPU0}, 31337\n".encode()
    assert refused(lv.libvirt_restore, call(ctx), lv.LibvirtRestore("vm1", DEFINE)) == (
        "gpu-busy",
        f"libvirt.restore: vm1: GPU 0000:18:00.0 cannot be passed through: {GPU0} runs compute process 31337",
    )
    host.apps = b""
    assert lv.libvirt_restore(call(ctx), lv.LibvirtRestore("vm1", DEFINE))["name"] == "vm1"


def test_restore_takes_only_the_instances_own_state_file(
    ctx: HelperContext, root: Path, tmp_path: Path
) -> None:
    state = root / STATE.lstrip("/")
    assert refused(lv.libvirt_restore, call(ctx), lv.LibvirtRestore("vm1", NO_GPU_DEFINE)) == (
        "no-state",
        f"libvirt.restore: {STATE} does not exist",
    )
    (tmp_path / "elsewhere").write_bytes(save_image())
    os.symlink(tmp_path / "elsewhere", state)
    assert refused(lv.libvirt_restore, call(ctx), lv.LibvirtRestore("vm1", NO_GPU_DEFINE)) == (
        "no-state",
        f"libvirt.restore: {STATE}: a symlink on the way (save.state)",
    )
    os.unlink(state)
    os.link(tmp_path / "elsewhere", state)
    rule = f"libvirt.restore: {STATE} must be a regular file with one link"
    assert refused(lv.libvirt_restore, call(ctx), lv.LibvirtRestore("vm1", NO_GPU_DEFINE)) == (
        "no-state",
        rule,
    )
    os.unlink(state)
    os.mkfifo(state)
    assert refused(lv.libvirt_restore, call(ctx), lv.LibvirtRestore("vm1", NO_GPU_DEFINE)) == (
        "no-state",
        rule,
    )
    assert programs(ctx).runs == [] and not (root / STAGE / "vm1.xml").exists()


@pytest.mark.parametrize(
    ("head", "ok"),
    [
        (save_image(version=1), True),
        (save_image(version=2, data_len=16 << 20)[:92], True),
        (save_image(data_len=1)[:92], True),
        (save_image()[:92], True),
        (save_image()[:91], False),
        (b"", False),
        (save_image(version=0), False),
        (save_image(version=3), False),
        (save_image(data_len=0), False),
        (save_image(data_len=(16 << 20) + 1)[:92], False),
        (b"LibvirtQemudPart" + save_image()[16:], False),  # libvirt's partial-save magic
        (b"QEVM" + b"\0" * 88, False),
    ],
)
def test_restore_reads_the_save_header_before_libvirtd(
    ctx: HelperContext, root: Path, head: bytes, ok: bool
) -> None:
    """Root refuses anything but libvirt's magic, version 1 or 2 and a data area of 1 byte to 16 MiB."""
    (root / STATE.lstrip("/")).write_bytes(head)
    if ok:
        assert lv.libvirt_restore(call(ctx), lv.LibvirtRestore("vm1", NO_GPU_DEFINE))["name"] == "vm1"
        return
    short = len(head) < 92
    message = f"libvirt.restore: {STATE} is not a libvirt save image " + (
        "(short header)" if short else "(magic, version 1 or 2, data at most 16 MiB)"
    )
    before = open_fds()
    assert refused(lv.libvirt_restore, call(ctx), lv.LibvirtRestore("vm1", NO_GPU_DEFINE)) == (
        "bad-state",
        message,
    )
    # only root's question whether the domain is defined ran; nothing staged, the state's descriptor closed
    assert virsh_runs(ctx) == [("dumpxml", "vm1")] and not (root / STAGE / "vm1.xml").exists()
    assert open_fds() == before


def test_the_state_is_opened_without_following_or_blocking(
    ctx: HelperContext, root: Path, tmp_path: Path
) -> None:
    """What the state file can be by the time root opens it (the node owns the directory): `_state_fd`
    opens it through the instance directory opened without links, never follows or blocks, and checks
    the descriptor; the header check reads only that descriptor."""
    state = root / STATE.lstrip("/")
    inst = root / INST.lstrip("/")
    open_state = lambda: lv._state_fd(call(ctx), "libvirt.restore", "vm1", "/x/save.state")  # noqa: E731
    before = open_fds()
    assert refused(open_state) == ("no-state", "libvirt.restore: /x/save.state: No such file or directory")
    (tmp_path / "img").write_bytes(save_image())
    os.symlink(tmp_path / "img", state)
    assert refused(open_state) == (
        "no-state",
        "libvirt.restore: /x/save.state: Too many levels of symbolic links",
    )
    os.unlink(state)
    rule = ("no-state", "libvirt.restore: /x/save.state must be a regular file with one link")
    os.link(tmp_path / "img", state)
    assert refused(open_state) == rule
    os.unlink(state)
    os.mkfifo(state)  # opened non-blocking, refused on the descriptor, never read
    assert refused(open_state) == rule
    os.unlink(state)
    os.rename(inst, tmp_path / "vm1")
    os.symlink(tmp_path / "vm1", inst)
    (tmp_path / "vm1/save.state").write_bytes(save_image())
    assert refused(open_state) == ("no-state", "libvirt.restore: /x/save.state: a symlink on the way")
    os.unlink(inst)
    os.rename(tmp_path / "vm1", inst)
    assert open_fds() == before  # every descriptor on the way closed
    fd = open_state()
    try:
        assert os.fstat(fd).st_ino == os.stat(state).st_ino and not os.get_inheritable(fd)
        assert os.read(fd, 16) == b"LibvirtQemudSave"
        lv._check_state_header("libvirt.restore", "/x/save.state", fd)  # read at offset 0 (pread)
    finally:
        os.close(fd)
    short = os.open(tmp_path / "img", os.O_RDWR)
    try:
        os.truncate(tmp_path / "img", 91)
        assert refused(lv._check_state_header, "libvirt.restore", "/x/save.state", short) == (
            "bad-state",
            "libvirt.restore: /x/save.state is not a libvirt save image (short header)",
        )
    finally:
        os.close(short)


def test_restore_refuses_a_state_or_disk_swapped_inside_roots_window(
    ctx: HelperContext, root: Path, host: Host, tmp_path: Path
) -> None:
    """Between root's lstat checks and its opens (here: while root asks libvirt whether the domain is
    defined) the node swaps the state file or a disk: root's open of it is refused, nothing is staged
    and libvirtd reads nothing."""
    state = root / STATE.lstrip("/")
    d = root / INST.lstrip("/")
    state.write_bytes(save_image())
    precious = tmp_path / "precious"
    precious.write_bytes(save_image())

    def swap(make: Callable[[], None]) -> Callable[[tuple[str, ...]], None]:
        def race(argv: tuple[str, ...]) -> None:
            if argv[3:] == ("dumpxml", "vm1"):
                make()

        return race

    def to_link() -> None:
        os.replace(state, tmp_path / "saved")
        os.symlink(precious, state)

    def to_hard_link() -> None:
        os.unlink(state)
        os.link(precious, state)

    cases = [
        (to_link, ("no-state", f"libvirt.restore: {STATE}: Too many levels of symbolic links")),
        (to_hard_link, ("no-state", f"libvirt.restore: {STATE} must be a regular file with one link")),
    ]
    before = open_fds()
    for make, want in cases:
        host.race = swap(make)
        assert refused(lv.libvirt_restore, call(ctx), lv.LibvirtRestore("vm1", NO_GPU_DEFINE)) == want
        os.unlink(state)
        state.write_bytes(save_image())

    def disk_to_link() -> None:
        os.replace(d / "disk.qcow2", tmp_path / "disk.qcow2")
        os.symlink(tmp_path / "disk.qcow2", d / "disk.qcow2")

    host.race = swap(disk_to_link)
    assert refused(lv.libvirt_restore, call(ctx), lv.LibvirtRestore("vm1", NO_GPU_DEFINE)) == (
        "domain-disk",
        f"libvirt.restore: vm1: '{INST}/disk.qcow2': Too many levels of symbolic links",
    )
    assert virsh_runs(ctx) == [("dumpxml", "vm1")] * 3 and host.restored == []
    assert not (root / STAGE / "vm1.xml").exists() and open_fds() == before


# --- save ------------------------------------------------------------------------------------------------


def test_save_hands_the_state_to_the_node(ctx: HelperContext, root: Path, host: Host) -> None:
    """libvirtd writes into root's directory; the node gets `save.state`, its own, 0640."""
    host.saved = save_image(NO_GPU_DUMP) + b"stream" * 1000
    got = lv.libvirt_save(call(ctx), req(lv.LibvirtSave, name="vm1"))
    staged = root / STAGE / "vm1.state"
    assert got == {"name": "vm1", "size_bytes": len(host.saved)}
    assert virsh_runs(ctx) == [("dumpxml", "vm1"), ("save", "vm1", str(staged))]
    state = root / STATE.lstrip("/")
    st = os.stat(state)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode), st.st_nlink) == (NODE_UID, NODE_GID, 0o640, 1)
    assert state.read_bytes() == host.saved and os.listdir(root / STAGE) == []
    # the file libvirtd writes the guest's memory into was root's alone (0600) before it did
    assert host.staged_mode == 0o600


def test_save_that_libvirt_fails_leaves_nothing(ctx: HelperContext, root: Path, host: Host) -> None:
    host.fail["save"] = (1, b"", b"error: Failed to save domain 'vm1' to x\n")
    assert failed(lv.libvirt_save, call(ctx), lv.LibvirtSave("vm1")) == (
        "virsh",
        "virsh save vm1: error: Failed to save domain 'vm1' to x",
    )
    assert os.listdir(root / STAGE) == [] and not (root / STATE.lstrip("/")).exists()


def test_save_into_a_staging_directory_not_roots_alone_is_refused(ctx: HelperContext, root: Path) -> None:
    stage = root / STAGE
    stage.mkdir(parents=True)
    os.chown(stage, NODE_UID, NODE_UID)
    reason, message = refused(lv.libvirt_save, call(ctx), lv.LibvirtSave("vm1"))
    assert reason == "root-only" and message.startswith("/var/lib/bcd-hostconfig/libvirt is not a directory")
    assert os.listdir(stage) == [] and virsh_runs(ctx) == [("dumpxml", "vm1")]


def test_save_replaces_a_name_and_never_writes_through_it(
    ctx: HelperContext, root: Path, tmp_path: Path
) -> None:
    target = tmp_path / "precious"
    target.write_bytes(b"keep")
    os.symlink(target, root / STATE.lstrip("/"))
    lv.libvirt_save(call(ctx), lv.LibvirtSave("vm1"))
    assert target.read_bytes() == b"keep"
    assert stat.S_ISREG(os.lstat(root / STATE.lstrip("/")).st_mode)
    # a directory in the way: the handover fails, answered, and root's staged file goes
    os.unlink(root / STATE.lstrip("/"))
    (root / STATE.lstrip("/")).mkdir()
    reason, message = failed(lv.libvirt_save, call(ctx), lv.LibvirtSave("vm1"))
    assert reason == "save-handover"
    assert (
        message
        == "libvirt.save: vm1: the state was not handed over: [Errno 21] Is a directory: "
        + repr(str(root / STAGE / "vm1.state"))
        + " -> 'save.state'"
    )
    assert os.listdir(root / STAGE) == []


def test_save_across_filesystems_copies_into_a_new_file(
    ctx: HelperContext, root: Path, host: Host, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Root's directory and the node's on different filesystems (EXDEV): a new file, the old name
    unlinked (a link is replaced, never followed), the node's, 0640, the bytes libvirtd wrote."""
    real_rename = os.rename

    def rename(src: Any, dst: Any, **kw: Any) -> None:
        if dst == "save.state":
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        real_rename(src, dst, **kw)

    monkeypatch.setattr(lv.os, "rename", rename)
    host.saved = save_image(NO_GPU_DUMP) + os.urandom(3 << 20)  # more than one 1 MiB chunk
    target = tmp_path / "precious"
    target.write_bytes(b"keep")
    state = root / STATE.lstrip("/")
    os.symlink(target, state)
    assert lv.libvirt_save(call(ctx), lv.LibvirtSave("vm1"))["size_bytes"] == len(host.saved)
    st = os.lstat(state)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode), stat.S_ISREG(st.st_mode)) == (
        NODE_UID,
        NODE_GID,
        0o640,
        True,
    )
    assert state.read_bytes() == host.saved and target.read_bytes() == b"keep"
    assert os.listdir(root / STAGE) == []
    # no old name: the copy is made all the same
    os.unlink(state)
    lv.libvirt_save(call(ctx), lv.LibvirtSave("vm1"))
    assert state.read_bytes() == host.saved

    def denied(src: Any, dst: Any, **kw: Any) -> None:
        if dst == "save.state":
            raise OSError(errno.EACCES, "Permission denied")
        real_rename(src, dst, **kw)

    monkeypatch.setattr(lv.os, "rename", denied)
    assert failed(lv.libvirt_save, call(ctx), lv.LibvirtSave("vm1")) == (
        "save-handover",
        "libvirt.save: vm1: the state was not handed over: [Errno 13] Permission denied",
    )
    assert os.listdir(root / STAGE) == []


def test_a_link_planted_after_the_unlink_is_never_written_through(
    ctx: HelperContext, root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Across filesystems the copy is a new file (O_CREAT|O_EXCL|O_NOFOLLOW): a link the node plants
    between root's unlink and its open fails the handover; its target is never written."""
    real_rename = os.rename

    def rename(src: Any, dst: Any, **kw: Any) -> None:
        if dst == "save.state":
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        real_rename(src, dst, **kw)

    real_unlink = os.unlink

    def unlink(path: Any, **kw: Any) -> None:
        if path != "save.state":  # the node's link comes back at once
            real_unlink(path, **kw)

    monkeypatch.setattr(lv.os, "rename", rename)
    monkeypatch.setattr(lv.os, "unlink", unlink)
    target = tmp_path / "precious"
    target.write_bytes(b"keep")
    os.symlink(target, root / STATE.lstrip("/"))
    assert failed(lv.libvirt_save, call(ctx), lv.LibvirtSave("vm1")) == (
        "save-handover",
        "libvirt.save: vm1: the state was not handed over: [Errno 17] File exists: 'save.state'",
    )
    assert target.read_bytes() == b"keep" and os.stat(target).st_uid == 0


@pytest.mark.parametrize(
    ("device", "reason", "message"),
    [
        (
            HOSTDEV_DUMP,
            "memory-snapshot-gpus",
            "libvirt.save: vm1: an instance with passthrough GPUs cannot be snapshotted with its memory; "
            "snapshot its disk only",
        ),
        (
            "<disk type='file' device='disk'><driver name='qemu' type='raw'/>"
            f"<source file='{DATA}/volumes/v1.raw'/>"
            "<target dev='vdb' bus='virtio'/></disk>",
            "memory-snapshot-volumes",
            "libvirt.save: vm1: ErrMemorySnapshotWithVolumes: an instance with a read-write volume cannot be "
            "snapshotted with its memory",
        ),
    ],
)
def test_no_memory_save_with_gpus_or_a_writable_volume_dlv_rt_13_14(
    ctx: HelperContext, root: Path, host: Host, device: str, reason: str, message: str
) -> None:
    """DLV-RT-13, DLV-RT-14 in root's own view of the domain: refused before libvirtd writes anything."""
    host.domains["vm1"] = NO_GPU_DUMP.replace(b"<devices>\n", b"<devices>\n" + device.encode(), 1)
    assert refused(lv.libvirt_save, call(ctx), lv.LibvirtSave("vm1")) == (reason, message)
    assert virsh_runs(ctx) == [("dumpxml", "vm1")] and not (root / STAGE).exists()


def test_a_read_only_volume_or_a_sourceless_drive_allows_a_memory_save(
    ctx: HelperContext, host: Host
) -> None:
    ro = (
        "<disk type='file' device='disk'><driver name='qemu' type='raw'/>"
        f"<source file='{DATA}/volumes/v1.raw'/>"
        "<target dev='vdb' bus='virtio'/><readonly/></disk><disk type='file' device='cdrom'>"
        "<driver name='qemu' type='raw'/><target dev='sdd' bus='sata'/><readonly/></disk>"
        "<disk type='block' device='disk'><driver name='qemu' type='raw'/><source dev='/dev/sdb'/>"
        "<target dev='vdc' bus='virtio'/></disk>"
    )
    host.domains["vm1"] = NO_GPU_DUMP.replace(b"<devices>\n", b"<devices>\n" + ro.encode(), 1)
    assert lv.libvirt_save(call(ctx), lv.LibvirtSave("vm1"))["name"] == "vm1"


def test_save_refuses_a_node_directory_swapped_for_a_symlink(
    ctx: HelperContext, root: Path, tmp_path: Path
) -> None:
    inst = root / INST.lstrip("/")
    os.rename(inst, tmp_path / "vm1")
    os.symlink(tmp_path / "vm1", inst)
    assert refused(lv.libvirt_save, call(ctx), lv.LibvirtSave("vm1")) == (
        "bad-path",
        f"{INST}: Not a directory at 'vm1' (no symlinks)",
    )
    assert not (tmp_path / "vm1/save.state").exists() and not (root / STAGE).exists()
    os.unlink(inst)
    assert refused(lv.libvirt_save, call(ctx), lv.LibvirtSave("vm1"))[1] == (
        f"{INST}: No such file or directory at 'vm1' (no symlinks)"
    )


def test_save_of_a_domain_not_bcds_or_missing(ctx: HelperContext, host: Host) -> None:
    host.domains["vm1"] = THEIRS
    assert refused(lv.libvirt_save, call(ctx), lv.LibvirtSave("vm1"))[0] == "unmanaged"
    assert refused(lv.libvirt_save, call(ctx), lv.LibvirtSave("vm2")) == (
        "no-domain",
        "libvirt.save: no domain vm2",
    )
    assert refused(lv.libvirt_save, call(ctx), lv.LibvirtSave("../x"))[0] == "bad-name"


def test_the_node_directory_is_opened_component_by_component(root: Path) -> None:
    c = context(root, CONFIG)
    try:
        fd = lv._node_dir_fd(call(c), INST)
        try:
            assert os.fstat(fd).st_ino == os.stat(root / INST.lstrip("/")).st_ino
        finally:
            os.close(fd)
        before = len(os.listdir("/proc/self/fd"))
        assert refused(lv._node_dir_fd, call(c), f"{INST}/nothing") == (
            "bad-path",
            f"{INST}/nothing: No such file or directory at 'nothing' (no symlinks)",
        )
        assert len(os.listdir("/proc/self/fd")) == before  # every descriptor on the way closed
    finally:
        c.audit.close()


# --- console ---------------------------------------------------------------------------------------------


def with_pty(xml: bytes, path: str = "/dev/pts/3", ident: str = "2") -> bytes:
    out = xml.replace(
        b"<serial type='pty'>\n", f"<serial type='pty'>\n      <source path='{path}'/>\n".encode()
    )
    return out.replace(b"id='2'", f"id='{ident}'".encode())


def test_console_hands_back_the_pty_as_a_descriptor_dlv_hlp_07(
    ctx: HelperContext, root: Path, host: Host
) -> None:
    """DLV-HLP-07: root opens the pty its own dumpxml names and hands back the descriptor."""
    pts = root / "dev/pts/3"
    pts.parent.mkdir(parents=True)
    pts.write_bytes(b"")
    host.domains["vm1"] = with_pty(NO_GPU_DUMP)
    got = lv.libvirt_console(call(ctx), req(lv.LibvirtName, name="vm1"))
    fd = got.pop("_fd")
    try:
        assert got == {"name": "vm1", "pty": "/dev/pts/3"}
        os.write(fd, b"hello")
        flags = __import__("fcntl").fcntl(fd, __import__("fcntl").F_GETFL)
        assert flags & os.O_ACCMODE == os.O_RDWR and os.get_inheritable(fd) is False
    finally:
        os.close(fd)
    assert pts.read_bytes() == b"hello"
    assert virsh_runs(ctx) == [("dumpxml", "vm1"), ("dumpxml", "vm1")]


@pytest.mark.parametrize(
    "path", [None, "", "/dev/pts/1234567", "/dev/ptmx", "/dev/pts/3x", "/etc/shadow", "/dev/pts/"]
)
def test_console_only_opens_a_dev_pts_number(ctx: HelperContext, host: Host, path: str | None) -> None:
    if path is None:  # a <source> without a path (another serial type's)
        host.domains["vm1"] = NO_GPU_DUMP.replace(b"<serial type='pty'>\n", b"<serial type='pty'>\n<source/>")
    else:
        host.domains["vm1"] = with_pty(NO_GPU_DUMP, path) if path else NO_GPU_DUMP
    assert failed(lv.libvirt_console, call(ctx), lv.LibvirtName("vm1")) == (
        "no-console",
        "libvirt.console: domain vm1 has no pty serial console (is it running?)",
    )


def test_console_of_a_pty_that_is_gone_or_a_link(
    ctx: HelperContext, root: Path, host: Host, tmp_path: Path
) -> None:
    host.domains["vm1"] = with_pty(NO_GPU_DUMP, "/dev/pts/123456")
    assert failed(lv.libvirt_console, call(ctx), lv.LibvirtName("vm1")) == (
        "no-console",
        "libvirt.console: /dev/pts/123456: No such file or directory",
    )
    (root / "dev/pts").mkdir(parents=True)
    (tmp_path / "tty").write_bytes(b"")
    os.symlink(tmp_path / "tty", root / "dev/pts/123456")
    assert failed(lv.libvirt_console, call(ctx), lv.LibvirtName("vm1"))[1] == (
        "libvirt.console: /dev/pts/123456: Too many levels of symbolic links"
    )


def test_console_that_changed_while_root_opened_it_is_closed(
    ctx: HelperContext, root: Path, host: Host
) -> None:
    """The kernel reuses pty numbers: root's view after the open must name the same pty on the same run."""
    (root / "dev/pts").mkdir(parents=True)
    (root / "dev/pts/3").write_bytes(b"")
    before = sorted(os.listdir("/proc/self/fd"))
    changed = "libvirt.console: domain vm1's console changed while root opened it"
    sourceless = NO_GPU_DUMP.replace(b"<serial type='pty'>\n", b"<serial type='pty'>\n<source/>")
    for again in (
        with_pty(NO_GPU_DUMP, "/dev/pts/4"),
        with_pty(NO_GPU_DUMP, ident="3"),
        NO_GPU_DUMP,
        sourceless,
    ):
        host.domains["vm1"] = [with_pty(NO_GPU_DUMP), again]
        assert failed(lv.libvirt_console, call(ctx), lv.LibvirtName("vm1")) == ("no-console", changed)
    host.domains["vm1"] = [with_pty(NO_GPU_DUMP), THEIRS]
    assert refused(lv.libvirt_console, call(ctx), lv.LibvirtName("vm1")) == (
        "unmanaged",
        "libvirt.console: domain vm1 is not bcd's: it is never changed",
    )
    assert sorted(os.listdir("/proc/self/fd")) == before
    host.domains["vm1"] = THEIRS
    assert refused(lv.libvirt_console, call(ctx), lv.LibvirtName("vm1"))[0] == "unmanaged"


# --- with command-signing roots --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def signer(cp: ControlPlane) -> Signer:
    return cp.command.leaf()


def signed_ctx(root: Path, host: Host, cp: ControlPlane, *, pin: bool = False) -> HelperContext:
    cp.write_record(root, NODE, cp.bundle(1))
    c = context(root, cp.config_lines(pin_roots=pin) + CONFIG, host)
    host.programs = programs(c)
    return c


def wire_vm(
    *,
    vcpus: int = 2,
    memory: int = GIB,
    nics: tuple[tuple[str, str], ...] = (("br0", MAC),),
    gpus: tuple[str, ...] = (),
    sha: str = SHA,
    state: int = 1,
    rebind: str = "",
    sized: bool = True,
    policy: int = 0,
    addresses: tuple[str, ...] = (),
    runtime: str = "libvirt-kvm",
) -> wire.InstanceSpec:
    return wire.InstanceSpec(
        id="vm1",
        allocation_id="a1",
        runtime=runtime,
        desired_state=wire.InstanceDesiredState(state),
        size=wire.InstanceSize(vcpus=vcpus, memory_bytes=memory, disk_bytes=10 * GIB) if sized else None,
        image=wire.ImageRef(url="https://images.example/x.qcow2", sha256=sha, format="qcow2")
        if sha
        else None,
        nics=[wire.Nic(bridge=b, mac=m, addresses=list(addresses)) for b, m in nics],
        network_policy=wire.NetworkPolicy(policy),
        gpu_uuids=list(gpus),
        identity_rebind_ref=rebind,
    )


def signed(
    signer: Signer, generation: int, *instances: wire.InstanceSpec, root: bytes | None = None
) -> SignedIntent:
    spec = wire.NodeSpec(instances=wire.InstancesSection(instances=list(instances)))
    body = bytes(
        wire.DesiredStateBody(node_id=NODE, generation=generation, spec_hash=f"h{generation}", full=spec)
    )
    doc = intent(signer, body, with_root=root)
    return SignedIntent(doc["body"], doc["signature"], tuple(doc["chain"]), None)


def generation(root: Path) -> int:
    return int(json.loads((root / "var/lib/bcd-hostconfig/helper-intent.json").read_text())["generation"])


def test_a_signed_define_is_compared_with_the_spec_field_by_field(
    root: Path, host: Host, cp: ControlPlane, signer: Signer
) -> None:
    """Root re-validates each define against the signed spec's instance (vCPUs, memory, NICs by bridge
    and MAC, GPUs by UUID as root's nvidia-smi names them, image digest); a refusal writes no state."""
    c = signed_ctx(root, host, cp)
    try:
        define = lambda xml, i: lv.libvirt_define(call(c), lv.LibvirtDefine("vm1", xml, i))  # noqa: E731
        assert refused(define, DEFINE, None) == (
            "intent-required",
            "libvirt.define: a signed spec is required (command-signing roots from join record)",
        )
        mismatch = "libvirt.define: vm1: the definition differs from the signed spec in "
        cases = [
            (wire_vm(vcpus=3, gpus=(GPU0,)), "vCPUs"),
            (wire_vm(memory=2 * GIB, gpus=(GPU0,)), "memory"),
            (wire_vm(nics=(("br0", "52:54:00:00:00:02"),), gpus=(GPU0,)), "NICs"),
            (wire_vm(nics=(("br1", MAC),), gpus=(GPU0,)), "NICs"),
            (wire_vm(nics=(), gpus=(GPU0,)), "NICs"),
            (wire_vm(gpus=(GPU1,)), "GPUs"),
            (wire_vm(gpus=()), "GPUs"),
            (wire_vm(gpus=(GPU0, GPU1)), "GPUs"),
            (wire_vm(sha="cd" * 32, gpus=(GPU0,)), "image"),
            (wire_vm(sha="", gpus=(GPU0,)), "image"),
            (wire_vm(sized=False, gpus=(GPU0,)), "vCPUs, memory"),
            (
                wire_vm(vcpus=1, memory=1, nics=(), gpus=(GPU1,), sha="cd" * 32),
                "vCPUs, memory, NICs, GPUs, image",
            ),
        ]
        for inst, fields in cases:
            assert refused(define, DEFINE, signed(signer, 5, inst)) == ("spec-mismatch", mismatch + fields)
        assert not (root / "var/lib/bcd-hostconfig/helper-intent.json").exists()
        assert refused(define, DEFINE, signed(signer, 5, wire_vm(gpus=(GPU0,), state=4)))[0] == "not-in-spec"
        assert not (root / STAGE).exists()
        got = define(DEFINE, signed(signer, 5, wire_vm(gpus=(GPU0,))))
        assert got["name"] == "vm1" and generation(root) == 5
        assert [r for r in programs(c).runs if r[0] == "nvidia-smi"][-2:] == [BUS, UUID_BUS]
        # no image in either (an install from nothing bcd downloaded): equal
        imageless = NO_GPU_DEFINE.replace(f"      <bcd:image>{SHA}</bcd:image>\n", "")
        assert imageless != NO_GPU_DEFINE
        assert define(imageless, signed(signer, 5, wire_vm(sha="")))["name"] == "vm1"
        assert refused(define, imageless, signed(signer, 5, wire_vm()))[1] == mismatch + "image"
        # no GPU in either: nvidia-smi is not asked for UUIDs
        runs = len(programs(c).runs)
        define(NO_GPU_DEFINE, signed(signer, 6, wire_vm()))
        assert UUID_BUS not in programs(c).runs[runs:] and generation(root) == 6
    finally:
        c.audit.close()


def test_gpu_uuids_at_names_each_address_by_roots_nvidia_smi(ctx: HelperContext, host: Host) -> None:
    assert lv.gpu_uuids_at(call(ctx), ()) == [] and programs(ctx).runs == []
    got = lv.gpu_uuids_at(call(ctx, bounded=False), ("0000:db:00.0", "0000:2a:00.0", "0000:99:00.0"))
    assert got == sorted([GPUS[7][1], GPU1, "(no GPU at 0000:99:00.0)"])
    assert programs(ctx).runs == [UUID_BUS] and programs(ctx).timeouts == [60]
    # older drivers print a 4-digit PCI domain; a byte that is not UTF-8 is no GPU
    c = context(ctx.root, "", lambda argv: (0, f"{GPU0}, 0000:18:00.0\n\xff, x\n".encode("latin-1"), b""))
    try:
        assert lv.gpu_uuids_at(call(c), ("0000:18:00.0",)) == [GPU0]
    finally:
        c.audit.close()
    host.smi_rc = 6
    assert failed(lv.gpu_uuids_at, call(ctx), ("0000:18:00.0",)) == (
        "nvidia-smi",
        f"cannot list GPUs: nvidia-smi exited 6: {NO_DRIVER}",
    )


def test_roots_running_view_is_read_for_the_comparison(ctx: HelperContext) -> None:
    got = lv._checked_running(call(ctx), "libvirt.start", "vm1", DUMPXML)
    assert (got.name, got.type, got.vcpus, got.memory_bytes, got.disks) == ("vm1", "kvm", 2, GIB, ())
    assert got.nics == (("br0", MAC, ""),) and got.hostdevs == ("0000:18:00.0",)
    assert got.metadata == {
        "runtime": "libvirt-kvm",
        "allocation": "a1",
        "definition": "cc1c30a2022475bbf52d9cf337de868b3c5ca2d25fbde477f748270a28934924",
        "image": SHA,
        "image-format": "qcow2",
        "base-format": "qcow2",
    }
    odd = (
        b"<domain><vcpu> 3 </vcpu><memory>4</memory><devices><interface type='bridge'/>"
        b"<interface type='network'><source network='default'/><mac/></interface>"
        b"<hostdev><source><address domain='0x0' bus='0xzz' slot='0' function='0'/></source></hostdev>"
        b"<hostdev><source><address domain='0x0' bus='0x18' slot='0x0'/></source></hostdev>"
        b"<hostdev><source><address domain='0x1' bus='0xab' slot='0xc' function='0x4'/></source></hostdev>"
        b"</devices><metadata><bcd:instance xmlns:bcd='https://better-compute.dev/libvirt/1'><bcd:image/>"
        b"</bcd:instance></metadata></domain>"
    )
    got = lv._checked_running(call(ctx), "libvirt.start", "x", odd)
    assert (got.type, got.vcpus, got.memory_bytes) == ("", 3, 4096)
    assert got.nics == (("", "", ""), ("", "", ""))
    assert got.hostdevs == ("", "", "0001:ab:0c.4") and got.metadata == {"image": ""}
    for xml in (b"<domain/>", b"<domain><vcpu> </vcpu><memory> </memory></domain>"):
        empty = lv._checked_running(call(ctx), "libvirt.start", "x", xml)
        assert (empty.vcpus, empty.memory_bytes, empty.hostdevs, empty.nics) == (0, 0, (), ())


def test_a_signed_start_compares_roots_running_definition(
    root: Path, host: Host, cp: ControlPlane, signer: Signer
) -> None:
    """Root re-validates each start against the signed spec, on libvirt's own view of the domain."""
    host.domains["vm1"] = DUMPXML
    c = signed_ctx(root, host, cp)
    try:
        start = lambda i: lv.libvirt_start(call(c), lv.LibvirtStart("vm1", intent=i))  # noqa: E731
        assert refused(start, None)[0] == "intent-required"
        assert refused(start, signed(signer, 3, wire_vm(vcpus=4, gpus=(GPU0,)))) == (
            "spec-mismatch",
            "libvirt.start: vm1: the definition differs from the signed spec in vCPUs",
        )
        assert refused(start, signed(signer, 3, wire_vm(gpus=(GPU1,))))[1].endswith(" in GPUs")
        # round 6b: a start only of an instance the spec wants RUNNING or PAUSED
        assert refused(start, signed(signer, 3, wire_vm(gpus=(GPU0,), state=3))) == (
            "instance-stopped",
            "libvirt.start: vm1: the signed spec (generation 3) wants it STOPPED: root starts only an "
            "instance it wants RUNNING or PAUSED",
        )
        assert virsh_runs(c)[-1] == ("dumpxml", "vm1")
        assert start(signed(signer, 3, wire_vm(gpus=(GPU0,)))) == {"name": "vm1", "paused": False}
        assert generation(root) == 3 and virsh_runs(c)[-1] == ("start", "vm1")
    finally:
        c.audit.close()


def test_a_signed_start_with_pinned_roots_is_compared_too(
    root: Path, host: Host, cp: ControlPlane, signer: Signer
) -> None:
    host.domains["vm1"] = DUMPXML
    c = signed_ctx(root, host, cp, pin=True)
    try:
        i = signed(signer, 4, wire_vm(memory=GIB // 2, gpus=(GPU0,)), root=cp.command.root)
        assert refused(lv.libvirt_start, call(c), lv.LibvirtStart("vm1", intent=i))[1].endswith(" in memory")
    finally:
        c.audit.close()


def test_a_signed_restore_and_save_are_checked_against_the_spec(
    root: Path, host: Host, cp: ControlPlane, signer: Signer
) -> None:
    c = signed_ctx(root, host, cp)
    try:
        (root / STATE.lstrip("/")).write_bytes(save_image())
        restore = lambda i: lv.libvirt_restore(call(c), lv.LibvirtRestore("vm1", NO_GPU_DEFINE, i))  # noqa: E731
        assert refused(restore, None)[0] == "intent-required"
        assert refused(restore, signed(signer, 2, wire_vm(vcpus=9)))[1] == (
            "libvirt.restore: vm1: the definition differs from the signed spec in vCPUs"
        )
        assert refused(restore, signed(signer, 2, wire_vm(state=3)))[0] == "instance-stopped"  # round 6b
        assert restore(signed(signer, 2, wire_vm()))["name"] == "vm1" and generation(root) == 2
        save = lambda i: lv.libvirt_save(call(c), lv.LibvirtSave("vm1", i))  # noqa: E731
        assert refused(save, None) == (
            "intent-required",
            "libvirt.save: a signed spec is required (command-signing roots from join record)",
        )
        assert refused(save, signed(signer, 3, wire_vm(state=4)))[0] == "not-in-spec"
        assert virsh_runs(c)[-1] == ("dumpxml", "vm1") and not (root / STAGE / "vm1.state").exists()
        # a save compares no definition (the domain runs as defined): any spec naming the instance
        assert save(signed(signer, 3, wire_vm(vcpus=9)))["name"] == "vm1" and generation(root) == 3
        assert save(signed(signer, 4, wire_vm(state=3)))["name"] == "vm1"  # a save runs nothing: STOPPED too
    finally:
        c.audit.close()


def test_a_signed_rebind_needs_the_spec_to_ask_for_one(
    root: Path, host: Host, cp: ControlPlane, signer: Signer
) -> None:
    """With roots the signed spec must ask this instance for an identity rebind; the state is written
    only once the disk passed root's checks."""
    (root / REBIND.lstrip("/")).write_bytes(b"\0" * (1 << 20))
    c = signed_ctx(root, host, cp)
    try:
        rebind = lambda i: lv.libvirt_attach_rebind(call(c), lv.LibvirtRebind("vm1", i))  # noqa: E731
        assert refused(rebind, None) == (
            "intent-required",
            "libvirt.rebind: a signed spec is required (command-signing roots from join record)",
        )
        assert refused(rebind, signed(signer, 2, wire_vm())) == (
            "spec-mismatch",
            "libvirt.rebind: vm1: the signed spec asks no identity rebind of it",
        )
        assert programs(c).runs == []
        os.unlink(root / REBIND.lstrip("/"))
        assert refused(rebind, signed(signer, 2, wire_vm(rebind="r1")))[0] == "no-rebind-disk"
        assert not (root / "var/lib/bcd-hostconfig/helper-intent.json").exists()
        (root / REBIND.lstrip("/")).write_bytes(b"\0" * (1 << 20))
        assert rebind(signed(signer, 2, wire_vm(rebind="r1"))) == {"name": "vm1"}
        assert generation(root) == 2
        assert virsh_runs(c)[-1] == ("attach-device", "vm1", "/dev/stdin", "--live")
        assert programs(c).inputs[-1] == rebind_xml(root / REBIND.lstrip("/"))
    finally:
        c.audit.close()


def test_round7_a_start_or_restore_runs_unpaused_only_what_the_spec_wants_running(
    root: Path, host: Host, cp: ControlPlane, signer: Signer
) -> None:
    """Round 7 (docs/helper.md): with roots, a start or a restore not asked `--paused` needs a spec that
    wants the instance RUNNING (`instance-not-running`, naming the state and the generation): a node
    cannot destroy a guest the control plane paused and start it again running. Asked paused, a PAUSED
    spec is taken and virsh gets `--paused`. A refusal runs no verb and writes no state."""
    host.domains["vm1"] = DUMPXML
    c = signed_ctx(root, host, cp)
    try:
        vm = lambda state: wire_vm(gpus=(GPU0,), state=state)  # noqa: E731
        start = lambda i, p=False: lv.libvirt_start(call(c), lv.LibvirtStart("vm1", p, i))  # noqa: E731
        assert refused(start, signed(signer, 3, vm(2))) == (
            "instance-not-running",
            "libvirt.start: vm1: paused: the signed spec (generation 3) wants it PAUSED: root starts it "
            "only paused",
        )
        assert virsh_runs(c)[-1] == ("dumpxml", "vm1")
        assert not (root / "var/lib/bcd-hostconfig/helper-intent.json").exists()
        assert start(signed(signer, 3, vm(2)), True) == {"name": "vm1", "paused": True}
        assert generation(root) == 3 and virsh_runs(c)[-1] == ("start", "vm1", "--paused")
        assert start(signed(signer, 4, vm(1))) == {"name": "vm1", "paused": False}
        assert generation(root) == 4 and virsh_runs(c)[-1] == ("start", "vm1")

        (root / STATE.lstrip("/")).write_bytes(save_image())
        restore = lambda i, p=False: lv.libvirt_restore(  # noqa: E731
            call(c), lv.LibvirtRestore("vm1", NO_GPU_DEFINE, i, p)
        )
        assert refused(restore, signed(signer, 5, wire_vm(state=2))) == (
            "instance-not-running",
            "libvirt.restore: vm1: paused: the signed spec (generation 5) wants it PAUSED: root starts it "
            "only paused",
        )
        assert generation(root) == 4 and virsh_runs(c)[-1] == ("start", "vm1")
        assert restore(signed(signer, 5, wire_vm(state=2)), True) == {"name": "vm1", "paused": True}
        assert generation(root) == 5 and virsh_runs(c)[-1][-1].endswith(" --paused")
    finally:
        c.audit.close()


def test_round7_a_resume_runs_only_what_the_spec_wants_running_its_generation_written_first(
    root: Path, host: Host, cp: ControlPlane, signer: Signer
) -> None:
    """Round 7: with roots a resume needs a spec that wants the instance RUNNING under libvirt-kvm; the
    generation it acted on is root's floor before virsh runs (a resume virsh then fails still wrote it,
    and an older spec is refused after it)."""
    c = signed_ctx(root, host, cp)
    try:
        resume = lambda i: lv.libvirt_resume(call(c), lv.LibvirtResume("vm1", i))  # noqa: E731
        assert refused(resume, None) == (
            "intent-required",
            "libvirt.resume: a signed spec is required (command-signing roots from join record)",
        )
        assert refused(resume, signed(signer, 3, wire_vm(state=2))) == (
            "instance-not-running",
            "libvirt.resume: vm1: the signed spec (generation 3) wants it PAUSED: root resumes only an "
            "instance it wants RUNNING",
        )
        assert refused(resume, signed(signer, 3, wire_vm(runtime="cloud-hypervisor"))) == (
            "spec-mismatch",
            "libvirt.resume: vm1: the signed spec (generation 3) runs it under 'cloud-hypervisor', not "
            "libvirt-kvm",
        )
        assert ("resume", "vm1") not in virsh_runs(c)
        assert not (root / "var/lib/bcd-hostconfig/helper-intent.json").exists()
        host.fail["resume"] = (1, b"", b"error: domain is not paused\n")
        assert failed(resume, signed(signer, 6, wire_vm())) == (
            "virsh",
            "virsh resume vm1: error: domain is not paused",
        )
        assert generation(root) == 6  # written before the effect
        del host.fail["resume"]
        assert refused(resume, signed(signer, 5, wire_vm()))[0] == "stale-generation"
        assert resume(signed(signer, 7, wire_vm())) == {"name": "vm1"}
        assert generation(root) == 7 and virsh_runs(c)[-1] == ("resume", "vm1")
    finally:
        c.audit.close()


def test_round7_libvirt_ops_take_only_an_instance_the_spec_runs_under_libvirt_kvm(
    root: Path, host: Host, cp: ControlPlane, signer: Signer
) -> None:
    """Round 7: with roots, define, start, restore and rebind take only an instance the signed spec runs
    under libvirt-kvm (`spec-mismatch`, naming the spec's runtime): a cloud-hypervisor instance is never
    also defined or run under libvirt, a second guest of one instance with the same tap names."""
    host.domains["vm1"] = DUMPXML
    (root / STATE.lstrip("/")).write_bytes(save_image())
    (root / REBIND.lstrip("/")).write_bytes(b"\0" * (1 << 20))
    c = signed_ctx(root, host, cp)
    try:
        other = lambda **k: signed(signer, 3, wire_vm(runtime="cloud-hypervisor", **k))  # noqa: E731
        for op, handler, request in (
            ("define", lv.libvirt_define, lv.LibvirtDefine("vm1", DEFINE, other(gpus=(GPU0,)))),
            ("start", lv.libvirt_start, lv.LibvirtStart("vm1", True, other(gpus=(GPU0,)))),
            ("restore", lv.libvirt_restore, lv.LibvirtRestore("vm1", NO_GPU_DEFINE, other(), True)),
            ("rebind", lv.libvirt_attach_rebind, lv.LibvirtRebind("vm1", other(rebind="r1"))),
        ):
            assert refused(handler, call(c), request) == (
                "spec-mismatch",
                f"libvirt.{op}: vm1: the signed spec (generation 3) runs it under 'cloud-hypervisor', not "
                "libvirt-kvm",
            ), op
        assert [r[0] for r in virsh_runs(c)] == ["dumpxml"] * len(virsh_runs(c))
        assert not (root / "var/lib/bcd-hostconfig/helper-intent.json").exists()
    finally:
        c.audit.close()


def test_a_guarded_guest_runs_only_with_its_signed_rules_loaded(
    root: Path, host: Host, cp: ControlPlane, signer: Signer
) -> None:
    """With roots, `start` and `restore` of an instance the signed spec guards (PRIVATE here) are refused
    `network-policy` until root's last nft.apply holds its NIC's policy; nothing runs and no state is
    written before. A define or a save (nothing runs) never asks for the rules."""
    from bcd_shared.netpolicy import NicPolicy

    (root / STATE.lstrip("/")).write_bytes(save_image())
    host.domains["vm1"] = FD_DUMP
    c = signed_ctx(root, host, cp)
    try:
        private = wire_vm(policy=2, addresses=("10.0.0.5/24",))
        start = lambda g: lv.libvirt_start(call(c), lv.LibvirtStart("vm1", intent=signed(signer, g, private)))  # noqa: E731
        restore = lambda g: lv.libvirt_restore(  # noqa: E731
            call(c), lv.LibvirtRestore("vm1", NO_GPU_DEFINE, signed(signer, g, private))
        )
        for op, fn in (("libvirt.start", start), ("libvirt.restore", restore)):
            assert refused(fn, 2) == (
                "network-policy",
                f"{op}: vm1: the signed spec's network rules for it are not loaded: nft.apply first",
            )
        assert virsh_runs(c) == [("dumpxml", "vm1")] and host.restored == []
        assert not (root / "var/lib/bcd-hostconfig/helper-intent.json").exists()
        assert not (root / STAGE).exists()
        # a define and a save of the same instance run no guest: no rules asked
        define = lv.LibvirtDefine("vm1", NO_GPU_DEFINE, signed(signer, 2, private))
        assert lv.libvirt_define(call(c), define)["name"] == "vm1" and generation(root) == 2
        assert lv.libvirt_save(call(c), lv.LibvirtSave("vm1", signed(signer, 3, private)))["name"] == "vm1"
        (root / STATE.lstrip("/")).write_bytes(save_image())
        # other rules loaded: still refused
        c.nft_loaded = frozenset([NicPolicy("vm1", 0, "br0", MAC, ("10.0.0.6/24",), "PRIVATE")])
        assert refused(start, 4)[0] == "network-policy"
        c.nft_loaded = frozenset([NicPolicy("vm1", 0, "br0", MAC, ("10.0.0.5/24",), "PRIVATE")])
        assert start(4) == {"name": "vm1", "paused": False} and generation(root) == 4
        assert restore(5) == {"name": "vm1", "paused": False} and generation(root) == 5
        assert virsh_runs(c)[-1][0].endswith(
            f" ; restore {host.restored[-1][0]} --xml {root / STAGE / 'vm1.xml'}"
        )
    finally:
        c.audit.close()


def test_a_host_whose_root_config_turns_guest_network_rules_off_starts_a_guarded_guest_without_them(
    root: Path, host: Host, cp: ControlPlane, signer: Signer
) -> None:
    """`[helper] guest_network_rules = false` (what `bcd sim` writes: its simulated host has no nftables)
    lets a guarded guest start with no rules loaded; the default (on) refuses it, as above."""
    import attrs

    host.domains["vm1"] = FD_DUMP
    c = signed_ctx(root, host, cp)
    try:
        private = wire_vm(policy=2, addresses=("10.0.0.5/24",))
        assert c.config.guest_network_rules is True
        with pytest.raises(Refused):
            lv.libvirt_start(call(c), lv.LibvirtStart("vm1", intent=signed(signer, 2, private)))
        c.config = attrs.evolve(c.config, guest_network_rules=False)
        got = lv.libvirt_start(call(c), lv.LibvirtStart("vm1", intent=signed(signer, 3, private)))
        assert got == {"name": "vm1", "paused": False} and generation(root) == 3
    finally:
        c.audit.close()


def test_round8_roots_read_must_be_the_domain_of_that_name_exactly() -> None:
    """virsh reads a domain argument as an id or UUID first: root's read (`dumpxml`) must name the domain
    it asked for, exactly (' vm1 ' is another domain), or the op is `bad-name` naming what virsh found
    (red team round 8); a read that is not XML is left to the op's own checks."""
    tail = ": root acts only on the domain of that name (try again once that domain stops)"
    cases = [
        (b"<domain><name>other</name></domain>", "7", "'other'"),
        (b"<domain><name> vm1 </name></domain>", "vm1", "' vm1 '"),
        (b"<domain/>", "vm1", "''"),
        (b"<domain><name>" + b"o" * 100 + b"</name></domain>", "vm1", repr("o" * 80)),
    ]
    for xml, name, found in cases:
        with pytest.raises(Refused) as exc:
            lv._same_name("libvirt.start", name, xml)
        assert (exc.value.reason, exc.value.message) == (
            "bad-name",
            f"libvirt.start: name: virsh reads {name!r} as the id or UUID of domain {found}{tail}",
        )
    lv._same_name("libvirt.start", "vm1", b"<domain><name>vm1</name></domain>")
    lv._same_name("libvirt.start", "vm1", b"not xml")
