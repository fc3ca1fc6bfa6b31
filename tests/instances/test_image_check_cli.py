"""`bcd image check FILE [--json]` on real qemu-img images of every hostile variant, built here; and no
file an image header names is ever opened, neither by bcd's own check nor by the qemu-img commands the
libvirt-kvm runtime runs (strace -f on the real commands).

Every qemu-img the runtime runs goes through a PATH shim that records its argv and runs the real
qemu-img under `strace -f -e trace=open,openat`; the argv shows the format is always stated (`-f`, or a
`json:` name with its `driver`, which qemu-img never probes) and `backing` is null where the file has one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from attrs import evolve
from bcd_agent import cli
from bcd_agent.sections.instances.model import Image, InstanceSpec
from bcd_agent.sections.instances.runtimes.base import Prepared
from bcd_agent.sections.instances.runtimes.libvirt import LibvirtRuntime
from bcd_shared.errors import TerminalError
from bcd_shared.system import CommandResult, LocalSystem
from testsupport import REPO, qemu_img_create, require_tool

GIB = 1 << 30
DATA = "/var/lib/bcd"


def _img(tmp: Path, name: str, *opts: str, size: int = GIB, fmt: str = "qcow2") -> Path:
    return qemu_img_create(tmp / name, size, *opts, fmt=fmt)


def _check(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, object]]:
    try:
        rc = cli.main(["image", "check", *args, "--json"])
    except SystemExit as exc:
        rc = int(exc.code or 0)
    out = capsys.readouterr().out
    return rc, json.loads(out) if out.strip() else {}


def _variants(tmp: Path) -> dict[str, tuple[Path, str]]:
    """name -> (a real image built by qemu-img, possibly patched where qemu-img cannot write it, reason)."""
    trap = tmp / "trap.raw"
    trap.write_bytes(b"trap")
    good = _img(tmp, "good.qcow2").read_bytes()
    out: dict[str, tuple[Path, str]] = {}
    out["backing"] = (_img(tmp, "backing.qcow2", "-u", "-b", str(trap), "-F", "raw"), "backing-file")
    out["data-file"] = (_img(tmp, "df.qcow2", "-o", f"data_file={tmp / 'data.raw'}"), "data-file")
    out["luks"] = (
        _img(
            tmp,
            "luks.qcow2",
            "--object",
            "secret,id=s0,data=x",
            "-o",
            "encrypt.format=luks,encrypt.key-secret=s0",
        ),
        "encrypted",
    )
    bit = bytearray(good)
    struct.pack_into(">Q", bit, 72, 1 << 7)  # an incompatible bit qcow2 does not define
    (tmp / "bit.qcow2").write_bytes(bytes(bit))
    out["unknown-bit"] = (tmp / "bit.qcow2", "unknown-feature")
    out["v1"] = (_img(tmp, "v1.qcow", fmt="qcow"), "not-qcow2")  # qemu's qcow (v1): same magic, version 1
    v4 = bytearray(good)
    struct.pack_into(">I", v4, 4, 4)
    (tmp / "v4.qcow2").write_bytes(bytes(v4))
    out["v4"] = (tmp / "v4.qcow2", "not-qcow2")
    (tmp / "short.qcow2").write_bytes(good[:100])
    out["truncated"] = (tmp / "short.qcow2", "truncated")
    out["oversized"] = (_img(tmp, "big.qcow2", size=(64 << 40) + 512), "too-large")
    return out


def test_every_hostile_variant_is_refused_with_exit_1_dlv_img_04_05_06_07_08_20(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """DLV-IMG-04, DLV-IMG-05, DLV-IMG-06, DLV-IMG-07, DLV-IMG-08, DLV-IMG-20: each variant, a real
    qemu-img image (patched only where qemu-img cannot write the variant), is REFUSED (exit 1) with its
    reason; the format and virtual size are what the header states."""
    for name, (path, reason) in _variants(tmp_path).items():
        rc, out = _check(capsys, str(path))
        assert rc == 1, (name, out)
        assert out["verdict"] == "refused" and out["reason"] == reason, (name, out)
        assert str(path) in str(out["message"])
    rc, out = _check(capsys, str(tmp_path / "big.qcow2"))
    assert out["format"] == "qcow2" and out["version"] == 3 and out["virtual_size"] == (64 << 40) + 512
    assert "above the cap" in str(out["message"])
    # the same image under a larger cap is accepted: the cap, not the image, refused it
    rc, out = _check(capsys, str(tmp_path / "big.qcow2"), "--max-virtual-size", str(1 << 50))
    assert rc == 0 and out["verdict"] == "accepted"


def test_flat_images_are_accepted_with_format_and_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """DLV-IMG-04 (accepted half): qcow2 v3 and v2 (compat=0.10), with their virtual size."""
    rc, out = _check(capsys, str(_img(tmp_path, "v3.qcow2", size=3 * GIB)))
    assert (rc, out["verdict"], out["format"], out["version"], out["virtual_size"]) == (
        0, "accepted", "qcow2", 3, 3 * GIB,
    )  # fmt: skip
    assert out["reason"] is None
    rc, out = _check(capsys, str(_img(tmp_path, "v2.qcow2", "-o", "compat=0.10")))
    assert (rc, out["version"]) == (0, 2)
    rc, out = _check(capsys, str(_img(tmp_path, "raw.img", fmt="raw")))
    assert (rc, out["verdict"], out["format"], out["reason"]) == (1, "refused", None, "not-qcow2")


def test_text_output_and_usage_errors_exit_2(tmp_path: Path) -> None:
    """A real `bcd image check` process: the text verdict, and 2 for usage errors (issue 10's codes)."""
    env = {"PATH": "/usr/bin:/bin", "BCD_CONFIG": "/nonexistent/bcd-config.toml"}

    def bcd(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "bcd_agent.cli", *args],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )

    trap = tmp_path / "trap.raw"
    img = _img(tmp_path, "b.qcow2", "-u", "-b", str(trap), "-F", "raw")
    res = bcd("image", "check", str(img))
    assert res.returncode == 1, res.stderr
    assert (
        "REFUSED" in res.stdout
        and "reason:       backing-file" in res.stdout
        and "format:       qcow2 v3" in res.stdout
    )
    res = bcd("image", "check", str(_img(tmp_path, "ok.qcow2")))
    assert res.returncode == 0 and "accepted" in res.stdout and f"{GIB} bytes" in res.stdout
    for argv in (
        ["image"],
        ["image", "check"],
        ["image", "check", str(img), "--bogus"],
        ["image", "frobnicate", str(img)],
        ["image", "check", str(img), "--max-virtual-size", "-1"],
        ["image", "check", str(tmp_path / "missing.qcow2")],
    ):
        res = bcd(*argv)
        assert res.returncode == 2, (argv, res.stdout, res.stderr)
        assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr, (argv, res.stderr)
        assert res.stdout == ""
    # a symlink is refused as such (the check opens with O_NOFOLLOW), not followed
    (tmp_path / "link.qcow2").symlink_to(img)
    res = bcd("image", "check", str(tmp_path / "link.qcow2"), "--json")
    assert res.returncode == 1 and json.loads(res.stdout)["reason"] == "not-regular"


