"""A hostile node against a real helper process: ids and names that try to leave their directory, CDI and env
content that tries to speak for another allocation or smuggle root's edits, removals that resolve outside
their directory, and a parent directory swapped between the check and the use.

Every refusal: answered, audited as one refused line, the tree byte-for-byte unchanged, the helper still
serving (hostilekit.assert_refused_raw). Covers DLV-PRIV-02, DEV-BIND-06, HST-ROOT-01/08.
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest
from bcd_shared import cdi
from helperproc import HelperProcess, base_config
from hostilekit import NODE_GID, NODE_UID, assert_refused_raw, assert_still_serving, send_raw, verify_audit
from testsupport import IN_CI

GPU0 = "GPU-5f1c2a90-0000-4000-8000-000000000001"


def _doc(op: str, **args: Any) -> bytes:
    return json.dumps({"op": op, "args": args}, ensure_ascii=False).encode()


BAD_IDS = [
    "..",
    "../../etc/passwd",
    "a/b",
    "/etc/shadow",
    "a\x00b",
    "a1\n",
    "a1\nb",
    "a1\r",
    "a" * 81,
    "\uff411",  # fullwidth a
    "\u04301",  # Cyrillic a
    "a1\u200b",  # zero-width space
    "\u212a1",  # Kelvin sign (K under case folding)
    "a1.json",
    "",
]


@pytest.mark.parametrize("ident", BAD_IDS, ids=[ascii(i)[:20] for i in BAD_IDS])
@pytest.mark.parametrize("kind", ["cdi", "allocation-env", "k8s-token"])
def test_ids_that_leave_their_directory_are_refused(helper: HelperProcess, kind: str, ident: str) -> None:
    if kind == "k8s-token" and ident == "":
        ident = "x"  # their one good id is empty
    assert_refused_raw(helper, _doc("file.remove", kind=kind, id=ident), "bad-id", op="file.remove")
    content = "BCD_ALLOCATION_ID=a1\n"
    assert_refused_raw(helper, _doc("file.write", kind=kind, id=ident, content=content), "bad-id")


@pytest.mark.parametrize(
    "name",
    [
        "bcd-alloc-../x.slice",
        "bcd-alloc-a1.slice\n",
        "bcd-alloc-a1.slice/../../ssh.service",
        "bcd-alloc-a1\x00.slice",
        "bcd-alloc-\uff411.slice",
        "bcd-alloc-" + "a" * 81 + ".slice",
        "bcd-alloc-.slice",
        "-.slice",
        "bcd.slice",
    ],
)
def test_slice_names_outside_the_pattern_are_refused(helper: HelperProcess, name: str) -> None:
    assert_refused_raw(helper, _doc("slice.apply", name=name, cpus="0"), "bad-slice-name")
    assert_refused_raw(helper, _doc("slice.remove", name=name), "bad-slice-name")


@pytest.mark.parametrize("unit", ["sysctl\n", "../sysctl", "sysctl\x00", "\u0455ysctl", "SYSCTL", "s" * 65])
def test_unit_names_outside_the_pattern_are_refused(helper: HelperProcess, unit: str) -> None:
    assert_refused_raw(helper, _doc("host.unit", unit=unit, settings=None, busy_gpus=[]), "bad-unit-name")


# --- CDI content ------------------------------------------------------------------------------------------


def _hold(
    alloc: str = "a1", *, vendor: cdi.VendorSpec | None = None, env: list[str] | None = None
) -> dict[str, Any]:
    edits = vendor.edits_for([GPU0]) if vendor is not None else None
    return cdi.build_hold_spec(
        allocation_id=alloc,
        reservation_id="rsv_1",
        generation=3,
        kubernetes=False,
        cgroup_parent=None,
        devices=[cdi.HoldDevice(GPU0, edits)],
        env=[f"BCD_ALLOCATION_ID={alloc}"] if env is None else env,
        vendor=vendor,
    )


def _vendor(h: HelperProcess) -> cdi.VendorSpec:
    return cdi.parse_vendor_spec((h.root / "etc/cdi/nvidia.json").read_bytes())


def _write_cdi(h: HelperProcess, content: str, ident: str = "a1") -> dict[str, Any] | None:
    return send_raw(h, _doc("file.write", kind="cdi", id=ident, content=content))


def test_a_hold_with_roots_vendor_edits_is_written(helper: HelperProcess) -> None:
    """The legitimate hold (NVIDIA's edits copied from root's own /etc/cdi/nvidia.json) passes every check
    below: the rules refuse only what root's vendor spec does not carry."""
    content = cdi.encode_spec(_hold(vendor=_vendor(helper))).decode()
    answer = _write_cdi(helper, content)
    assert answer is not None and answer["ok"] is True, answer
    assert send_raw(helper, _doc("file.remove", kind="cdi", id="a1")) == {
        "ok": True,
        "result": {"path": "/etc/cdi/bcd-a1.json", "removed": True},
    }


