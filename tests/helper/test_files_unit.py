"""file.write and file.remove called in process over a temporary root, without command-signing roots: the
kinds, the content rules and the per-kind limits, each refusal word for word, the path and mode written
(HST-ROOT-08, issue 9 item 8; docs/mutation.md). The signed-devices rules are driven through a real
helper in test_signed_holds.py."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from bcd_helper.ops import files
from bcd_helper.ops.base import HelperContext, Refused
from bcd_helper.ops.files import MAX_CONTENT, FileRemove, FileWrite, file_remove, file_write
from bcd_shared import cdi
from opskit import call, context, make_root

ALLOC = "a1"
GPU1 = "GPU-5f1c2a90-0000-4000-8000-000000000001"


@pytest.fixture
def ctx(tmp_path: Path) -> Iterator[HelperContext]:
    c = context(make_root(tmp_path))
    yield c
    c.audit.close()


def refused(ctx: HelperContext, req: Any) -> tuple[str, str]:
    fn = file_write if isinstance(req, FileWrite) else file_remove
    with pytest.raises(Refused) as info:
        fn(call(ctx), req)
    return info.value.reason, info.value.message


def env(ident: str = ALLOC, extra: str = "") -> FileWrite:
    return FileWrite("allocation-env", ident, f"BCD_ALLOCATION_ID={ident}\n{extra}")


def hold(ident: str = ALLOC, edits: dict[str, Any] | None = None, env_lines: list[str] | None = None) -> str:
    devices = [
        cdi.HoldDevice(f"{GPU1}", edits if edits is not None else {"deviceNodes": [{"path": "/dev/nvidia0"}]})
    ]
    doc = cdi.build_hold_spec(
        allocation_id=ident,
        reservation_id="r1",
        generation=1,
        kubernetes=False,
        cgroup_parent=None,
        devices=devices,
        env=env_lines if env_lines is not None else [f"BCD_ALLOCATION_ID={ident}"],
        vendor=None,
    )
    return cdi.encode_spec(doc).decode()


def vendor(root: Path, devices: dict[str, dict[str, Any]], common: dict[str, Any] | None = None) -> None:
    doc: dict[str, Any] = {
        "cdiVersion": "0.6.0",
        "kind": "nvidia.com/gpu",
        "devices": [{"name": n, "containerEdits": e} for n, e in devices.items()],
    }
    if common:
        doc["containerEdits"] = common
    (root / "etc/cdi").mkdir(parents=True, exist_ok=True)
    (root / "etc/cdi/nvidia.json").write_text(json.dumps(doc))


# --- kinds and ids ----------------------------------------------------------------------------------------


def test_an_unknown_kind_or_a_bad_id_is_refused(ctx: HelperContext) -> None:
    assert refused(ctx, FileWrite("sshd", "x", "")) == (
        "bad-kind",
        "file kind 'sshd' is not one the helper writes (cdi, allocation-env, k8s-token)",
    )
    assert refused(ctx, FileRemove("../x", "x")) == (
        "bad-kind",
        "file kind '../x' is not one the helper writes (cdi, allocation-env, k8s-token)",
    )
    for bad in ["", "a-b", "a/b", "x" * 81, "a\n"]:
        assert refused(ctx, FileWrite("cdi", bad, "")) == (
            "bad-id",
            f"cdi: id {bad!r} must be an allocation id ([A-Za-z0-9_]{{1,80}})",
        )
    assert refused(ctx, FileWrite("k8s-token", "x", "")) == ("bad-id", "k8s-token: id 'x' must be empty")
    assert refused(ctx, FileRemove("allocation-env", "..")) == (
        "bad-id",
        "allocation-env: id '..' must be an allocation id ([A-Za-z0-9_]{1,80})",
    )


# --- allocation-env ---------------------------------------------------------------------------------------


def test_an_env_file_is_written_0644_at_its_path(ctx: HelperContext) -> None:
    ident = "A_z9" + "x" * 76
    got = file_write(call(ctx), env(ident, "FOO=bar\n"))
    path = f"/run/bcd/allocations/{ident}.env"
    assert got == {"path": path, "bytes": len(f"BCD_ALLOCATION_ID={ident}\nFOO=bar\n")}
    on_disk = ctx.root / path.lstrip("/")
    assert on_disk.read_text() == f"BCD_ALLOCATION_ID={ident}\nFOO=bar\n"
    assert os.stat(on_disk).st_mode & 0o777 == 0o644
    assert file_remove(call(ctx), FileRemove("allocation-env", ident)) == {"path": path, "removed": True}
    assert not on_disk.exists()
    assert file_remove(call(ctx), FileRemove("allocation-env", ident)) == {"path": path, "removed": False}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("BCD_ALLOCATION_ID=a1\nX=1", "allocation-env: must end with a newline"),
        ("BCD_ALLOCATION_ID=a1\nX=\x01\n", "allocation-env: carries a control character"),
        ("BCD_ALLOCATION_ID=a1\nX=\x7f\n", "allocation-env: carries a control character"),
        ("BCD_ALLOCATION_ID=a1\nX=\x85\n", "allocation-env: carries a control character"),
        ("BCD_ALLOCATION_ID=a1\nX=\u2028\n", "allocation-env: carries a control character"),
        ("BCD_ALLOCATION_ID=a1\nX=\u2029\n", "allocation-env: carries a control character"),
        ("BCD_ALLOCATION_ID=a1\nX=\t\n", "allocation-env: carries a control character"),
        ("BCD_ALLOCATION_ID=a1\nX=1\nX=2\n", "allocation-env: 'X' is set twice"),
    ],
)
def test_a_bad_env_file_is_refused_naming_the_rule(ctx: HelperContext, content: str, message: str) -> None:
    assert refused(ctx, FileWrite("allocation-env", ALLOC, content)) == ("bad-content", message)


def test_an_env_file_keeps_printable_text_above_the_c1_range(ctx: HelperContext) -> None:
    file_write(call(ctx), env(extra="X=\xa0é\u2030\n"))


def test_an_env_file_must_start_with_its_allocation(ctx: HelperContext) -> None:
    reason, message = refused(ctx, FileWrite("allocation-env", ALLOC, "BCD_ALLOCATION_ID=other\n"))
    assert reason == "bad-content" and message.startswith("allocation-env: ")


def test_content_must_be_utf8_text_of_the_kinds_encoding(ctx: HelperContext) -> None:
    assert refused(ctx, FileWrite("allocation-env", ALLOC, "x", encoding="base64")) == (
        "bad-content",
        "allocation-env: content must be sent as utf-8",
    )
    assert refused(ctx, FileWrite("allocation-env", ALLOC, "BCD_ALLOCATION_ID=a1\n\udc80\n")) == (
        "bad-content",
        "allocation-env: content is not UTF-8",
    )


def test_content_size_limits(ctx: HelperContext) -> None:
    assert refused(ctx, FileWrite("cdi", ALLOC, "x" * (2 * MAX_CONTENT + 1))) == (
        "too-large",
        f"cdi: content larger than {MAX_CONTENT} bytes",
    )
    assert refused(ctx, FileWrite("cdi", ALLOC, "é" * (MAX_CONTENT // 2 + 1))) == (
        "too-large",
        f"cdi: content larger than {MAX_CONTENT} bytes",
    )
    big = "BCD_ALLOCATION_ID=a1\nX=" + "y" * (64 * 1024 - 24) + "\n"
    assert len(big.encode()) == 64 * 1024
    file_write(call(ctx), FileWrite("allocation-env", ALLOC, big))
    assert refused(ctx, FileWrite("allocation-env", ALLOC, big[:-1] + "yy\n")) == (
        "too-large",
        f"allocation-env: content larger than {64 * 1024} bytes",
    )


def test_a_kind_keeps_at_most_its_files_and_bytes(
    ctx: HelperContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    limit = files.LIMITS["allocation-env"]
    monkeypatch.setitem(
        files.LIMITS,
        "allocation-env",
        files.KindLimit(limit.directory, limit.pattern, 3, 200, limit.max_file),
    )
    for ident in ("a1", "a2", "a3"):
        file_write(call(ctx), env(ident))
    (ctx.root / "run/bcd/allocations/notes.txt").write_text("x" * 500)  # another name does not count
    file_write(call(ctx), env("a3", "X=1\n"))  # replacing one counts its new size, not twice
    assert refused(ctx, env("a4")) == (
        "too-many-files",
        "allocation-env: root keeps at most 3 files in /run/bcd/allocations",
    )
    file_remove(call(ctx), FileRemove("allocation-env", "a3"))
    assert refused(ctx, env("a4", "X=" + "y" * 135 + "\n")) == (
        "too-many-files",
        "allocation-env: root keeps at most 200 bytes in all in /run/bcd/allocations",
    )
    file_write(call(ctx), env("a4", "X=" + "y" * 134 + "\n"))  # 21 + 21 + 158 bytes: exactly 200


# --- k8s-token --------------------------------------------------------------------------------------------


def test_HST_K8S_52_a_bootstrap_token_is_written_0600_where_the_join_reads_it(ctx: HelperContext) -> None:
    got = file_write(call(ctx), FileWrite("k8s-token", "", "abcdef.0123456789abcdef\n"))
    path = ctx.root / "var/lib/bcd-hostconfig/k8s/bootstrap-token"
    assert got["path"] == "/var/lib/bcd-hostconfig/k8s/bootstrap-token"
    assert os.stat(path).st_mode & 0o777 == 0o600
    file_write(call(ctx), FileWrite("k8s-token", "", "abcdef.0123456789abcdef"))
    for bad in [
        "ABCDEF.0123456789abcdef",
        "abcdef.0123456789abcde",
        "abcdef0123456789abcdef0",
        "abcdef.0123456789abcdef\n\n",
    ]:
        assert refused(ctx, FileWrite("k8s-token", "", bad)) == (
            "bad-content",
            "k8s-token: not a kubeadm bootstrap token ([a-z0-9]{6}.[a-z0-9]{16})",
        )


# --- cdi --------------------------------------------------------------------------------------------------


def test_a_hold_is_written_at_its_path(ctx: HelperContext) -> None:
    vendor(ctx.root, {"0": {"deviceNodes": [{"path": "/dev/nvidia0"}]}})
    got = file_write(call(ctx), FileWrite("cdi", ALLOC, hold()))
    assert got["path"] == f"/etc/cdi/bcd-{ALLOC}.json"
    assert os.stat(ctx.root / f"etc/cdi/bcd-{ALLOC}.json").st_mode & 0o777 == 0o644


def test_a_hold_that_is_not_strict_json_or_not_a_hold_is_refused(ctx: HelperContext) -> None:
    assert refused(ctx, FileWrite("cdi", ALLOC, '{"a":1,"a":2}')) == (
        "bad-content",
        "cdi: not strict JSON: key 'a' appears twice",
    )
    reason, message = refused(ctx, FileWrite("cdi", ALLOC, "{}"))
    assert reason == "bad-content" and message.startswith("cdi: ") and "strict JSON" not in message
    reason, message = refused(ctx, FileWrite("cdi", "a2", hold("a1")))
    assert reason == "bad-content" and message.startswith("cdi: ")


def test_a_holds_env_names_only_its_allocation_once(ctx: HelperContext) -> None:
    vendor(ctx.root, {"0": {"deviceNodes": [{"path": "/dev/nvidia0"}]}})
    assert refused(ctx, FileWrite("cdi", ALLOC, hold(env_lines=["BCD_ALLOCATION_ID=a1", "X=1", "X=2"]))) == (
        "bad-content",
        "cdi: containerEdits.env: 'X' is set twice",
    )
    assert refused(ctx, FileWrite("cdi", ALLOC, hold(env_lines=["X=1", "BCD_ALLOCATION_ID=other"]))) == (
        "bad-content",
        "cdi: containerEdits.env: BCD_ALLOCATION_ID must be a1",
    )


def device_edits(edits: dict[str, Any]) -> str:
    """A hold whose one device's containerEdits are exactly `edits` (build_hold_spec would set them)."""
    doc = json.loads(hold())
    doc["devices"][0]["containerEdits"] = edits
    return json.dumps(doc)


