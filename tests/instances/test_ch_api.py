"""cloud-hypervisor's API client (h11 over a Unix socket, tap fds by SCM_RIGHTS) against the provided
v51 API server (bcd_simhost.chapi), with real taps opened in a private network namespace: the server
checks each received fd by fstat and TUNGETIFF, so only a real tap passed by SCM_RIGHTS is accepted."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from bcd_agent.sections.instances.runtimes.chapi import MIN_VERSION, CHApi, CHApiError, parse_version
from bcd_simhost.chapi import FakeCHServer
from netns import in_netns, open_tap

IN_CI = os.environ.get("CI") == "true"
needs_tun = pytest.mark.skipif(
    not IN_CI and (os.geteuid() != 0 or not os.path.exists("/dev/net/tun")),
    reason="needs root and /dev/net/tun",
)
CONFIG = {
    "payload": {"firmware": "/usr/share/cloud-hypervisor/CLOUDHV.fd"},
    "cpus": {"boot_vcpus": 2, "max_vcpus": 2},
    "memory": {"size": 1 << 30},
    "balloon": {"size": 0, "free_page_reporting": True},
    "disks": [{"id": "disk0", "path": "/dev/null", "image_type": "Raw"}],
}


@pytest.fixture
def sockdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="bcdch", dir="/tmp"))  # short: sun_path holds 108 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def vmm(sockdir: Path) -> Iterator[FakeCHServer]:
    with FakeCHServer(sockdir / "api.sock") as srv:
        yield srv


def test_version_parsing_and_minimum_dlv_chu_31() -> None:
    """DLV-CHU-31: the minimum is v51 (image_type, backing_files; resize-disk v50; net_fds v40)."""
    assert MIN_VERSION == (51, 0)
    assert parse_version("v51.1") == (51, 1)
    assert parse_version("cloud-hypervisor v52.0-12-gdeadbee") == (52, 0)
    assert parse_version("50.2") == (50, 2)
    assert parse_version("v50") is None and parse_version("") is None and parse_version("vX.1") is None


def test_lifecycle_over_the_socket_dlv_ch_02(vmm: FakeCHServer) -> None:
    """DLV-CH-02: create, boot, info, balloon, disks, pause, snapshot, shutdown over api.sock."""
    api = CHApi(vmm.path, timeout_s=5)
    assert parse_version(api.ping()["version"]) >= MIN_VERSION  # type: ignore[operator]
    api.create(CONFIG)
    assert api.info()["state"] == "Created"
    api.boot()
    assert api.info()["state"] == "Running"
    api.resize_balloon(256 << 20)
    info = api.info()
    assert info["config"]["balloon"]["size"] == 256 << 20
    assert info["memory_actual_size"] == (1 << 30) - (256 << 20)
    added = api.add_disk({"id": "rebind", "path": "/dev/null", "image_type": "Raw", "serial": "bc-rebind"})
    assert added["id"] == "rebind"
    api.resize_disk("disk0", 2 << 30)
    assert [d["id"] for d in api.info()["config"]["disks"]] == ["disk0", "rebind"]
    api.remove_device("rebind")
    assert [d["id"] for d in api.info()["config"]["disks"]] == ["disk0"]
    api.pause()
    snap = Path(vmm.path).parent / "snap"
    snap.mkdir()
    api.snapshot(str(snap))
    assert sorted(p.name for p in snap.iterdir()) == ["config.json", "memory-ranges", "state.json"]
    api.shutdown()
    assert api.info()["state"] == "Shutdown"
    api.vmm_shutdown()
    with pytest.raises(CHApiError) as exc:
        api.ping()
    assert exc.value.status == 0


def test_refusals_are_errors_with_the_vmms_message(vmm: FakeCHServer) -> None:
    api = CHApi(vmm.path, timeout_s=5)
    with pytest.raises(CHApiError) as exc:
        api.boot()
    assert exc.value.status == 500 and "not created" in exc.value.detail
    api.create(CONFIG)
    api.boot()
    with pytest.raises(CHApiError) as exc:
        api.resize_balloon(2 << 30)
    assert exc.value.status == 500 and "desired_balloon" in str(exc.value)
    with pytest.raises(CHApiError) as exc:
        api.request("GET", "vm.nonsense")
    assert exc.value.status == 404


@needs_tun
def test_a_tap_fd_reaches_the_vmm_by_scm_rights_dlv_chu_04_dlv_chu_06(vmm: FakeCHServer) -> None:
    """DLV-CHU-04, DLV-CHU-06, DLV-CH-12: vm.add-net sends the opened tap's fd by SCM_RIGHTS; the
    server fstat()s the fd it received and reads its tap name; the body names no tap and no fd."""
    api = CHApi(vmm.path, timeout_s=5)
    api.create(CONFIG)

    def add() -> None:
        fd = open_tap("bctestnic0")
        try:
            out = api.add_net({"id": "net0", "mac": "52:54:00:00:00:01", "tap": "evil0", "fds": [fd]}, fd)
        finally:
            os.close(fd)
        assert out["id"] == "net0"

    in_netns(add)
    assert [(n["id"], n["tap"], n["mac"]) for n in vmm.nets] == [("net0", "bctestnic0", "52:54:00:00:00:01")]
    assert vmm.ignored_fields == []  # neither `tap` nor `fds` went in the body
    assert vmm.requests[-1][0] == "vm.add-net" and vmm.requests[-1][2] == 1
    assert "tap" not in vmm.requests[-1][1] and "fds" not in vmm.requests[-1][1]


@needs_tun
def test_fd_numbers_in_a_body_are_ignored_by_the_vmm(vmm: FakeCHServer) -> None:
    """The server follows the VMM: a NIC whose fd is only a number in the body gets no tap."""
    api = CHApi(vmm.path, timeout_s=5)
    api.create(CONFIG)

    def number_only() -> None:
        fd = open_tap("bctestnic1")
        try:
            with pytest.raises(CHApiError) as exc:
                api.request("PUT", "vm.add-net", {"id": "net0", "fds": [fd]})
            assert "exactly one tap fd" in exc.value.detail
        finally:
            os.close(fd)

    in_netns(number_only)
    assert vmm.ignored_fields == ["vm.add-net.fds"] and vmm.nets == []


def test_a_fd_that_is_not_a_tap_is_refused_by_the_vmm(vmm: FakeCHServer, sockdir: Path) -> None:
    api = CHApi(vmm.path, timeout_s=5)
    api.create(CONFIG)
    (sockdir / "plain").write_bytes(b"x")
    fd = os.open(sockdir / "plain", os.O_RDONLY)
    try:
        with pytest.raises(CHApiError) as exc:
            api.add_net({"id": "net0"}, fd)
    finally:
        os.close(fd)
    assert "not /dev/net/tun" in exc.value.detail and vmm.nets == []


@needs_tun
def test_restore_passes_the_taps_as_net_fds_dlv_chu_07(sockdir: Path) -> None:
    """DLV-CHU-07: a restore sends each NIC's new tap fd by SCM_RIGHTS, named in net_fds; the
    saved configuration's NICs carry no tap name (DLV-CHU-08)."""
    snap = sockdir / "snap"
    snap.mkdir()

    def run() -> None:
        with FakeCHServer(sockdir / "a.sock") as first:
            api = CHApi(first.path, timeout_s=5)
            api.create(CONFIG)
            fd = open_tap("bctestold0")
            try:
                api.add_net({"id": "net0", "mac": "52:54:00:00:00:02"}, fd)
            finally:
                os.close(fd)
            api.boot()
            api.pause()
            api.snapshot(str(snap))
        saved = json.loads((snap / "config.json").read_text())
        assert [n.get("tap") for n in saved["net"]] == [None]  # DLV-CHU-08
        with FakeCHServer(sockdir / "b.sock") as second:
            fd = open_tap("bctestnew0")
            try:
                CHApi(second.path, timeout_s=5).restore(str(snap), [("net0", fd)])
            finally:
                os.close(fd)
            assert [(n["id"], n["tap"]) for n in second.nets] == [("net0", "bctestnew0")]
            body = second.requests[-1][1]
            assert body["net_fds"] == [{"id": "net0", "num_fds": 1}] and second.requests[-1][2] == 1
            assert second.state == "Paused"

    in_netns(run)


def test_no_vmm_and_a_silent_vmm_are_errors_not_hangs(sockdir: Path) -> None:
    with pytest.raises(CHApiError) as exc:
        CHApi(str(sockdir / "none.sock"), timeout_s=1).ping()
    assert exc.value.status == 0
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.bind(str(sockdir / "silent.sock"))
    silent.listen(1)
    try:
        with pytest.raises(CHApiError) as exc:
            CHApi(str(sockdir / "silent.sock"), timeout_s=0.3).ping()
        assert "timed out" in exc.value.detail
    finally:
        silent.close()


def test_an_oversized_or_non_json_answer_is_refused(sockdir: Path) -> None:
    path = str(sockdir / "junk.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(2)
    answers = [
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nnope!",
        b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (5 << 20) + b"x" * (5 << 20),
    ]

    def serve() -> None:
        for answer in answers:
            conn, _ = srv.accept()
            with conn:
                conn.recv(65536)
                with contextlib.suppress(OSError):
                    conn.sendall(answer)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        with pytest.raises(CHApiError, match="not JSON"):
            CHApi(path, timeout_s=5).info()
        with pytest.raises(CHApiError, match="larger than"):
            CHApi(path, timeout_s=5).info()
    finally:
        t.join(5)
        srv.close()
