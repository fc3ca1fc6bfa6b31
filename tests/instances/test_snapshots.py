"""Snapshots and restores off the booted guest (issue 11 deliverable 3): the snapshot tar's rules, the
transfers against a real HTTPS server the test starts (a throwaway CA passed explicitly, tests/tlskit.py),
the background download the converger waits on, the planner's restore rules, and `instance.snapshot`'s
handler with its staging and upload. The real save and restore of a booted guest is
test_snapshot_real.py."""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import os
import struct
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from bcd_agent.dispatch.handlers import CommandFailed, InvalidPayload
from bcd_agent.dispatch.kinds import KINDS
from bcd_agent.kinds.snapshot import KIND, InstanceSnapshotHandler
from bcd_agent.sections.instances import snapshots
from bcd_agent.sections.instances.model import Image, InstanceSpec, InstancesSpec, Nic, check_instance
from bcd_agent.sections.instances.plan import Create, Delete, Observed, RuntimeView, Start, plan
from bcd_agent.sections.instances.restores import SnapshotDownloads, SnapshotState
from bcd_agent.sections.instances.runtimes.base import Domain, SnapshotMeta, SnapshotRefused
from bcd_agent.sections.instances.transfers import (
    CODE_REFUSED,
    CODE_STALLED,
    CODE_TIMEOUT,
    CODE_TOO_LARGE,
    TransferFailed,
    TransferRules,
    download,
    upload,
)
from bcd_shared import wire
from bcd_shared.system import LocalSystem
from bcd_shared.wire.strict import type_url
from dispatch.dhelpers import make_command
from instkit import GIB
from testsupport import require_tool
from tlskit import https_server, make_tls

SHA_A = "a" * 64
CPU = "Test CPU @ 2.0GHz"


# --- a real HTTPS server -----------------------------------------------------------------------------


class Server:
    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.puts: dict[str, bytes] = {}
        self.gets: list[str] = []
        self.base = ""
        self.ca = ""


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    """GET /f/<name> serves `files` (/nolength/<name> without a Content-Length); /redirect-http
    redirects to plain http; /trickle and /slow send a
    few bytes a second; PUT /put/<name> stores into `puts`, PUT /put-redirect-http redirects to http."""
    require_tool("curl")
    ca, cert, key = make_tls(tmp_path)
    srv = Server()
    srv.ca = str(ca)

    class Handler(http.server.BaseHTTPRequestHandler):
        def _trickle(self, total: int, every: float) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(total))
            self.end_headers()
            try:
                for _ in range(total):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(every)
            except OSError:
                pass  # the client gave up: what the test wants

        def do_GET(self) -> None:
            srv.gets.append(self.path)
            if self.path.startswith("/f/") and self.path[3:] in srv.files:
                body = srv.files[self.path[3:]]
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            elif self.path.startswith("/nolength/") and self.path[10:] in srv.files:
                # No Content-Length: the body ends when the connection closes (HTTP/1.0).
                self.send_response(200)
                self.end_headers()
                self.wfile.write(srv.files[self.path[10:]])
            elif self.path == "/redirect-http":
                self.send_response(302)
                self.send_header("Location", f"http://127.0.0.1:{self.server.server_address[1]}/f/x")
                self.send_header("Content-Length", "0")
                self.end_headers()
            elif self.path == "/trickle":
                self._trickle(1 << 20, 0.5)
            elif self.path == "/slow":
                self._trickle(200, 0.05)
            else:
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()

        def do_PUT(self) -> None:
            if self.path == "/put-stall":  # reads nothing: the client's window fills and stays full
                time.sleep(15)
                return
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if self.path == "/put-redirect-http":
                self.send_response(307)
                self.send_header("Location", f"http://127.0.0.1:{self.server.server_address[1]}/put/x")
            else:
                srv.puts[self.path.removeprefix("/put/")] = body
                self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    with https_server(Handler, cert, key) as base:
        srv.base = base
        yield srv


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _tar(meta: SnapshotMeta, members: dict[str, bytes], path: Path) -> str:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in [("meta.json", snapshots.meta_bytes(meta)), *members.items()]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return str(path)


# --- the transfers -----------------------------------------------------------------------------------


def test_dlv_snap_02_10_a_download_is_verified_then_kept_in_data_dir_snapshots(
    tmp_path: Path, server: Server
) -> None:
    """DLV-SNAP-02, DLV-SNAP-10: the snapshot is fetched over https into data_dir/snapshots, renamed into
    place (0600) only once its digest matched, and its end calls on_done (the node's pass trigger)."""
    body = os.urandom(300_000)
    sha = hashlib.sha256(body).hexdigest()
    server.files["s.tar"] = body
    done: list[int] = []
    data = tmp_path / "data"
    dl = SnapshotDownloads(
        LocalSystem(Path("/")), str(data), rules=TransferRules(cacert=server.ca),
        on_done=lambda: done.append(1), start=lambda fn: fn(),
    )  # fmt: skip
    first = dl.states({sha: f"{server.base}/f/s.tar"})
    assert first[sha].running and first[sha].path is None
    assert done == [1]
    again = dl.states({sha: f"{server.base}/f/s.tar"})
    path = data / "snapshots" / f"{sha}.tar"
    assert again[sha] == SnapshotState(path=str(path))
    assert path.read_bytes() == body and (path.stat().st_mode & 0o777) == 0o600
    assert (os.stat(data / "snapshots").st_mode & 0o777) == 0o700
    assert sorted(os.listdir(data / "snapshots")) == [f"{sha}.tar"]  # no partial file left
    assert server.gets == ["/f/s.tar"]