def test_a_hold_device_carries_no_env_but_its_own_marker(ctx: HelperContext) -> None:
    marker = cdi.device_marker_env(GPU1)
    file_write(call(ctx), FileWrite("cdi", ALLOC, device_edits({"env": [marker]})))
    node = {"path": "/dev/nvidia0"}
    for edits in ({"env": [marker, "X=1"]}, {"env": ["X=1"]}, {"env": [marker], "deviceNodes": [node]}):
        assert refused(ctx, FileWrite("cdi", ALLOC, device_edits(edits))) == (
            "bad-content",
            "cdi: devices[0].containerEdits.env: a hold's devices carry no env (only a device without other "
            "edits, its own BCD_DEVICE_ marker)",
        )


def test_a_hold_carries_only_the_vendors_edits(ctx: HelperContext) -> None:
    hook = {"hooks": [{"hookName": "createContainer", "path": "/tmp/evil"}]}
    assert refused(ctx, FileWrite("cdi", ALLOC, hold(edits=hook))) == (
        "bad-content",
        'cdi: devices[0].containerEdits.hooks: {"hookName":"createContainer","path":"/tmp/evil"} is not in '
        "root's vendor spec /etc/cdi/nvidia.json: a hold carries only the vendor's edits",
    )
    vendor(
        ctx.root,
        {"0": {"deviceNodes": [{"path": "/dev/nvidia0"}], "env": ["NVIDIA_VISIBLE_DEVICES=0"]}},
        common={"mounts": [{"hostPath": "/usr/lib/x", "containerPath": "/usr/lib/x"}]},
    )
    file_write(call(ctx), FileWrite("cdi", ALLOC, hold()))
    file_write(
        call(ctx),
        FileWrite(
            "cdi", ALLOC, hold(edits={"mounts": [{"hostPath": "/usr/lib/x", "containerPath": "/usr/lib/x"}]})
        ),
    )
    assert refused(ctx, FileWrite("cdi", ALLOC, hold(edits={"deviceNodes": [{"path": "/dev/nvidia1"}]})))[
        1
    ].startswith(
        'cdi: devices[0].containerEdits.deviceNodes: {"path":"/dev/nvidia1"} is not in root\'s vendor spec'
    )