def test_cdi_naming_another_allocation_is_refused(helper: HelperProcess) -> None:
    """Another allocation in the annotation, behind a duplicate key (last-wins would read a1), or in the
    hold's env: refused."""
    other = cdi.encode_spec(_hold("victim")).decode()
    assert_refused_raw(helper, _doc("file.write", kind="cdi", id="a1", content=other), "bad-content")
    doc = _hold("a1")
    text = cdi.encode_spec(doc).decode()
    twice = '"bcd.dev/allocation-id": "victim", "bcd.dev/allocation-id": "a1"'
    dup = text.replace('"bcd.dev/allocation-id": "a1"', twice)
    assert dup != text
    assert_refused_raw(helper, _doc("file.write", kind="cdi", id="a1", content=dup), "bad-content", "twice")
    for env in (
        ["BCD_ALLOCATION_ID=victim"],
        ["BCD_ALLOCATION_ID=a1", "BCD_ALLOCATION_ID=victim"],
        ["BCD_ALLOCATION_ID=a1", "X=1", "X=2"],
    ):
        content = cdi.encode_spec(_hold("a1", env=env)).decode()
        assert_refused_raw(helper, _doc("file.write", kind="cdi", id="a1", content=content), "bad-content")
    device_env = _hold("a1")
    device_env["devices"][0]["containerEdits"] = {"env": ["BCD_ALLOCATION_ID=victim"]}
    content = cdi.encode_spec(device_env).decode()
    assert_refused_raw(helper, _doc("file.write", kind="cdi", id="a1", content=content), "bad-content")


def test_a_device_carries_only_its_own_marker(helper: HelperProcess) -> None:
    """A Kubernetes hold's devices (and a hold's device without vendor edits) carry exactly their own
    BCD_DEVICE_ marker, which the helper writes; any other device env is refused."""
    kube = cdi.build_hold_spec(
        allocation_id="k1", reservation_id="rsv_1", generation=3, kubernetes=True, cgroup_parent=None,
        devices=[cdi.HoldDevice(GPU0, None)], env=["BCD_ALLOCATION_ID=k1"], vendor=None,
    )  # fmt: skip
    marker = f"BCD_DEVICE_{GPU0.replace('-', '_')}={GPU0}"
    assert kube["devices"][0]["containerEdits"] == {"env": [marker]}
    answer = _write_cdi(helper, cdi.encode_spec(kube).decode(), "k1")
    assert answer is not None and answer["ok"] is True, answer
    for env in ([marker, "X=1"], [f"BCD_DEVICE_{GPU0.replace('-', '_')}=GPU-other"], ["BCD_ALLOCATION_ID=x"]):
        kube["devices"][0]["containerEdits"] = {"env": env}
        content = cdi.encode_spec(kube).decode()
        assert_refused_raw(helper, _doc("file.write", kind="cdi", id="k1", content=content), "bad-content")


@pytest.mark.parametrize(
    ("where", "key", "value"),
    [
        (
            "spec",
            "hooks",
            [{"hookName": "createRuntime", "path": "/var/lib/bcd/evil", "args": ["evil"]}],
        ),
        ("spec", "mounts", [{"hostPath": "/", "containerPath": "/host", "options": ["rbind", "rw"]}]),
        ("spec", "deviceNodes", [{"path": "/dev/mem"}]),
        ("device", "deviceNodes", [{"path": "/dev/sda"}]),
        ("device", "hooks", [{"hookName": "startContainer", "path": "/bin/sh", "args": ["sh", "-c", "id"]}]),
        ("spec", "additionalGids", [0]),
    ],
)
def test_cdi_edits_root_s_vendor_spec_does_not_carry_are_refused(
    helper: HelperProcess, where: str, key: str, value: list[Any]
) -> None:
    """A hold is read by the container runtime, as root: a hook there runs a program on the host as root, a
    mount or device node hands the host to a container. A hold may carry only the edits root's own vendor
    spec (/etc/cdi/nvidia.json) carries, so the node cannot turn a file.write into root's code execution."""
    doc = _hold("a1", vendor=_vendor(helper))
    edits = doc.setdefault("containerEdits", {}) if where == "spec" else doc["devices"][0]["containerEdits"]
    edits[key] = list(edits.get(key, [])) + value
    content = cdi.encode_spec(doc).decode()
    assert_refused_raw(helper, _doc("file.write", kind="cdi", id="a1", content=content), "bad-content", key)