def test_dlv_snap_05_11_a_mismatch_fails_for_a_minute_then_is_fetched_again(
    tmp_path: Path, server: Server
) -> None:
    """DLV-SNAP-05, DLV-SNAP-11: a digest mismatch keeps nothing and is reported (a mismatch) for a
    minute without another transfer; after the minute the snapshot is fetched again."""
    server.files["s.tar"] = b"not the snapshot"
    clock = Clock()
    data = tmp_path / "data"
    dl = SnapshotDownloads(
        LocalSystem(Path("/")), str(data), rules=TransferRules(cacert=server.ca),
        start=lambda fn: fn(), clock=clock,
    )  # fmt: skip
    url = f"{server.base}/f/s.tar"
    dl.states({SHA_A: url})
    state = dl.states({SHA_A: url})[SHA_A]
    assert state.mismatch and state.failed is not None and SHA_A in state.failed and state.path is None
    assert os.listdir(data / "snapshots") == []
    clock.now += 59
    assert dl.states({SHA_A: url})[SHA_A].failed is not None
    assert len(server.gets) == 1
    clock.now += 2
    assert dl.states({SHA_A: url})[SHA_A].running
    assert len(server.gets) == 2


def test_a_download_over_its_cap_is_refused_and_removed(tmp_path: Path, server: Server) -> None:
    """restore_from's download cap (docs/instances.md): a Content-Length over it is refused before any
    byte is written, a body without one once it ended over the cap; either way the partial file goes
    and the failure names the field and the limit. At the cap exactly, the snapshot is kept."""
    body = os.urandom(4096)
    server.files["s.tar"] = body
    sha = hashlib.sha256(body).hexdigest()
    system, rules = LocalSystem(Path("/")), TransferRules(cacert=server.ca)
    for path in ("/f/s.tar", "/nolength/s.tar"):
        with pytest.raises(TransferFailed) as exc:
            download(system, f"{server.base}{path}", str(tmp_path / "x"), rules, max_bytes=4095)
        assert exc.value.code == CODE_TOO_LARGE
        message = exc.value.message
        assert message.startswith("restore_from.url: ") and "limit of 4095 bytes" in message
    with pytest.raises(TransferFailed, match="Content-Length is over"):
        download(system, f"{server.base}/f/s.tar", str(tmp_path / "y"), rules, max_bytes=4095)
    assert not (tmp_path / "y").exists() or (tmp_path / "y").stat().st_size == 0  # nothing was fetched
    at_cap = download(system, f"{server.base}/nolength/s.tar", str(tmp_path / "z"), rules, max_bytes=4096)
    assert at_cap == sha
    data = tmp_path / "data"
    for path in ("/f/s.tar", "/nolength/s.tar"):
        dl = SnapshotDownloads(system, str(data), rules=rules, start=lambda fn: fn(), clock=Clock())
        dl.states({sha: f"{server.base}{path}"}, {sha: 4095})
        state = dl.states({sha: f"{server.base}{path}"}, {sha: 4095})[sha]
        assert state.path is None and not state.mismatch
        assert state.failed is not None and "transfer-too-large" in state.failed and "4095" in state.failed
        assert os.listdir(data / "snapshots") == []  # the partial file removed
    dl = SnapshotDownloads(system, str(data), rules=rules, start=lambda fn: fn(), clock=Clock())
    dl.states({sha: f"{server.base}/f/s.tar"}, {sha: 4096})
    assert dl.states({sha: f"{server.base}/f/s.tar"}, {sha: 4096})[sha].path is not None


def test_the_download_cap_is_the_largest_restoring_instances_disk_and_memory_and_a_gib() -> None:
    """plan.restore_limits: disk_bytes and 1/64 of it for qcow2's metadata, memory_bytes (a memory
    snapshot's state), 1 GiB for the rest; a snapshot several instances restore from takes the
    largest; an instance with a domain, deleted or invalid asks for nothing."""
    import attrs
    from bcd_agent.sections.instances.model import Desired
    from bcd_agent.sections.instances.plan import restore_limits, snapshot_limit

    small = _restore("a", disk_bytes=64 * GIB)
    big = attrs.evolve(_restore("b", disk_bytes=128 * GIB), memory_bytes=4 * GIB)
    assert snapshot_limit(small) == 64 * GIB + GIB + GIB + GIB
    assert snapshot_limit(big) == 128 * GIB + 2 * GIB + 4 * GIB + GIB
    gone = _restore("c", disk_bytes=1024 * GIB, desired=Desired.DELETED)
    running = _restore("d", disk_bytes=1024 * GIB)
    spec = InstancesSpec(1, (small, big, gone, running))
    assert restore_limits(spec, {"d": Domain("d", "libvirt-kvm", "running", True)}) == {
        SHA_A: snapshot_limit(big)
    }


def test_dlv_snap_16_redirects_only_to_https(tmp_path: Path, server: Server) -> None:
    """DLV-SNAP-16: a download or an upload redirected to plain http is refused, nothing sent there."""
    rules = TransferRules(cacert=server.ca)
    system = LocalSystem(Path("/"))
    with pytest.raises(TransferFailed) as down:
        download(system, f"{server.base}/redirect-http", str(tmp_path / "x"), rules)
    assert down.value.code == CODE_REFUSED
    assert server.gets == ["/redirect-http"]
    (tmp_path / "up").write_bytes(b"tar")
    with pytest.raises(TransferFailed) as up:
        upload(system, f"{server.base}/put-redirect-http", str(tmp_path / "up"), rules)
    assert up.value.code == CODE_REFUSED
    assert server.puts == {}
    with pytest.raises(TransferFailed) as plain:
        download(system, server.base.replace("https:", "http:") + "/f/x", str(tmp_path / "x"), rules)
    assert plain.value.code == CODE_REFUSED


def test_dlv_snap_17_a_stalled_transfer_ends(tmp_path: Path, server: Server) -> None:
    """DLV-SNAP-17, scaled down: a window of 2 s that moves less than its 1 MiB ends the transfer (the
    production window is 2 minutes; the rule is the same curl limits)."""
    rules = TransferRules(stall_s=2, stall_bytes=1 << 20, max_s=60, cacert=server.ca)
    start = time.monotonic()
    with pytest.raises(TransferFailed) as exc:
        download(LocalSystem(Path("/")), f"{server.base}/trickle", str(tmp_path / "x"), rules)
    assert exc.value.code == CODE_STALLED
    assert time.monotonic() - start < 30
    assert TransferRules().curl_args()[-6:] == [
        "--speed-limit",
        "8739",
        "--speed-time",
        "120",
        "--max-time",
        "21600",
    ]