def test_an_unreadable_vendor_spec_refuses_edits(ctx: HelperContext) -> None:
    (ctx.root / "etc/cdi").mkdir(parents=True)
    (ctx.root / "etc/cdi/nvidia.json").write_text("[")
    reason, message = refused(ctx, FileWrite("cdi", ALLOC, hold()))
    assert reason == "bad-content" and message.startswith("cdi: root's /etc/cdi/nvidia.json: ")


def test_spaces_are_text_and_a_key_is_what_comes_before_the_first_equals(ctx: HelperContext) -> None:
    file_write(call(ctx), env(extra="X=a b\n"))
    assert refused(ctx, env(extra="A=b=c\nA=d\n")) == ("bad-content", "allocation-env: 'A' is set twice")
    long_key = "K" * 150
    assert refused(ctx, env(extra=f"{long_key}=1\n{long_key}=2\n")) == (
        "bad-content",
        f"allocation-env: {'K' * 100!r} is set twice",
    )


def test_a_spec_level_edit_outside_the_vendors_is_named_there(ctx: HelperContext) -> None:
    doc = json.loads(hold())
    doc["containerEdits"]["mounts"] = [{"hostPath": "/", "containerPath": "/host"}]
    assert refused(ctx, FileWrite("cdi", ALLOC, json.dumps(doc))) == (
        "bad-content",
        'cdi: containerEdits.mounts: {"containerPath":"/host","hostPath":"/"} is not in root\'s vendor spec '
        "/etc/cdi/nvidia.json: a hold carries only the vendor's edits",
    )


