"""Persistent volumes: the store on a real filesystem with real sparse files, and the pure planner."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from bcd_agent.sections.instances.volumes import (
    GIB,
    MIB,
    Space,
    Volume,
    VolumeRefused,
    VolumeSpec,
    VolumeStore,
    check_volume,
    plan_volumes,
    reserve_for,
)


@pytest.fixture
def store(tmp_path: Path) -> VolumeStore:
    return VolumeStore(str(tmp_path / "volumes"))


def test_a_volume_is_a_sparse_raw_file_with_its_serial_beside_it_dlv_vol_02_03(store: VolumeStore) -> None:
    """DLV-VOL-02, DLV-VOL-03, DLV-VOL-04: `<id>.raw` 0600 of the size, holding no blocks; `<id>.json` the
    serial; grown by truncation, the data kept."""
    store.create(VolumeSpec("data-1", "vol-1", 64 * MIB))
    raw = os.stat(store.raw("data-1"))
    assert stat.S_IMODE(raw.st_mode) == 0o600 and raw.st_size == 64 * MIB
    assert raw.st_blocks == 0
    assert json.loads(Path(store.directory, "data-1.json").read_text())["serial"] == "vol-1"
    vol = store.list()["data-1"]
    assert (vol.serial, vol.size_bytes, vol.unwritten_bytes) == ("vol-1", 64 * MIB, 64 * MIB)
    with open(store.raw("data-1"), "r+b") as f:
        f.write(b"tenant data")
    store.grow(VolumeSpec("data-1", "vol-1", 128 * MIB), vol)
    assert os.stat(store.raw("data-1")).st_size == 128 * MIB
    assert Path(store.raw("data-1")).read_bytes()[:11] == b"tenant data"


def test_a_volume_never_shrinks_dlv_vol_10(store: VolumeStore) -> None:
    """DLV-VOL-10, DLV-VOL-29: a smaller size is refused and the volume keeps its size."""
    store.create(VolumeSpec("v", "s", 4 * MIB))
    with pytest.raises(VolumeRefused, match="never shrink"):
        store.grow(VolumeSpec("v", "s", 2 * MIB), store.list()["v"])
    assert os.stat(store.raw("v")).st_size == 4 * MIB


def test_destroy_punches_the_blocks_out_before_unlinking_dlv_vol_25(store: VolumeStore) -> None:
    """DLV-VOL-25: written blocks are freed by the punch itself: a descriptor still open on the file
    (which an unlink alone would leave holding every block) sees none left; then both files are gone."""
    store.create(VolumeSpec("v", "s", 64 * MIB))
    with open(store.raw("v"), "r+b") as f:
        f.write(os.urandom(8 * MIB))
        f.flush()
        os.fsync(f.fileno())
    assert store.list()["v"].allocated_bytes >= 8 * MIB
    assert store.space().outstanding_bytes <= 56 * MIB
    keep = os.open(store.raw("v"), os.O_RDONLY)
    try:
        store.destroy("v")
        assert os.fstat(keep).st_blocks == 0
        assert os.fstat(keep).st_size == 64 * MIB  # the size kept (KEEP_SIZE): only the blocks went
    finally:
        os.close(keep)
    assert os.listdir(store.directory) == []


def test_a_reservation_refuses_an_overcommit_dlv_vol_28_30(store: VolumeStore) -> None:
    """DLV-VOL-28, DLV-VOL-29, DLV-VOL-30: sparse volumes promise their unwritten space: once one promises
    nearly all that can be promised (less the 5%/2 GiB reserve), a second is refused though nothing was
    written, with the seed's message, and no file is left."""
    store.ensure()
    space = store.space()
    assert space.reserved_bytes == reserve_for(space.total_bytes) >= 2 * GIB
    big = (space.promisable_bytes - 256 * MIB) // 512 * 512
    if big > 0:
        store.create(VolumeSpec("big", "big", big))
        assert store.space().outstanding_bytes >= big
    with pytest.raises(VolumeRefused) as exc:
        store.create(VolumeSpec("second", "second", GIB))
    assert exc.value.message.startswith("volume second: 1024 MiB needed, ")
    assert "MiB can still be promised to volumes on this host (" in exc.value.message
    assert "MiB promised to volumes' unwritten space)" in exc.value.message
    assert not os.path.exists(store.raw("second"))
    if big > 0:
        with pytest.raises(VolumeRefused):
            store.grow(VolumeSpec("big", "big", big + GIB), store.list()["big"])
        assert store.list()["big"].size_bytes == big
        store.destroy("big")