def test_dlv_snap_17_a_stalled_upload_ends(tmp_path: Path, server: Server) -> None:
    """DLV-SNAP-17 for the upload, scaled down: a peer that stops reading ends the PUT after a 2-second
    window that moved less than 1 MiB."""
    big = tmp_path / "big.tar"
    big.write_bytes(os.urandom(16 << 20))
    rules = TransferRules(stall_s=2, stall_bytes=1 << 20, max_s=60, cacert=server.ca)
    with pytest.raises(TransferFailed) as exc:
        upload(LocalSystem(Path("/")), f"{server.base}/put-stall", str(big), rules)
    assert exc.value.code == CODE_STALLED


def test_dlv_snap_18_a_transfer_ends_after_its_time_in_all(tmp_path: Path, server: Server) -> None:
    """DLV-SNAP-18, scaled down: a transfer that keeps moving (never stalled) still ends at max_s."""
    rules = TransferRules(stall_s=60, stall_bytes=1, max_s=2, cacert=server.ca)
    with pytest.raises(TransferFailed) as exc:
        download(LocalSystem(Path("/")), f"{server.base}/slow", str(tmp_path / "x"), rules)
    assert exc.value.code == CODE_TIMEOUT


def test_dlv_snap_12_snapshots_no_spec_restores_from_are_deleted(tmp_path: Path) -> None:
    """DLV-SNAP-12: prune deletes every downloaded snapshot the spec no longer names and a partial file
    no download writes; the kept one and instance.snapshot's staging stay."""
    d = tmp_path / "snapshots"
    (d / "staging").mkdir(parents=True)
    for name in (f"{SHA_A}.tar", f"{'b' * 64}.tar", f".{'c' * 64}.part", "staging/x.tar"):
        (d / name).write_bytes(b"x")
    dl = SnapshotDownloads(LocalSystem(Path("/")), str(tmp_path))
    assert sorted(dl.prune({SHA_A})) == [f".{'c' * 64}.part", f"{'b' * 64}.tar"]
    assert sorted(os.listdir(d)) == [f"{SHA_A}.tar", "staging"] and os.listdir(d / "staging") == ["x.tar"]


# --- the spec and the planner --------------------------------------------------------------------------


def _restore(name: str = "r1", **kw: Any) -> InstanceSpec:
    return InstanceSpec(
        id=name, vcpus=1, memory_bytes=GIB, restore_from="https://s.example/r.tar", restore_sha256=SHA_A, **kw
    )


def test_dlv_snap_03_04_restore_from_needs_https_and_a_digest() -> None:
    """DLV-SNAP-03, DLV-SNAP-04: an http URL or a missing digest fails the instance, naming the field."""
    assert check_instance(_restore()) is None
    http = InstanceSpec(id="r", restore_from="http://s.example/r.tar", restore_sha256=SHA_A)
    assert "restore_from.url" in (check_instance(http) or "") and "https" in (check_instance(http) or "")
    nodigest = InstanceSpec(id="r", restore_from="https://s.example/r.tar")
    assert "restore_from.sha256: missing" in (check_instance(nodigest) or "")
    upper = InstanceSpec(id="r", restore_from="https://s.example/r.tar", restore_sha256="A" * 64)
    assert "restore_from.sha256" in (check_instance(upper) or "")
    both = _restore(image=Image("https://i.example/i.qcow2", SHA_A, "qcow2"))
    assert "image: set beside restore_from" in (check_instance(both) or "")


def _observed(snaps: dict[str, SnapshotState], *domains: Domain, snapshots_ok: bool = True) -> Observed:
    view = RuntimeView("libvirt-kvm", tuple(domains), snapshots=snapshots_ok)
    return Observed(runtimes={"libvirt-kvm": view}, snapshots=snaps)


def test_dlv_snap_08_09_a_restore_waits_on_its_download_while_the_pass_goes_on() -> None:
    """DLV-SNAP-08, DLV-SNAP-09: while its snapshot downloads, a restore waits "for the user data or
    snapshot" and the same pass still deletes a domain no spec names; once the tar is there, the restore
    is a Create carrying the tar, then a start."""
    spec = InstancesSpec(1, (_restore(),))
    gone = Domain("old", "libvirt-kvm", "running", True)
    waiting = plan(spec, _observed({SHA_A: SnapshotState(running=True)}, gone))
    assert waiting.waiting["r1"].startswith("waiting for the user data or snapshot")
    assert waiting.steps == (Delete("libvirt-kvm", "old"),)
    failed = plan(spec, _observed({SHA_A: SnapshotState(failed="restore_from: transfer-failed: x")}))
    assert "a minute" in failed.waiting["r1"] and "r1" not in failed.errors
    ready = plan(spec, _observed({SHA_A: SnapshotState(path="/d/snapshots/a.tar")}))
    assert [type(s) for s in ready.steps] == [Create, Start]
    create = ready.steps[0]
    assert isinstance(create, Create) and create.snapshot == "/d/snapshots/a.tar"


def test_dlv_snap_05_a_mismatch_fails_the_instance_and_a_plugin_restores_nothing_dlv_rt_09() -> None:
    """DLV-SNAP-05: a digest mismatch is the instance's ERROR; DLV-RT-09: a runtime that takes no
    snapshots restores none."""
    spec = InstancesSpec(1, (_restore(),))
    bad = plan(spec, _observed({SHA_A: SnapshotState(failed="restore_from.sha256: mismatch", mismatch=True)}))
    assert bad.errors["r1"] == "restore_from.sha256: mismatch" and not bad.steps
    plugin = plan(spec, _observed({SHA_A: SnapshotState(path="/x")}, snapshots_ok=False))
    assert "takes no snapshots, so it restores none" in plugin.errors["r1"] and not plugin.steps