def test_a_symlink_in_a_kinds_directory_counts_as_itself(ctx: HelperContext, tmp_path: Path) -> None:
    limit = files.LIMITS["allocation-env"]
    files.LIMITS["allocation-env"] = files.KindLimit(limit.directory, limit.pattern, 10, 200, limit.max_file)
    try:
        file_write(call(ctx), env("a1"))
        (tmp_path / "big").write_bytes(b"x" * 10_000)
        (ctx.root / "run/bcd/allocations/z9.env").symlink_to(tmp_path / "big")
        file_write(call(ctx), env("a2"))  # the link's own size counts, not its target's
    finally:
        files.LIMITS["allocation-env"] = limit


# --- edges the mutation run found unchecked (docs/mutation.md) ----------------------------------------------


def test_a_hold_for_another_allocation_is_named_before_its_env(ctx: HelperContext) -> None:
    assert refused(ctx, FileWrite("cdi", "a2", hold("a1"))) == (
        "bad-content",
        "cdi: annotations.bcd.dev/allocation-id: 'a1' is not the file's allocation 'a2'",
    )


def test_every_device_of_a_hold_is_checked_for_env(ctx: HelperContext) -> None:
    """A first device without env, or with exactly its marker, does not end the check."""
    vendor(ctx.root, {"0": {"deviceNodes": [{"path": "/dev/nvidia0"}]}})
    gpu2 = "GPU-5f1c2a90-0000-4000-8000-000000000002"
    for first in ({"deviceNodes": [{"path": "/dev/nvidia0"}]}, {"env": [cdi.device_marker_env(GPU1)]}):
        doc = json.loads(hold())
        second = json.loads(json.dumps(doc["devices"][0]).replace(GPU1, gpu2))
        second["containerEdits"] = {"env": ["X=1"]}
        doc["devices"] = [dict(doc["devices"][0], containerEdits=first), second]
        assert refused(ctx, FileWrite("cdi", ALLOC, json.dumps(doc))) == (
            "bad-content",
            "cdi: devices[1].containerEdits.env: a hold's devices carry no env (only a device without other "
            "edits, its own BCD_DEVICE_ marker)",
        )