def test_cdi_strictness_nan_and_nesting(helper: HelperProcess) -> None:
    text = cdi.encode_spec(_hold("a1")).decode()
    nan = text.replace('"cdiVersion": "0.6.0"', '"cdiVersion": "0.6.0", "x": NaN')
    assert nan != text
    assert_refused_raw(helper, _doc("file.write", kind="cdi", id="a1", content=nan), "bad-content")
    deep = text.rstrip().rstrip("}") + ', "annotations2": ' + "[" * 5000 + "]" * 5000 + "}\n"
    assert_refused_raw(helper, _doc("file.write", kind="cdi", id="a1", content=deep), "bad-content")


# --- env content ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content",
    [
        "BCD_ALLOCATION_ID=a1\nBCD_ALLOCATION_ID=victim\n",  # last-wins readers would see victim
        "BCD_ALLOCATION_ID=a1\nBCD_RESERVATION_ID=r1\nBCD_RESERVATION_ID=r2\n",
        "BCD_ALLOCATION_ID=a1\nX=1\rBCD_ALLOCATION_ID=victim\n",
        "BCD_ALLOCATION_ID=a1\nX=1\x85BCD_ALLOCATION_ID=victim\n",  # NEL: a line break to str.splitlines only
        "BCD_ALLOCATION_ID=a1\nX=1\u2028Y=2\n",  # LINE SEPARATOR: likewise
        "BCD_ALLOCATION_ID=a1\nX=1\u2029Y=2\n",
        "BCD_ALLOCATION_ID=a1\nX=1\x00\n",
        "BCD_ALLOCATION_ID=a1\n\nX=1\n",
        "BCD_ALLOCATION_ID=victim\nBCD_ALLOCATION_ID=a1\n",
        " BCD_ALLOCATION_ID=a1\n",
    ],
)
def test_env_content_injections_are_refused(helper: HelperProcess, content: str) -> None:
    """An env file is read line by line by a workload manager: the helper's reading must be the reader's (only
    `\\n` ends a line) and no key may be set twice (no silent last-wins over BCD_ALLOCATION_ID)."""
    doc = _doc("file.write", kind="allocation-env", id="a1", content=content)
    assert_refused_raw(helper, doc, "bad-content")


def test_sshd_kinds_are_gone(helper: HelperProcess) -> None:
    """The node never sends sshd text (issue 9 item 1): root renders the access section's files itself
    (access.apply); every former sshd kind is an unknown kind."""
    for kind, ident in (("sshd-config", ""), ("sshd-ca", ""), ("sshd-principals", "alice"), ("sshd-krl", "")):
        doc = _doc("file.write", kind=kind, id=ident, content="alice\u2028root\n")
        assert_refused_raw(helper, doc, "bad-kind")


# --- removals ---------------------------------------------------------------------------------------------


@pytest.mark.planted_cdi
def test_remove_of_a_planted_symlink_or_directory_is_refused(fresh_root: Path) -> None:
    h = HelperProcess(fresh_root, base_config())
    try:
        cdi_dir = fresh_root / "etc/cdi"
        secret = fresh_root / "etc/secret"
        secret.write_text("root's\n")
        (cdi_dir / "bcd-a1.json").symlink_to(secret)
        (cdi_dir / "bcd-a2.json").mkdir()
        (fresh_root / "run/bcd/allocations").mkdir(parents=True, exist_ok=True)
        (fresh_root / "run/bcd/allocations/a3.env").symlink_to("/etc/shadow")
        for kind, ident in (("cdi", "a1"), ("cdi", "a2"), ("allocation-env", "a3")):
            answer = assert_refused_raw(h, _doc("file.remove", kind=kind, id=ident), "root-only")
            assert "not a regular file" in answer["message"]
            content = (
                cdi.encode_spec(_hold(ident)).decode() if kind == "cdi" else f"BCD_ALLOCATION_ID={ident}\n"
            )
            answer = assert_refused_raw(
                h, _doc("file.write", kind=kind, id=ident, content=content), "root-only"
            )
            assert "not a regular file" in answer["message"]
        assert (cdi_dir / "bcd-a1.json").is_symlink() and secret.read_text() == "root's\n"
    finally:
        h.stop()