# --- the tar ---------------------------------------------------------------------------------------------


def test_dlv_snap_06_07_dlv_rt_12_another_runtime_or_cpu_model_is_refused(tmp_path: Path) -> None:
    """DLV-SNAP-06, DLV-RT-12, DLV-LIBVIRT-26: a tar another runtime took is refused; DLV-SNAP-07: a
    memory snapshot from another CPU model too, while a disk-only one from another model restores."""
    dest = tmp_path / "d"
    dest.mkdir()
    ch = _tar(SnapshotMeta("cloud-hypervisor", CPU, False), {"disk.qcow2": b"q"}, tmp_path / "ch.tar")
    with pytest.raises(SnapshotRefused, match="taken by the 'cloud-hypervisor' runtime"):
        snapshots.unpack(ch, str(dest), "libvirt-kvm", CPU, "save.state")
    mem = _tar(
        SnapshotMeta("libvirt-kvm", "Other CPU", True),
        {"disk.qcow2": b"q", "save.state": b"s"},
        tmp_path / "m.tar",
    )
    with pytest.raises(SnapshotRefused, match="restores only on the same CPU model"):
        snapshots.unpack(mem, str(dest), "libvirt-kvm", CPU, "save.state")
    assert os.listdir(dest) == []
    disk = _tar(SnapshotMeta("libvirt-kvm", "Other CPU", False), {"disk.qcow2": b"q"}, tmp_path / "d.tar")
    meta, names = snapshots.unpack(disk, str(dest), "libvirt-kvm", CPU, "save.state")
    assert names == ("disk.qcow2",) and (dest / "disk.qcow2").read_bytes() == b"q" and not meta.include_memory


@pytest.mark.parametrize(
    ("members", "rule"),
    [
        ({"../escape": b"x"}, "not a snapshot file"),
        ({"disk.qcow2": b"q", "disk.qcow2 ": b"q"}, "not a snapshot file"),
        ({"ch/config.json": b"{}", "disk.qcow2": b"q"}, "a state this libvirt-kvm snapshot cannot hold"),
        ({"seed.iso": b"s"}, "no disk.qcow2"),
    ],
)
def test_a_tar_with_anything_else_is_refused_whole(
    tmp_path: Path, members: dict[str, bytes], rule: str
) -> None:
    dest = tmp_path / "d"
    dest.mkdir()
    tar = _tar(SnapshotMeta("libvirt-kvm", CPU, True), members, tmp_path / "t.tar")
    with pytest.raises(SnapshotRefused, match=rule):
        snapshots.unpack(tar, str(dest), "libvirt-kvm", CPU, "save.state")
    assert not (tmp_path / "escape").exists()


def test_a_link_member_or_a_late_meta_is_refused(tmp_path: Path) -> None:
    dest = tmp_path / "d"
    dest.mkdir()
    path = tmp_path / "l.tar"
    with tarfile.open(path, "w") as tar:
        data = snapshots.meta_bytes(SnapshotMeta("libvirt-kvm", CPU, False))
        info = tarfile.TarInfo("meta.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("disk.qcow2")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/shadow"
        tar.addfile(link)
    with pytest.raises(SnapshotRefused, match="not a regular file"):
        snapshots.unpack(str(path), str(dest), "libvirt-kvm", CPU, "save.state")
    late = tmp_path / "late.tar"
    with tarfile.open(late, "w") as tar:
        info = tarfile.TarInfo("disk.qcow2")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"q"))
    with pytest.raises(SnapshotRefused, match=r"first member must be meta\.json"):
        snapshots.unpack(str(late), str(dest), "libvirt-kvm", CPU, "save.state")
    with pytest.raises(SnapshotRefused, match="exactly runtime, cpuModel and includeMemory"):
        snapshots.parse_meta(b'{"runtime":"libvirt-kvm","cpuModel":"x","includeMemory":true,"extra":1}')


def test_dlv_rt_13_14_15_memory_snapshots_of_gpus_or_rw_volumes_are_refused() -> None:
    """DLV-RT-13: the seeds' message for GPUs; DLV-RT-14: ErrMemorySnapshotWithVolumes for a read-write
    volume; DLV-RT-15: a disk-only snapshot of either, and a memory one with a read-only volume, pass."""
    gpu = InstanceSpec(id="g", gpu_uuids=("GPU-1",))
    with pytest.raises(SnapshotRefused) as exc:
        snapshots.refuse_memory_snapshot(gpu, True)
    assert exc.value.message == (
        "payload.include_memory: an instance with passthrough GPUs cannot be snapshotted with its memory; "
        "snapshot its disk only"
    )
    rw = InstanceSpec(id="v", volumes=(("vol1", True), ("vol2", False)))
    with pytest.raises(SnapshotRefused, match="ErrMemorySnapshotWithVolumes"):
        snapshots.refuse_memory_snapshot(rw, True)
    snapshots.refuse_memory_snapshot(gpu, False)
    snapshots.refuse_memory_snapshot(rw, False)
    snapshots.refuse_memory_snapshot(InstanceSpec(id="ro", volumes=(("vol1", True),)), True)


def _save_image(xml: bytes, cookie: bytes, stream: bytes, data_len: int = 4096) -> bytes:
    data = xml + b"\0" + cookie + b"\0"
    head = snapshots.SAVE_HEADER.pack(snapshots.SAVE_MAGIC, 2, data_len, 0, 0, len(xml) + 1)
    return head + data + b"\0" * (data_len - len(data)) + stream