def test_a_vendor_spec_is_read_up_to_16_mib(ctx: HelperContext) -> None:
    vendor(ctx.root, {"0": {"deviceNodes": [{"path": "/dev/nvidia0"}]}})
    path = ctx.root / "etc/cdi/nvidia.json"
    text = path.read_bytes()
    path.write_bytes(text + b" " * (16 * MAX_CONTENT - len(text)))
    file_write(call(ctx), FileWrite("cdi", ALLOC, hold()))
    path.write_bytes(text + b" " * (16 * MAX_CONTENT - len(text) + 1))
    assert refused(ctx, FileWrite("cdi", ALLOC, hold())) == (
        "root-only",
        f"/etc/cdi/nvidia.json is larger than {16 * MAX_CONTENT} bytes",
    )


def test_a_vendor_spec_that_is_a_symlink_is_refused_naming_it(ctx: HelperContext, tmp_path: Path) -> None:
    (ctx.root / "etc/cdi").mkdir(parents=True)
    (tmp_path / "v.json").write_text("{}")
    (ctx.root / "etc/cdi/nvidia.json").symlink_to(tmp_path / "v.json")
    assert refused(ctx, FileWrite("cdi", ALLOC, hold())) == (
        "root-only",
        "/etc/cdi/nvidia.json is not a regular file: bcd will not write as root through it",
    )


def test_an_edit_outside_the_vendors_is_shown_cut_to_200_bytes(ctx: HelperContext) -> None:
    long_path = "/dev/" + "x" * 300
    item = json.dumps({"path": long_path}, separators=(",", ":"))
    assert refused(ctx, FileWrite("cdi", ALLOC, hold(edits={"deviceNodes": [{"path": long_path}]}))) == (
        "bad-content",
        f"cdi: devices[0].containerEdits.deviceNodes: {item[:200]} is not in root's vendor spec "
        "/etc/cdi/nvidia.json: a hold carries only the vendor's edits",
    )


def test_every_file_of_the_kind_is_counted_whatever_else_the_directory_holds(
    ctx: HelperContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Other names (made before and after the counted ones, so that they come first in either listing
    order) and the file being replaced are passed over, not the end of the count."""
    limit = files.LIMITS["allocation-env"]
    monkeypatch.setitem(
        files.LIMITS,
        "allocation-env",
        files.KindLimit(limit.directory, limit.pattern, 3, 10_000, limit.max_file),
    )
    folder = ctx.root / "run/bcd/allocations"
    folder.mkdir(parents=True)
    for i in range(15):
        (folder / f"before{i}.txt").write_text("x")
    for ident in ("a1", "a2", "a3"):
        file_write(call(ctx), env(ident))
    for i in range(15):
        (folder / f"after{i}.txt").write_text("x")
    assert refused(ctx, env("a4")) == (
        "too-many-files",
        "allocation-env: root keeps at most 3 files in /run/bcd/allocations",
    )
    file_write(call(ctx), env("a2", "X=1\n"))  # a replacement: still 3


def test_a_target_that_is_a_symlink_is_neither_written_nor_removed(
    ctx: HelperContext, tmp_path: Path
) -> None:
    folder = ctx.root / "run/bcd/allocations"
    folder.mkdir(parents=True)
    (tmp_path / "elsewhere").write_text("keep\n")
    (folder / "a1.env").symlink_to(tmp_path / "elsewhere")
    message = "/run/bcd/allocations/a1.env is not a regular file: bcd will not write as root through it"
    assert refused(ctx, env()) == ("root-only", message)
    assert refused(ctx, FileRemove("allocation-env", ALLOC)) == ("root-only", message)
    assert (tmp_path / "elsewhere").read_text() == "keep\n" and (folder / "a1.env").is_symlink()


def test_a_hold_of_exactly_the_largest_size_is_written(ctx: HelperContext) -> None:
    vendor(ctx.root, {"0": {"deviceNodes": [{"path": "/dev/nvidia0"}]}})
    text = hold()
    full = text + " " * (MAX_CONTENT - len(text.encode()) - 1) + "\n"
    assert file_write(call(ctx), FileWrite("cdi", ALLOC, full)) == {
        "path": f"/etc/cdi/bcd-{ALLOC}.json",
        "bytes": MAX_CONTENT,
    }
    assert refused(ctx, FileWrite("cdi", ALLOC, full + " ")) == (
        "too-large",
        f"cdi: content larger than {MAX_CONTENT} bytes",
    )