def test_volume_storage_report_dlv_vol_32_36(store: VolumeStore) -> None:
    """DLV-VOL-32..36: statfs total and Bavail, the reserve, sizes and unwritten space summed."""
    store.create(VolumeSpec("a", "a", 8 * MIB))
    store.create(VolumeSpec("b", "b", 4 * MIB))
    with open(store.raw("b"), "r+b") as f:
        f.write(b"x" * MIB)
        os.fsync(f.fileno())
    sp = store.space()
    st = os.statvfs(store.directory)
    assert sp.total_bytes == st.f_blocks * st.f_frsize
    assert abs(sp.available_bytes - st.f_bavail * st.f_frsize) < 64 * MIB
    assert sp.reserved_bytes == max(sp.total_bytes // 20, 2 * GIB)
    assert sp.committed_bytes == 12 * MIB
    assert 10 * MIB <= sp.outstanding_bytes <= 11 * MIB


@pytest.mark.parametrize(
    ("vol", "rule"),
    [
        (VolumeSpec("", "s", 512), "volume id"),
        (VolumeSpec("x" * 81, "s", 512), "volume id"),
        (VolumeSpec("a.b", "s", 512), "volume id"),
        (VolumeSpec("ok", "", 512), "serial"),
        (VolumeSpec("ok", "UPPER", 512), "serial"),
        (VolumeSpec("ok", "x" * 21, 512), "serial"),
        (VolumeSpec("ok", "s", 0), "multiple of 512"),
        (VolumeSpec("ok", "s", 1000), "multiple of 512"),
    ],
)
def test_ids_serials_and_sizes_dlv_vol_05_06_07(vol: VolumeSpec, rule: str) -> None:
    """DLV-VOL-05, DLV-VOL-06, DLV-VOL-07."""
    problem = check_volume(vol)
    assert problem is not None and rule in problem
    assert check_volume(VolumeSpec("A_b-9" * 16, "a-9" * 6, 1024)) is None
    # Each rule's accepting edge: a 1-character id and serial, a 20-character serial, 512 bytes.
    assert check_volume(VolumeSpec("a", "b", 512)) is None
    assert check_volume(VolumeSpec("Z", "0-" * 10, 512 * 3)) is None


def test_overcommit_bound_at_the_byte_dlv_vol_28_29_30() -> None:
    """DLV-VOL-28..30: a volume needing exactly what can be promised (available 10 GiB, less the
    reserve, less 1 GiB unwritten, less what the pass promised) is created; 512 bytes more is refused
    with every figure of the seed's message."""
    space = Space(100 * GIB, 10 * GIB, 5 * GIB, 0, GIB)  # 4 GiB can be promised
    exact = [VolumeSpec("a", "a", 3 * GIB), VolumeSpec("b", "b", GIB)]
    p = plan_volumes(exact, [], {}, {}, space)
    assert [s.volume.id for s in p.before] == ["a", "b"] and not p.refused
    over = [VolumeSpec("a", "a", 3 * GIB), VolumeSpec("b", "b", GIB + 512)]
    p = plan_volumes(over, [], {}, {}, space)
    assert [s.volume.id for s in p.before] == ["a"]
    assert p.refused == {
        "b": "volume b: 1024 MiB needed, 1024 MiB can still be promised to volumes on this host "
        "(10240 MiB free, 5120 MiB reserved, 4096 MiB promised to volumes' unwritten space)"
    }


# --- the planner ----------------------------------------------------------------------------------

ROOMY = Space(100 * GIB, 50 * GIB, 5 * GIB, 0, 0)


def test_creates_and_growths_come_first_shrinks_refused_dlv_vol_08_09() -> None:
    """DLV-VOL-08, DLV-VOL-09, DLV-VOL-10, DLV-VOL-23: missing volumes are created and grown ones grown
    before instances are defined; a shrink is refused and fails (without stopping) who attaches it."""
    stored = {"old": Volume("old", "o", 2 * GIB, 0), "small": Volume("small", "s", GIB, 0)}
    vols = [VolumeSpec("new", "n", GIB), VolumeSpec("old", "o", GIB), VolumeSpec("small", "s", 2 * GIB)]
    p = plan_volumes(vols, [("vm", (("old", False),), True)], {"vm": (("old", False),)}, stored, ROOMY)
    assert [(s.kind, s.volume.id) for s in p.before] == [("create", "new"), ("grow", "small")]
    assert "never shrink" in p.refused["old"] and "never shrink" in p.errors["vm"]
    assert p.after == ()


def test_overcommit_refused_in_the_plan_dlv_vol_29() -> None:
    """DLV-VOL-29: what the earlier volumes of the pass promised counts against the later ones."""
    space = Space(100 * GIB, 10 * GIB, 5 * GIB, 0, GIB)  # 4 GiB can be promised
    vols = [VolumeSpec("a", "a", 3 * GIB), VolumeSpec("b", "b", 2 * GIB)]
    p = plan_volumes(vols, [("vm", (("b", False),), True)], {}, {}, space)
    assert [s.volume.id for s in p.before] == ["a"]
    assert p.refused["b"].startswith("volume b: 2048 MiB needed, 1024 MiB can still be promised")
    assert p.errors["vm"] == p.refused["b"]


def test_one_writer_first_in_spec_order_keeps_it_dlv_vol_17_18_19() -> None:
    """DLV-VOL-17, DLV-VOL-18, DLV-VOL-19: a second writer, a reader beside a writer (starting or
    running), or a writer beside readers, is refused; the first in spec order keeps the volume;
    readers share it. DLV-VOL-24: a running reader beside a running writer lets go."""
    vols = [VolumeSpec("v", "v", GIB)]
    stored = {"v": Volume("v", "v", GIB, 0)}
    p = plan_volumes(vols, [("a", (("v", False),), True), ("b", (("v", False),), True)], {}, stored, ROOMY)
    assert set(p.errors) == {"b"} and "open for writing by instance a" in p.errors["b"]
    p = plan_volumes(vols, [("r1", (("v", True),), True), ("r2", (("v", True),), True)], {}, stored, ROOMY)
    assert p.errors == {}
    p = plan_volumes(vols, [("r", (("v", True),), True), ("w", (("v", False),), True)], {}, stored, ROOMY)
    assert "a writer needs it alone" in p.errors["w"]
    # DLV-VOL-17 itself: a reader beside a writer, one starting in this pass or one running, is refused.
    att = [("w", (("v", False),), True), ("r", (("v", True),), True)]
    for held in ({}, {"w": (("v", False),)}):
        p = plan_volumes(vols, att, held, stored, ROOMY)
        assert p.errors == {"r": "volume v is open for writing by instance w"}, held
    # Both running already: the reader, later in spec order, lets go (DLV-VOL-24).
    p = plan_volumes(vols, att, {"w": (("v", False),), "r": (("v", True),)}, stored, ROOMY)
    assert set(p.errors) == {"r"} and p.errors["r"].startswith(
        "volume v is open for writing by instance w: stopped so that it lets go"
    )


def test_open_volumes_tracked_from_running_domains_dlv_vol_21_22() -> None:
    """DLV-VOL-21, DLV-VOL-22: a running domain that has the volume open keeps it even when a later
    spec puts another writer first; a stopped one (not held) lets it go (DLV-VOL-20)."""
    vols = [VolumeSpec("v", "v", GIB)]
    stored = {"v": Volume("v", "v", GIB, 0)}
    att = [("new", (("v", False),), True), ("old", (("v", False),), True)]
    p = plan_volumes(vols, att, {"old": (("v", False),)}, stored, ROOMY)
    assert set(p.errors) == {"new"}
    p = plan_volumes(vols, att, {}, stored, ROOMY)
    assert set(p.errors) == {"old"}


def test_unlisted_volumes_destroyed_unless_open_dlv_vol_25_26_27() -> None:
    """DLV-VOL-25, DLV-VOL-26, DLV-VOL-27: a volume no longer listed is destroyed after the pass, unless a
    running domain has it open (one stopped or deleted in this pass is not held: it goes)."""
    stored = {"gone": Volume("gone", "g", GIB, 0), "open": Volume("open", "o", GIB, 0)}
    p = plan_volumes([], [], {"vm": (("open", False),)}, stored, ROOMY)
    assert [(s.kind, s.volume.id) for s in p.after] == [("destroy", "gone")]
    p = plan_volumes([], [], {}, stored, ROOMY)
    assert {s.volume.id for s in p.after} == {"gone", "open"}
    # "and no instance attaches": an unlisted volume a stopped instance of the spec still names stays
    # (the instance fails on it); so does a listed one whose entry breaks a rule (a typo in the spec
    # never destroys a volume).
    p = plan_volumes([], [("vm", (("gone", False),), False)], {}, stored, ROOMY)
    assert [s.volume.id for s in p.after] == ["open"] and "not a volume of this host's section" in p.errors[
        "vm"
    ]
    p = plan_volumes([VolumeSpec("gone", "BAD", GIB), VolumeSpec("open", "o", 1000)], [], {}, stored, ROOMY)
    assert p.after == () and set(p.refused) == {"gone", "open"}


def test_an_unlisted_attachment_fails_its_instance() -> None:
    p = plan_volumes([], [("vm", (("nope", False),), False)], {}, {}, ROOMY)
    assert "not a volume of this host's section" in p.errors["vm"]


def test_live_resize_for_every_holder_dlv_vol_11() -> None:
    """DLV-VOL-11: a grown volume is resized in every running or paused guest that has it open."""
    stored = {"v": Volume("v", "v", GIB, 0)}
    held = {"a": (("v", True),), "b": (("v", True),)}
    p = plan_volumes([VolumeSpec("v", "v", 2 * GIB)], [], held, stored, ROOMY)
    assert sorted(p.resize) == [("a", "v", 2 * GIB), ("b", "v", 2 * GIB)]