def test_the_save_header_rewrite_keeps_the_cookie_and_the_stream() -> None:
    """libvirt's header (virQEMUSaveHeader, 92 bytes): the new XML replaces the old one, the cookie
    moves after it with cookieOffset updated, was_running is set, the QEMU stream is copied byte for
    byte; a data area too small for the new XML grows."""
    stream = os.urandom(5000)
    old = _save_image(b"<domain><name>src</name></domain>", b"<cookie/>", stream)
    out = io.BytesIO()
    new_xml = b"<domain><name>restored</name></domain>"
    snapshots.rewrite_save_header(io.BytesIO(old), out, new_xml)
    blob = out.getvalue()
    magic, version, data_len, running, compressed, offset = snapshots.SAVE_HEADER.unpack(blob[:92])
    assert (magic, version, data_len, running, compressed) == (b"LibvirtQemudSave", 2, 4096, 1, 0)
    assert blob[92 : 92 + offset] == new_xml + b"\0"
    assert blob[92 + offset :].startswith(b"<cookie/>\0")
    assert blob[92 + data_len :] == stream
    big = b"<domain>" + b"x" * 5000 + b"</domain>"
    out = io.BytesIO()
    snapshots.rewrite_save_header(io.BytesIO(old), out, big)
    grown = out.getvalue()
    data_len = struct.unpack("<I", grown[20:24])[0]
    assert data_len >= len(big) + 11 and data_len % 1024 == 0 and grown[92 + data_len :] == stream
    with pytest.raises(SnapshotRefused, match="not a libvirt save image"):
        snapshots.rewrite_save_header(io.BytesIO(b"X" * 200), io.BytesIO(), new_xml)


# --- instance.snapshot ---------------------------------------------------------------------------------


class Ctx:
    boot_id = "boot-1"
    cancel_requested = False

    def __init__(self) -> None:
        self.begun = False

    async def begin_effect(self) -> None:
        self.begun = True


class FakeRuntime:
    """Writes a real tar as the libvirt-kvm runtime would (the capture itself is test_snapshot_real's)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bool, str]] = []

    def snapshot(self, inst: InstanceSpec, include_memory: bool, tar_path: str) -> SnapshotMeta:
        self.calls.append((inst.id, include_memory, tar_path))
        meta = SnapshotMeta("libvirt-kvm", CPU, include_memory)
        _tar(meta, {"disk.qcow2": b"disk" * 1000}, Path(tar_path))
        return meta


def _command(instance_id: str, url: str, memory: bool = False) -> Any:
    req = wire.InstanceSnapshotRequest(instance_id=instance_id, include_memory=memory, upload_url=url)
    return make_command(kind=KIND, payload=(type_url(wire.InstanceSnapshotRequest), bytes(req)))


def _handler(
    tmp_path: Path, server: Server, rt: FakeRuntime, inst: InstanceSpec | None
) -> InstanceSnapshotHandler:
    held: list[str] = []

    class Hold:
        def __init__(self, name: str) -> None:
            self.name = name

        def __enter__(self) -> None:
            held.append(self.name)

        def __exit__(self, *a: object) -> None:
            pass

    h = InstanceSnapshotHandler(
        LocalSystem(Path("/")), str(tmp_path / "data"),
        instance=lambda i: inst if inst is not None and inst.id == i else None,
        runtimes=lambda: {"libvirt-kvm": rt}, hold=Hold, rules=TransferRules(cacert=server.ca),
    )  # fmt: skip
    h.held = held  # type: ignore[attr-defined]
    return h


def test_dlv_snap_13_14_the_snapshot_is_staged_hashed_and_uploaded(tmp_path: Path, server: Server) -> None:
    """DLV-SNAP-13, DLV-SNAP-14, DLV-KIND-21: the runtime captures into data_dir/snapshots/staging (the
    converger kept off the instance), bcd hashes the tar and PUTs it to the presigned URL; the result
    names its digest, size, runtime, CPU model and memory; the staging file is gone after."""
    assert KINDS[KIND].lane.name.lower() == "bulk" and not KINDS[KIND].retry_safe
    rt = FakeRuntime()
    inst = InstanceSpec(id="vm1")
    h = _handler(tmp_path, server, rt, inst)
    ctx = Ctx()
    cmd = _command("vm1", f"{server.base}/put/snap?X-Amz-Signature=abc")
    assert h.resources(cmd) == frozenset({"instance:vm1"})
    out = trio.run(h.run, cmd, ctx)
    result = wire.InstanceSnapshotResult.parse(out)
    body = server.puts["snap?X-Amz-Signature=abc"]
    assert result.sha256 == hashlib.sha256(body).hexdigest() and result.size_bytes == len(body)
    assert (result.runtime, result.cpu_model, result.includes_memory) == ("libvirt-kvm", CPU, False)
    staging = tmp_path / "data/snapshots/staging"
    assert rt.calls[0][2].startswith(str(staging) + "/") and ctx.begun
    assert os.listdir(staging) == [] and h.held == ["vm1"]  # type: ignore[attr-defined]
    with tarfile.open(fileobj=io.BytesIO(body)) as tar:
        assert tar.getnames() == ["meta.json", "disk.qcow2"]
        assert json.loads(tar.extractfile("meta.json").read())["runtime"] == "libvirt-kvm"  # type: ignore[union-attr]


def test_refusals_come_before_any_effect(tmp_path: Path, server: Server) -> None:
    """A bad payload is invalid-payload naming the field; an unknown instance, and a memory snapshot
    of an instance with GPUs (DLV-RT-13), fail before RUNNING, the runtime never called."""
    rt = FakeRuntime()
    h = _handler(tmp_path, server, rt, InstanceSpec(id="g1", gpu_uuids=("GPU-1",)))
    with pytest.raises(InvalidPayload, match=r"payload\.upload_url"):
        h.resources(_command("g1", "http://x.example/p"))
    with pytest.raises(InvalidPayload, match=r"payload\.instance_id"):
        h.resources(_command("../x", f"{server.base}/put/p"))
    for cmd, code in (
        (_command("nope", f"{server.base}/put/p"), "unknown-instance"),
        (_command("g1", f"{server.base}/put/p", memory=True), "snapshot-refused"),
    ):
        ctx = Ctx()
        with pytest.raises(CommandFailed) as exc:
            trio.run(h.run, cmd, ctx)
        assert exc.value.code == code and not ctx.begun
    assert rt.calls == [] and server.puts == {}


def test_dlv_snap_15_a_crash_leaves_an_interrupted_entry_and_its_staging_file_goes(tmp_path: Path) -> None:
    """DLV-SNAP-15, DLV-REC-12: a crash mid-snapshot leaves the journal entry running; the next process
    reports it FAILED interrupted (never re-run: not retry-safe) and deletes the staging file it left
    when it builds the handler."""
    from bcd_agent.journal import Action, Journal
    from journal.jhelpers import NOT_RETRY_SAFE, cmd, crash_copy

    j = Journal.open(tmp_path / "a", boot_id="boot1")
    j.accept_command(cmd("snap-1", NOT_RETRY_SAFE, KIND))
    j.mark_running("snap-1")
    data = crash_copy(j, tmp_path / "b")
    staging = tmp_path / "data/snapshots/staging"
    staging.mkdir(parents=True)
    (staging / "snap-1.tar").write_bytes(b"half a tar")
    (staging / "snap-1.tar.disk").write_bytes(b"half a disk")
    with Journal.open(data, boot_id="boot1") as j2:
        assert j2.resolve("snap-1").action is Action.INTERRUPTED
        settled = {e.id: e for e in j2.recover()}
        assert settled["snap-1"].result is not None and settled["snap-1"].result.code == "interrupted"
    InstanceSnapshotHandler(
        LocalSystem(Path("/")), str(tmp_path / "data"), instance=lambda i: None, runtimes=dict
    )
    assert os.listdir(staging) == []


# --- the section on the simulated host (fake virsh and qemu-img) ----------------------------------------


def _restored_section(tmp_path: Path) -> tuple[Any, Any, Path, str]:
    """A simulated host with a running `src`, a memory snapshot of it already downloaded as the
    section's data_dir/snapshots/<sha>.tar, and a section with the downloader (which must not fetch)."""
    from bcd_agent.converge.types import SectionState
    from bcd_agent.sections.instances.section import InstancesSection
    from instkit import DATA_DIR, FixedUserData, converge, section, sim_host, spec, vm

    system = sim_host(tmp_path)
    sec, rt = section(system)
    assert converge(sec, spec(vm("src", user_data_ref="ud"))).state is SectionState.CONVERGED
    staging = system.host_path(f"{DATA_DIR}/snapshots/staging")
    staging.mkdir(parents=True)
    tar = staging / "t.tar"
    rt.snapshot(vm("src"), True, str(tar))
    sha = hashlib.sha256(tar.read_bytes()).hexdigest()
    os.replace(tar, system.host_path(f"{DATA_DIR}/snapshots/{sha}.tar"))

    def never(fn: Any) -> None:
        raise AssertionError("a downloaded snapshot is not fetched again")

    dl = SnapshotDownloads(system, DATA_DIR, start=never)
    sec2 = InstancesSection(system, [rt], DATA_DIR, user_data=FixedUserData(), snapshots=dl)
    return sec2, rt, system.host_path(DATA_DIR), sha