def test_HST_ROOT_08_the_helpers_file_kinds_write_only_under_root_only_directories(fresh_root: Path) -> None:
    """Each of the helper's own file kinds (cdi, allocation-env, k8s-token) is written only when every
    directory down to it is a real directory only root can write: the kind's directory owned by the node,
    group- or world-writable, or a symlink to a node-owned directory is refused `root-only` with nothing
    written anywhere; put back, the same write is made."""
    token = "abcdef.0123456789abcdef\n"
    writes = {
        "cdi": ("a1", cdi.encode_spec(_hold("a1")).decode(), "etc/cdi", "bcd-a1.json"),
        "allocation-env": ("a1", "BCD_ALLOCATION_ID=a1\n", "run/bcd/allocations", "a1.env"),
        "k8s-token": ("", token, "var/lib/bcd-hostconfig/k8s", "bootstrap-token"),
    }
    h = HelperProcess(fresh_root, base_config())
    try:
        node_dir = fresh_root / "var/node-owned"
        node_dir.mkdir()
        os.chown(node_dir, NODE_UID, NODE_GID)
        for kind, (ident, content, where, name) in writes.items():
            d = fresh_root / where
            d.mkdir(parents=True, exist_ok=True)
            doc = _doc("file.write", kind=kind, id=ident, content=content)
            os.chown(d, NODE_UID, NODE_GID)
            assert_refused_raw(h, doc, "root-only", where)
            os.chown(d, 0, 0)
            for mode in (0o775, 0o757):
                os.chmod(d, mode)
                assert_refused_raw(h, doc, "root-only", where)
            os.chmod(d, 0o755)
            aside = d.with_name(d.name + ".aside")
            d.rename(aside)
            d.symlink_to(os.path.relpath(node_dir, d.parent))
            assert_refused_raw(h, doc, "root-only")
            d.unlink()
            aside.rename(d)
            assert list(node_dir.iterdir()) == []
            answer = send_raw(h, doc)
            assert answer is not None and answer["ok"] is True, answer
            written = d / name
            assert written.read_text() == content and written.stat().st_uid == 0, kind
    finally:
        h.stop()


# --- TOCTOU: the parent directory renamed over between the check and the use -------------------------------

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def test_parent_directory_exchanged_with_a_node_owned_one_never_steers_a_write(fresh_root: Path) -> None:
    """A racer atomically exchanges /etc/cdi with a node-owned, world-writable directory (renameat2
    RENAME_EXCHANGE), and with a symlink to it, over and over while holds are written. Each write is either
    made in root's directory (the fd the walk verified, wherever that directory is named at the moment) or
    refused root-only; the node's directory never receives a file root wrote."""
    h = HelperProcess(fresh_root, base_config())
    etc = fresh_root / "etc"
    evil = etc / "cdi-evil"
    evil.mkdir()
    os.chown(evil, NODE_UID, NODE_GID)
    os.chmod(evil, 0o777)
    link = etc / "cdi-link"
    link.symlink_to("cdi-evil")
    try:
        _exchange(etc / "cdi", evil)  # renameat2 is there (else the test cannot race)
        _exchange(etc / "cdi", evil)
    except OSError as exc:
        h.stop()
        if IN_CI:
            pytest.fail(f"renameat2(RENAME_EXCHANGE) is unavailable under CI: {exc}")
        pytest.skip(f"renameat2(RENAME_EXCHANGE): {exc}")
    stop = threading.Event()
    swaps = [0]

    def race() -> None:
        while not stop.is_set():
            for other in (evil, link):
                try:
                    _exchange(etc / "cdi", other)
                    _exchange(etc / "cdi", other)
                    swaps[0] += 1
                except OSError:
                    continue

    content = cdi.encode_spec(_hold("a1")).decode()
    outcomes: dict[str, int] = {}
    t = threading.Thread(target=race)
    t.start()
    try:
        for i in range(120):
            ident = f"r{i}"
            text = content.replace('"a1"', f'"{ident}"').replace("=a1", f"={ident}")
            answer = send_raw(h, _doc("file.write", kind="cdi", id=ident, content=text))
            assert answer is not None
            key = "ok" if answer["ok"] else answer["reason"]
            outcomes[key] = outcomes.get(key, 0) + 1
    finally:
        stop.set()
        t.join()
    assert set(outcomes) <= {"ok", "root-only"}, outcomes
    assert swaps[0] > 10
    dirs = [p for p in (etc / "cdi", evil, link) if p.is_dir() and not p.is_symlink()]
    (node_dir,) = [p for p in dirs if p.stat().st_uid == NODE_UID]
    (root_dir,) = [p for p in dirs if p.stat().st_uid == 0]
    assert list(node_dir.iterdir()) == []
    written = {p.name for p in root_dir.iterdir() if p.name.startswith("bcd-r")}
    assert len(written) == outcomes.get("ok", 0)
    assert len(h.audit_lines()) >= 120
    assert_still_serving(h)
    verify_audit(h)
    h.stop()
