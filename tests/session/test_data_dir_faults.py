"""The data_dir's storage failing under a running node (issue 16, item 3).

- ENOSPC: the node's data_dir on a small tmpfs the test mounts (as root) and fills. The node stays up,
  answers new commands BUSY, keeps its session, raises `DataDirFull`, logs the change once, and once the
  space returns runs the command the gateway redelivers and clears the condition by itself.
- EIO on fsync: an LD_PRELOAD shim (built here with the C compiler) makes fsync/fdatasync of the journal
  fail with EIO; the real `bcd node` ends with status 1 and one line naming the file and the error, no
  traceback (as PostgreSQL does on a failed fsync).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from bcd_agent.config import load_config
from bcd_agent.devplane.plane import DevPlane
from bcd_agent.join import join
from bcd_agent.kinds.testing import effect_payload
from bcd_agent.node import Node, NodeOptions
from bcd_agent.session.conditions import DATA_DIR_FULL
from bcd_shared import wire
from bcd_simhost.seed import seed
from testsupport import IN_CI

pytestmark = pytest.mark.slow


def _require_root_mount() -> None:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        if IN_CI:
            pytest.fail("the ENOSPC test mounts a tmpfs: it needs root and mount(8) under CI")
        pytest.skip("mounting a tmpfs needs root")


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs, mode 0700, for the node's data_dir."""
    _require_root_mount()
    mnt = tmp_path / "data"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(directory: Path) -> Path:
    """Write a file until the file system is full; returns it."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for size in (65536, 4096, 512):  # coarse to fine, to the last block
            while True:
                try:
                    os.write(fd, b"\0" * size)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC
                    break
    finally:
        os.close(fd)
    return filler


async def _until(what: str, check: Callable[[], Any], within: float) -> Any:
    with trio.move_on_after(within):
        while not (got := check()):  # noqa: ASYNC110 - polls state other tasks change
            await trio.sleep(0.05)
        return got
    raise AssertionError(f"timed out waiting for {what} ({within} s)")


async def test_a_full_data_dir_answers_busy_keeps_the_session_and_resumes(
    tmp_path: Path, small_fs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    os.chmod(tmp_path, 0o755)
    root = tmp_path / "host"
    seed(root)
    sock = tmp_path / "gw.sock"
    plane = DevPlane(tmp_path / "dp", listen=None, unix_socket=sock)
    toml = tmp_path / "node.toml"
    toml.write_text(f'data_dir = "{small_fs}"\n[control_plane]\nunix_socket = "{sock}"\n')
    config = load_config(str(toml))
    caplog.set_level(logging.INFO)
    async with trio.open_nursery() as nursery:
        await nursery.start(plane.run)
        identity = await join(config, token=plane.issue_token(), address=f"unix:{sock}")
        node = Node(config, NodeOptions(root=str(root), sections=False, test_kinds=True, heartbeat_s=0.2))
        await nursery.start(node.run)
        await _until("the session", lambda: node.core.state.welcomed, 20)
        epoch = node.core.state.epoch
        filler = _fill(small_fs)
        url, value = effect_payload("disk")
        cid = plane.enqueue(identity.node_id, "test.echo", wire.ProtoAny(type_url=url, value=value))
        plane.poke()

        def busy_answers() -> int:
            rows = plane.store.all("SELECT state FROM updates WHERE command_id = ?", cid)
            return sum(1 for r in rows if r["state"] == "busy")

        await _until("a BUSY answer", lambda: busy_answers() >= 1, 20)
        assert node.core.conditions.has(DATA_DIR_FULL)
        # Heartbeats and redeliveries keep failing to write meanwhile: the command is redelivered and
        # answered BUSY again (waited for: a loaded machine's redelivery is late), in the same session.
        await _until("a second BUSY answer", lambda: busy_answers() >= 2, 30)
        assert node.core.state.welcomed and node.core.state.epoch == epoch  # the same session, still up
        record = plane.command(cid)
        assert record is not None and record["state"] == "pending"
        status = plane.node(identity.node_id)
        conditions = [c["type"] for c in ((status or {}).get("status") or {}).get("conditions", [])]
        assert DATA_DIR_FULL in conditions, status
        filler.unlink()
        await _until(
            "the command run once space returned",
            lambda: (c := plane.command(cid)) is not None and c["state"] == "succeeded",
            30,
        )
        await _until("the condition cleared", lambda: not node.core.conditions.has(DATA_DIR_FULL), 10)
        nursery.cancel_scope.cancel()
    full_lines = [r for r in caplog.records if "data_dir is full" in r.getMessage()]
    back_lines = [r for r in caplog.records if "has space again" in r.getMessage()]
    assert len(full_lines) == 1 and len(back_lines) == 1, [r.getMessage() for r in full_lines + back_lines]
    assert "Traceback" not in caplog.text


SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* fsync and fdatasync of any journal.db* file fail with EIO once $BCD_TEST_EIO_TRIGGER exists. */
static int fail(int fd) {
    const char *trigger = getenv("BCD_TEST_EIO_TRIGGER");
    if (trigger == NULL || access(trigger, F_OK) != 0) return 0;
    char link[64], path[4096];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, sizeof path - 1);
    if (n < 0) return 0;
    path[n] = 0;
    return strstr(path, "journal.db") != NULL;
}

int fsync(int fd) {
    static int (*real)(int);
    if (real == NULL) real = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
    if (fail(fd)) { errno = EIO; return -1; }
    return real(fd);
}

int fdatasync(int fd) {
    static int (*real)(int);
    if (real == NULL) real = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
    if (fail(fd)) { errno = EIO; return -1; }
    return real(fd);
}
"""


def _shim(tmp_path: Path) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        if IN_CI:
            pytest.fail("the EIO test builds an LD_PRELOAD shim: a C compiler is needed under CI")
        pytest.skip("no C compiler for the LD_PRELOAD shim")
    src, lib = tmp_path / "eio.c", tmp_path / "eio.so"
    src.write_text(SHIM)
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(lib), str(src), "-ldl"], check=True)
    return lib


async def test_eio_on_fsync_ends_the_node_with_one_line_naming_the_file(tmp_path: Path) -> None:
    from bcd_agent.bench.nodeproc import node_world

    lib = _shim(tmp_path)
    trigger = tmp_path / "eio-now"
    async with node_world(tmp_path / "w") as world:
        config = world.write_config(world.layout.gateway_socket)
        argv = [sys.executable, "-m", "bcd_agent.cli", "node", "--config", str(config)]
        argv += ["--root", str(world.layout.root), "--test-kinds"]
        env = {**os.environ, "LD_PRELOAD": str(lib), "BCD_TEST_EIO_TRIGGER": str(trigger)}
        log = tmp_path / "node.log"
        with log.open("wb") as out:
            proc = await trio.lowlevel.open_process(argv, stdout=out, stderr=out, env=env)
            try:
                await world.session()
                trigger.touch()
                url, value = effect_payload("eio")
                world.plane.enqueue(world.node_id, "test.echo", wire.ProtoAny(type_url=url, value=value))
                world.plane.poke()
                with trio.fail_after(30):
                    code = await proc.wait()
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
    text = log.read_text()
    assert code == 1, text
    assert "Traceback" not in text, text
    fatal = [line for line in text.splitlines() if line.startswith("bcd node: storage failure")]
    assert len(fatal) == 1, text
    # Either SQLite's own fsync at a durable commit (its error name) or the journal's group fsync (errno).
    assert "journal.db" in fatal[0] and ("SQLITE_IOERR" in fatal[0] or "errno 5" in fatal[0]), fatal[0]