def test_dlv_snap_01_plc_16_the_section_restores_an_instance_from_its_snapshot(tmp_path: Path) -> None:
    """DLV-SNAP-01, DLV-PLC-16, DLV-IMG-16: an instance with restore_from is created from its snapshot
    (no image), runs, keeps the spec's pinning (not the snapshot's) and its seed as a raw read-only
    cdrom; the next pass plans nothing; once no spec restores from it, the tar is deleted (DLV-SNAP-12)."""
    import xml.etree.ElementTree as ET

    from bcd_agent.converge.types import SectionState
    from bcd_agent.sections.instances.model import Placement
    from bcd_simhost.libvirt import STATE
    from instkit import DATA_DIR, converge, spec, vm

    sec, _rt, data, sha = _restored_section(tmp_path)
    restored = InstanceSpec(
        id="copy", allocation_id="alloc_copy", vcpus=2, memory_bytes=2 * GIB,
        restore_from="https://s.example/s.tar", restore_sha256=sha, placement=Placement(cpus="4-5"),
    )  # fmt: skip
    desired = spec(vm("src"), restored, generation=2)
    out = converge(sec, desired)
    assert out.state is SectionState.CONVERGED, out.message
    states = {i.instance_id: i.state for i in sec.last_report.instances}
    assert states == {"src": "RUNNING", "copy": "RUNNING"}
    xml = (tmp_path / "host" / STATE.lstrip("/") / "copy.xml").read_text()
    assert f"<bcd:restored-from>{sha}</bcd:restored-from>" in xml
    assert "<bcd:image>" not in xml
    vda = next(d for d in ET.fromstring(xml).findall("devices/disk") if d.get("device") == "disk")
    bs = vda.find("backingStore")  # explicit and empty: no chain a header could name is followed
    assert bs is not None and len(bs) == 0 and not bs.attrib
    assert '<vcpupin vcpu="0" cpuset="4" />' in xml and '<vcpupin vcpu="1" cpuset="5" />' in xml
    cdroms = [d for d in ET.fromstring(xml).findall("devices/disk") if d.get("device") == "cdrom"]
    assert [(c.find("driver").get("type"), c.find("source").get("file")) for c in cdroms] == [  # type: ignore[union-attr]
        ("raw", f"{DATA_DIR}/libvirt/instances/copy/seed.iso")
    ]
    assert not (data / "libvirt/instances/copy/save.state").exists()  # the first start restored it
    assert sec.plan(desired, 2).steps == ()
    assert (data / f"snapshots/{sha}.tar").exists()
    converge(sec, spec(vm("src"), restored, generation=3))
    assert (data / f"snapshots/{sha}.tar").exists()
    converge(sec, spec(generation=4))  # an empty spec's pass prunes too
    assert not (data / f"snapshots/{sha}.tar").exists()


