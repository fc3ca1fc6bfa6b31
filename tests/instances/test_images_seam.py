"""bcd_shared.images, the seam tenant images build on (issue 10 deliverable 3 extends it): real qemu-img
images of each variant the runtime relies on, built in the test."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from bcd_shared.images import ImageRefused, check_image, check_overlay
from testsupport import qemu_img_create

GIB = 1 << 30


def _img(tmp: Path, name: str, *opts: str, size: int = GIB) -> Path:
    return qemu_img_create(tmp / name, size, *opts)


def _refused(path: Path, reason: str, cap: int = 1 << 40) -> str:
    with pytest.raises(ImageRefused) as exc:
        check_image(str(path), cap)
    assert exc.value.reason == reason, exc.value.message
    return exc.value.message


def test_flat_qcow2_v3_and_v2_are_accepted_dlv_img_04(tmp_path: Path) -> None:
    """DLV-IMG-04 (accepted half): versions 2 and 3."""
    assert check_image(str(_img(tmp_path, "v3.qcow2")), 1 << 40).version == 3
    assert check_image(str(_img(tmp_path, "v2.qcow2", "-o", "compat=0.10")), 1 << 40).version == 2


def test_a_backing_file_is_refused_dlv_img_05(tmp_path: Path) -> None:
    """DLV-IMG-05."""
    base = _img(tmp_path, "base.qcow2")
    over = _img(tmp_path, "over.qcow2", "-u", "-b", str(base), "-F", "qcow2")
    assert "names a backing file" in _refused(over, "backing-file")
    assert check_overlay(str(over), str(base), "qcow2", 1 << 40).backing_file == str(base)
    with pytest.raises(ImageRefused):
        check_overlay(str(over), str(tmp_path / "other.qcow2"), "qcow2", 1 << 40)


def test_a_data_file_is_refused_dlv_img_06(tmp_path: Path) -> None:
    """DLV-IMG-06: incompatible bit 2 (qemu-img also writes the data-file extension)."""
    img = _img(tmp_path, "df.qcow2", "-o", f"data_file={tmp_path / 'data.raw'}")
    _refused(img, "data-file")
    # the extension alone, with the bit cleared, is refused too
    data = bytearray(img.read_bytes())
    (incompat,) = struct.unpack_from(">Q", data, 72)
    struct.pack_into(">Q", data, 72, incompat & ~4)
    img.write_bytes(bytes(data))
    assert "data-file extension" in _refused(img, "data-file")


def test_encryption_is_refused_dlv_img_08(tmp_path: Path) -> None:
    """DLV-IMG-08: LUKS (crypt_method 2)."""
    img = _img(
        tmp_path,
        "luks.qcow2",
        "--object",
        "secret,id=s0,data=x",
        "-o",
        "encrypt.format=luks,encrypt.key-secret=s0",
    )
    assert "LUKS" in _refused(img, "encrypted")


def test_unknown_bits_versions_truncation_and_size_dlv_img_04_07(tmp_path: Path) -> None:
    """DLV-IMG-04, DLV-IMG-07: an unknown incompatible bit, version 4, a truncated header, a size cap."""
    good = _img(tmp_path, "good.qcow2").read_bytes()
    bit = bytearray(good)
    struct.pack_into(">Q", bit, 72, 1 << 20)
    (tmp_path / "bit.qcow2").write_bytes(bytes(bit))
    _refused(tmp_path / "bit.qcow2", "unknown-feature")
    v4 = bytearray(good)
    struct.pack_into(">I", v4, 4, 4)
    (tmp_path / "v4.qcow2").write_bytes(bytes(v4))
    _refused(tmp_path / "v4.qcow2", "not-qcow2")
    (tmp_path / "short.qcow2").write_bytes(good[:90])
    _refused(tmp_path / "short.qcow2", "truncated")
    (tmp_path / "raw.img").write_bytes(b"\0" * 4096)
    _refused(tmp_path / "raw.img", "not-qcow2")
    big = _img(tmp_path, "big.qcow2", size=4 * GIB)
    assert "above the cap" in _refused(big, "too-large", cap=GIB)


def test_a_symlink_is_never_followed(tmp_path: Path) -> None:
    img = _img(tmp_path, "real.qcow2")
    (tmp_path / "link.qcow2").symlink_to(img)
    _refused(tmp_path / "link.qcow2", "not-regular")