def _opened(strace_log: str) -> list[str]:
    return [line for line in strace_log.splitlines() if "open" in line]


def test_bcds_check_opens_no_file_a_header_names_dlv_img_01(tmp_path: Path) -> None:
    """DLV-IMG-01: `bcd image check` (the runtime's check, bcd_shared.images) under strace -f: an image
    naming a trap as its backing file, and one naming a trap as its data file, are refused, the trap is
    never opened, and no other program runs (no qemu-img info: the only execve is Python's own)."""
    strace = require_tool("strace")
    trap = tmp_path / "trap-target.raw"
    trap.write_bytes(b"\0" * 4096)
    backing = _img(tmp_path, "bk.qcow2", "-u", "-b", str(trap), "-F", "raw")
    datafile = _img(tmp_path, "df.qcow2", "-o", f"data_file={trap},data_file_raw=on")
    env = {"PATH": "/usr/bin:/bin", "BCD_CONFIG": "/nonexistent/bcd-config.toml"}
    for img, reason in ((backing, "backing-file"), (datafile, "data-file")):
        log = tmp_path / f"{img.name}.strace"
        res = subprocess.run(
            [strace, "-f", "-qq", "-o", str(log), "-e", "trace=open,openat,execve",
             sys.executable, "-m", "bcd_agent.cli", "image", "check", str(img), "--json"],
            capture_output=True, text=True, env=env, check=False,
        )  # fmt: skip
        assert res.returncode == 1 and json.loads(res.stdout)["reason"] == reason, res.stderr
        opened = _opened(log.read_text())
        assert any(str(img) in line for line in opened), "strace saw the image itself opened"
        assert not [line for line in opened if "trap-target" in line]
        execs = [line for line in log.read_text().splitlines() if "execve(" in line]
        assert len(execs) == 1 and sys.executable in execs[0], execs