def test_dlv_img_15_17_dlv_libvirt_27_a_restored_disk_naming_a_backing_file_is_refused(
    tmp_path: Path,
) -> None:
    """DLV-IMG-15, DLV-IMG-17, DLV-LIBVIRT-27: a snapshot whose disk names a backing file (a tenant's
    qcow2 pointing at a host file) fails the instance and its directory is removed; no domain."""
    from bcd_simhost.libvirt import qcow2_bytes
    from instkit import converge, spec

    sec, _rt, data, _sha = _restored_section(tmp_path)
    bad = _tar(
        SnapshotMeta("libvirt-kvm", sec.runtimes["libvirt-kvm"].cpu_model(), False),
        {"disk.qcow2": qcow2_bytes(GIB, "/etc/shadow", "raw")},
        tmp_path / "bad.tar",
    )
    sha = hashlib.sha256(Path(bad).read_bytes()).hexdigest()
    os.replace(bad, data / f"snapshots/{sha}.tar")
    inst = InstanceSpec(id="evil", vcpus=1, memory_bytes=GIB, restore_from="https://s/x", restore_sha256=sha)
    out = converge(sec, spec(inst))
    report = {i.instance_id: i for i in sec.last_report.instances}
    assert report["evil"].state == "ERROR" and "disk.qcow2" in report["evil"].message, out.message
    assert not (data / "libvirt/instances/evil").exists()
    assert "evil" not in [d.name for d in sec.runtimes["libvirt-kvm"].list()]


# --- a hostile tar, as a property ---------------------------------------------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_NAMES = st.sampled_from(
    [
        "meta.json", "disk.qcow2", "seed.iso", "save.state", "ch/config.json", "ch/state.json",
        "../escape", "/abs", "ch/../../escape", "disk.qcow2/x", "./disk.qcow2", "ch", "other",
    ]
)  # fmt: skip
_KINDS = st.sampled_from(
    [tarfile.REGTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.DIRTYPE, tarfile.FIFOTYPE]
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    members=st.lists(st.tuples(_NAMES, _KINDS, st.binary(max_size=64)), max_size=6),
    memory=st.booleans(),
    meta_first=st.booleans(),
)
def test_any_tar_writes_only_snapshot_files_inside_the_directory(
    tmp_path: Path, members: list[tuple[str, bytes, bytes]], memory: bool, meta_first: bool
) -> None:
    """Whatever a tar holds (names climbing out, links, devices, duplicates, meta late or missing), the
    unpack either refuses it (SnapshotRefused) or writes only snapshot member names as regular files,
    and never anything outside the new instance's directory."""
    import tempfile

    with tempfile.TemporaryDirectory(dir=tmp_path) as work:
        base = Path(work)
        dest = base / "a" / "d"
        dest.mkdir(parents=True)
        path = base / "t.tar"
        with tarfile.open(path, "w") as tar:
            entries = list(members)
            meta = snapshots.meta_bytes(SnapshotMeta("libvirt-kvm", CPU, memory))
            if meta_first:
                entries.insert(0, ("meta.json", tarfile.REGTYPE, meta))
            for name, kind, data in entries:
                info = tarfile.TarInfo(name)
                info.type = kind
                if kind in (tarfile.SYMTYPE, tarfile.LNKTYPE):
                    info.linkname = "/etc/passwd"
                if kind == tarfile.REGTYPE:
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
                else:
                    tar.addfile(info)
        try:
            _meta, written = snapshots.unpack(str(path), str(dest), "libvirt-kvm", CPU, "save.state")
        except SnapshotRefused:
            written = None
        outside = sorted(str(p.relative_to(base)) for p in base.rglob("*") if not p.is_relative_to(dest))
        assert outside == ["a", "t.tar"]
        for p in dest.rglob("*"):
            rel = str(p.relative_to(dest))
            assert rel in snapshots.MEMBERS or rel == "ch", rel
            assert p.is_dir() if rel == "ch" else (p.is_file() and not p.is_symlink())
        if written is not None:
            assert "disk.qcow2" in written and len(set(written)) == len(written)


def test_a_refused_restore_is_not_unpacked_again_and_a_memory_restore_takes_no_gpu(tmp_path: Path) -> None:
    """A restore refused after its unpack (a bad disk) is refused from memory on the next pass, without
    writing the snapshot out again; a memory snapshot restored into a spec with a passthrough GPU is
    refused up front (the saved guest never had that device)."""
    from bcd_agent.sections.instances.runtimes.base import Prepared
    from bcd_simhost.libvirt import qcow2_bytes

    _sec, rt, data, sha = _restored_section(tmp_path)
    bad = _tar(
        SnapshotMeta("libvirt-kvm", rt.cpu_model(), False),
        {"disk.qcow2": qcow2_bytes(GIB, "/x", "raw")},
        tmp_path / "b.tar",
    )
    inst = InstanceSpec(
        id="evil", vcpus=1, memory_bytes=GIB, restore_from="https://s/x", restore_sha256="b" * 64
    )
    from bcd_shared.errors import TerminalError

    with pytest.raises(TerminalError, match=r"disk\.qcow2: .*backing"):
        rt.restore(inst, bad, Prepared())
    os.unlink(bad)  # gone: a second unpack would fail differently
    with pytest.raises(SnapshotRefused, match=r"disk\.qcow2: .*backing"):
        rt.restore(inst, bad, Prepared())
    assert not (data / "libvirt/instances/evil").exists()
    gpu = InstanceSpec(
        id="g",
        vcpus=2,
        memory_bytes=2 * GIB,
        restore_from="https://s/x",
        restore_sha256=sha,
        gpu_uuids=("GPU-1",),
    )
    with pytest.raises(SnapshotRefused, match="without passthrough GPUs"):
        rt.restore(gpu, str(data / f"snapshots/{sha}.tar"), Prepared(("0000:53:00.0",)))
    assert not (data / "libvirt/instances/g").exists()