class _Virsh:
    def read(self, *args: str) -> CommandResult:
        return CommandResult(("virsh", *args), 0, b"shut off\n")

    def define(self, name: str, xml: bytes, xml_path: str) -> None:
        pass

    def act(self, verb: str, name: str, *args: str) -> CommandResult:
        return CommandResult(("virsh", verb, name), 0)


def _shim(tmp: Path) -> Path:
    """A `qemu-img` first on PATH: records argv (NUL-separated) and runs the real one under strace -f."""
    real, strace = require_tool("qemu-img"), require_tool("strace")
    bindir, calls = tmp / "shimbin", tmp / "calls"
    bindir.mkdir()
    calls.mkdir()
    shim = bindir / "qemu-img"
    shim.write_text(
        "#!/bin/sh\n"
        f'n=$(mktemp "{calls}/call.XXXXXX")\n'
        'printf "%s\\0" "$@" > "$n"\n'
        f'exec {strace} -f -qq -o "$n.strace" -e trace=open,openat {real} "$@"\n'
    )
    shim.chmod(0o755)
    return calls


def test_runtime_qemu_img_states_the_format_and_opens_no_named_file_dlv_img_09_12_18_19(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DLV-IMG-09, DLV-IMG-12, DLV-IMG-18, DLV-IMG-19: every qemu-img the runtime runs (overlays on a
    qcow2 and on a raw base, the blank disk of an iso install, a resize) states the format (`-f` and
    `-F`, or a json: name with its driver) and opens no file a header names: the base an overlay names
    is never opened by the overlay create (-u) nor by the resize (backing null); an iso is never given
    to qemu-img and is attached as raw; the iso install's disk names no backing file, and one that
    does is refused before a start."""
    require_tool("genisoimage")
    calls = _shim(tmp_path)
    root = tmp_path / "root"
    images = root / DATA.lstrip("/") / "libvirt/images"
    images.mkdir(parents=True)
    tmp = _img(tmp_path, "base.qcow2", size=2 * GIB)
    sha = hashlib.sha256(tmp.read_bytes()).hexdigest()
    base = images / f"{sha}.qcow2"
    os.replace(tmp, base)
    monkeypatch.setenv("PATH", f"{tmp_path / 'shimbin'}:{os.environ.get('PATH', '/usr/bin:/bin')}")
    rt = LibvirtRuntime(LocalSystem(root), _Virsh(), DATA)
    inst = InstanceSpec(
        id="vm1", allocation_id="a1", vcpus=1, memory_bytes=GIB, disk_bytes=4 * GIB,
        image=Image("https://images.example/base.qcow2", sha, "qcow2"),
    )  # fmt: skip
    rt.create(inst, Prepared())
    rt.grow(evolve(inst, disk_bytes=6 * GIB), running=False)
    iso = root / DATA.lstrip("/") / "libvirt/images/cafe.iso"
    iso.write_bytes(b"\0" * 4096)  # an install iso: the runtime creates a blank qcow2 beside it
    iso_sha = hashlib.sha256(iso.read_bytes()).hexdigest()
    os.replace(iso, images / f"{iso_sha}.iso")
    rt.create(
        InstanceSpec(
            id="vm2",
            allocation_id="a2",
            vcpus=1,
            memory_bytes=GIB,
            disk_bytes=GIB,
            image=Image("https://images.example/i.iso", iso_sha, "iso"),
        ),
        Prepared(),
    )
    raw_base = images / "raw.tmp"
    raw_base.write_bytes(b"QFI\xfb" + b"\0" * (GIB // 1024 - 4))  # raw bytes that look like qcow2
    raw_sha = hashlib.sha256(raw_base.read_bytes()).hexdigest()
    os.replace(raw_base, images / f"{raw_sha}.raw")
    vm3 = InstanceSpec(
        id="vm3", allocation_id="a3", vcpus=1, memory_bytes=GIB, disk_bytes=GIB,
        image=Image("https://images.example/r.raw", raw_sha, "raw"),
    )  # fmt: skip
    rt.create(vm3, Prepared())
    argvs = {p: p.read_bytes().split(b"\0")[:-1] for p in calls.glob("call.??????")}
    verbs = sorted(a[0].decode() for a in argvs.values())
    assert verbs == ["create", "create", "create", "resize"], verbs
    formats = []
    for path, argv in argvs.items():
        args = [a.decode() for a in argv]
        assert not [a for a in args if iso_sha in a], ("qemu-img was given the iso", args)
        if "-f" in args:
            assert args[args.index("-f") + 1] == "qcow2", args
            if "-b" in args:  # an overlay: unsafe (-u, the base is not opened) and its format stated
                assert "-u" in args, args
                formats.append(args[args.index("-F") + 1])
        else:
            names = [a for a in args if a.startswith("json:")]
            assert len(names) == 1, args
            spec = json.loads(names[0][5:])
            assert spec["driver"] == "qcow2" and spec["backing"] is None, args
        opened = _opened(Path(f"{path}.strace").read_text())
        assert [line for line in opened if "disk.qcow2" in line], "strace saw the disk itself opened"
        assert not [line for line in opened if sha in line or raw_sha in line], (args, "a base was opened")
    assert sorted(formats) == ["qcow2", "raw"]
    inst_dir = root / DATA.lstrip("/") / "libvirt/instances"
    xml3 = (inst_dir / "vm3/domain.xml").read_text()
    assert re.search(r'<backingStore type="file">\s*<format type="raw"', xml3), xml3
    xml2 = (inst_dir / "vm2/domain.xml").read_text()
    cdrom = re.search(r'<disk type="file" device="cdrom">\s*<driver name="qemu" type="raw"', xml2)
    assert cdrom and "backingStore" not in xml2, xml2
    vm2 = InstanceSpec(
        id="vm2", allocation_id="a2", vcpus=1, memory_bytes=GIB, disk_bytes=GIB,
        image=Image("https://images.example/i.iso", iso_sha, "iso"),
    )  # fmt: skip
    rt.check_overlay(vm2)  # flat: accepted
    # The snapshot's flatten source (a json: name): the overlay and, for a qcow2 or raw image, its base,
    # every layer's driver stated and the qcow2 base's own backing null, so no header-named file is opened.
    flat = json.loads(rt._flat_source(inst).removeprefix("json:"))
    assert flat["driver"] == "qcow2" and flat["file"]["filename"].endswith("vm1/disk.qcow2"), flat
    assert flat["backing"] == {
        "driver": "qcow2", "file": {"driver": "file", "filename": str(base)}, "backing": None,
    }, flat  # fmt: skip
    assert json.loads(rt._flat_source(vm2).removeprefix("json:"))["backing"] is None  # an iso is no base
    subprocess.run(
        [
            "qemu-img",
            "rebase",
            "-u",
            "-f",
            "qcow2",
            "-F",
            "raw",
            "-b",
            "/etc/passwd",
            str(inst_dir / "vm2/disk.qcow2"),
        ],
        check=True,
    )
    with pytest.raises(TerminalError, match="names a backing file"):
        rt.check_overlay(vm2)


def test_no_qemu_img_call_in_the_code_omits_the_format() -> None:
    """The code paths: the only qemu-img runner is the runtime's `_qemu_img`, and each of its calls names
    `-f` or `overlay_only` (a json: name stating the driver); the helper never runs qemu-img."""
    src = (REPO / "agent/bcd_agent/sections/instances/runtimes/libvirt.py").read_text()
    calls = src.split("self._qemu_img(")[1:]
    assert len(calls) == 4
    for call in calls:
        head = call.split(")\n")[0]
        # _flat_source: the snapshot's flatten, a json: name stating every layer's driver (its own test
        # in test_snapshot_real.py checks the chain ends in backing null).
        assert '"-f"' in head or "overlay_only(" in head or "self._flat_source(" in head, head
    runtimes = {"libvirt.py", "cloudhypervisor.py"}
    for tree in ("agent", "helper", "shared"):
        for py in (REPO / tree).rglob("*.py"):
            text = py.read_text()
            if '"qemu-img"' in text:
                assert py.name in runtimes and "runtimes" in py.parts, py
    # cloud-hypervisor's runtime runs qemu-img directly: each call states the format, or names the
    # overlay alone through overlay_only (a json: name with the driver and backing null), or the
    # overlay with its base through stated_chain (each layer's driver stated, the base's backing null).
    ch = (REPO / "agent/bcd_agent/sections/instances/runtimes/cloudhypervisor.py").read_text()
    lines = ch.splitlines()
    starts = [i for i, line in enumerate(lines) if '"qemu-img"' in line]
    assert starts
    for i in starts:
        argv = " ".join(lines[i : i + 12]).split("]")[0]
        before = " ".join(lines[max(0, i - 3) : i + 1])
        assert '"-f"' in argv or "overlay_only(" in before or "stated_chain(" in before, lines[i]