def test_dlv_snap_08_09_the_section_loads_rules_and_deletes_while_a_download_runs(tmp_path: Path) -> None:
    """DLV-SNAP-08, DLV-SNAP-09 on the section: with its snapshot still downloading, the restore is
    PENDING "waiting for the user data or snapshot", while the same pass loads the firewall rules (the
    restore's NIC included, before its tap exists) and deletes a domain no spec names."""
    from bcd_agent.converge.types import SectionState
    from bcd_agent.sections.instances.network import NetworkPolicy
    from bcd_agent.sections.instances.section import InstancesSection
    from instkit import DATA_DIR, FixedUserData, converge, section, sim_host, spec, vm
    from test_instances_network import Recording

    system = sim_host(tmp_path)
    sec0, rt = section(system)
    assert converge(sec0, spec(vm("old"))).state is SectionState.CONVERGED
    started: list[Any] = []
    dl = SnapshotDownloads(system, DATA_DIR, start=started.append)  # never finishes in this test
    sec = InstancesSection(system, [rt], DATA_DIR, user_data=FixedUserData(), snapshots=dl)
    rec = Recording(sec)
    sec.network = NetworkPolicy(rec)
    restore = _restore(nics=(Nic("br0", "52:54:00:00:00:09", ("10.0.0.9/24",)),), network_policy="PRIVATE")
    out = converge(sec, spec(restore, generation=2))
    assert out.state is SectionState.PROGRESSING, out.message
    report = {i.instance_id: i for i in sec.last_report.instances}
    assert report["r1"].state == "PENDING"
    assert report["r1"].message == "waiting for the user data or snapshot: downloading the snapshot"
    assert "old" not in report and "old" not in [d.name for d in rt.list()]
    assert [(n.instance, n.policy) for n in rec.loads[-1]] == [("r1", "PRIVATE")]
    assert len(started) == 1
    converge(sec, spec(restore, generation=3))
    assert len(started) == 1  # one download, however many passes wait on it


def test_a_restored_definition_passes_roots_check_and_an_empty_backing_store_only_there() -> None:
    """The restored domain's definition (flat disk with an explicit empty `<backingStore/>`, seed,
    `restored-from`) passes root's default-deny check; an empty backingStore anywhere else (a cdrom),
    or one with content, is refused."""
    from bcd_agent.sections.instances.runtimes.base import DomainFiles
    from bcd_agent.sections.instances.runtimes.domainxml import build_domain_xml
    from bcd_shared.domaincheck import DomainPolicy, DomainRefused, check_domain

    d = "/var/lib/bcd/libvirt/instances/r1"
    inst = _restore(nics=(Nic("br0", "52:54:00:00:00:09"),))
    xml = build_domain_xml(
        inst, DomainFiles(f"{d}/disk.qcow2", seed=f"{d}/seed.iso"), restored_from=SHA_A
    ).decode()
    policy = DomainPolicy("r1", "/var/lib/bcd", ("br0",), ())
    checked = check_domain(xml.encode(), policy)
    assert checked.metadata["restored-from"] == SHA_A and checked.disks[0].backing is None
    assert xml.count("<backingStore />") == 1
    on_cdrom = xml.replace("<readonly />", "<readonly /><backingStore />", 1)
    with_content = xml.replace(
        "<backingStore />", '<backingStore type="file"><source file="/etc/shadow" /></backingStore>'
    )
    for bad in (on_cdrom, with_content):
        with pytest.raises(DomainRefused):
            check_domain(bad.encode(), policy)


def test_member_names_reads_a_bounded_number_of_headers(tmp_path: Path) -> None:
    """A tar of thousands of members is never listed whole (at most one header past a snapshot's)."""
    path = tmp_path / "many.tar"
    with tarfile.open(path, "w") as tar:
        for i in range(2000):
            info = tarfile.TarInfo(f"m{i}")
            tar.addfile(info, io.BytesIO(b""))
    names = snapshots.member_names(str(path))
    assert len(names) == len(snapshots.MEMBERS) + 1 and names[0] == "m0"


def test_a_huge_extended_header_is_refused_before_tarfile_reads_it(tmp_path: Path) -> None:
    """A PAX header claiming 1 GiB (tarfile would read it whole into memory) refuses the tar first."""
    pax = tarfile.TarInfo("././@PaxHeader")
    pax.type = tarfile.XHDTYPE
    pax.size = 1 << 30
    head = pax.tobuf(format=tarfile.USTAR_FORMAT)
    path = tmp_path / "pax.tar"
    path.write_bytes(head + b"\0" * 1024)
    for read in (snapshots.read_meta, snapshots.member_names):
        with pytest.raises(SnapshotRefused, match="extended tar header"):
            read(str(path))  # type: ignore[operator]
    ok = _tar(SnapshotMeta("libvirt-kvm", CPU, False), {"disk.qcow2": b"q" * 3000}, tmp_path / "ok.tar")
    snapshots.check_headers(ok)  # a real PAX tar passes


def test_a_held_instance_is_left_alone_by_the_converger(tmp_path: Path) -> None:
    """While instance.snapshot holds an instance, the pass's steps for it wait (a stop is not run under
    the capture); released, the next pass runs them. A second hold on the same instance is refused."""
    from bcd_agent.converge.types import SectionState
    from bcd_agent.sections.instances.model import Desired
    from bcd_shared.errors import TerminalError
    from instkit import converge, section, sim_host, spec, vm

    sec, rt = section(sim_host(tmp_path))
    assert converge(sec, spec(vm("a"))).state is SectionState.CONVERGED
    with sec.hold("a"):
        with pytest.raises(TerminalError, match="being snapshotted already"), sec.hold("a"):
            pass
        out = converge(sec, spec(vm("a", desired=Desired.STOPPED), generation=2))
        assert out.state is SectionState.PROGRESSING and "a snapshot of this instance" in out.message
        assert {d.name: d.state for d in rt.list()}["a"] == "running"
    out = converge(sec, spec(vm("a", desired=Desired.STOPPED), generation=3))
    assert out.state is SectionState.CONVERGED, out.message
    assert {d.name: d.state for d in rt.list()}["a"] == "stopped"
