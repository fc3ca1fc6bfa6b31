"""bcd_shared.cdi: the checker against the official test documents, naming rules, read-back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bcd_shared import cdi
from devices.cdicheck import assert_cdi_valid, schema_errors
from devices.devhost import REFERENCE
from testsupport import require_shared

SCHEMA = REFERENCE / "cdi-schema"


@pytest.mark.parametrize("name", ["testdata-good-minimal.json", "testdata-good-spec-example.json"])
def test_official_good_documents_pass(name: str) -> None:
    require_shared(SCHEMA / name)
    assert_cdi_valid((SCHEMA / name).read_bytes())


@pytest.mark.parametrize("name", ["testdata-bad-empty.json", "testdata-bad-explicit-empty.json"])
def test_official_bad_documents_fail(name: str) -> None:
    require_shared(SCHEMA / name)
    text = (SCHEMA / name).read_text()
    if not text.strip():
        with pytest.raises(ValueError):  # an empty file is no JSON document at all: refused
            cdi.parse_hold_spec(text.encode())
        return
    doc = json.loads(text)
    assert schema_errors(doc) or cdi.naming_errors(doc)


@pytest.mark.parametrize(
    ("doc", "error"),
    [
        (
            {
                "cdiVersion": "0.6.0",
                "kind": "bcd.dev/gpu",
                "devices": [{"name": "a/b", "containerEdits": {}}],
            },
            "breaks CDI's device name rules",
        ),
        ({"cdiVersion": "0.6.0", "kind": "bcd/", "devices": []}, "kind"),
        (
            {"cdiVersion": "0.5.0", "kind": "bcd.dev/gpu", "annotations": {"a": "b"}, "devices": []},
            "needs at least 0.6.0",
        ),
        (
            {
                "cdiVersion": "0.6.0",
                "kind": "bcd.dev/gpu",
                "devices": [],
                "containerEdits": {"additionalGids": [44]},
            },
            "needs at least 0.7.0",
        ),
        ({"cdiVersion": "0.6.0", "kind": "bcd.dev/gpu", "devices": [], "extra": 1}, "unknown field"),
        (
            {"cdiVersion": "0.6.0", "kind": "bcd.dev/gpu", "devices": [], "annotations": {"-bad": "x"}},
            "annotation key",
        ),
    ],
)
def test_naming_rules_refuse(doc: dict[str, object], error: str) -> None:
    """The rules of notes/real-host-testing.md that the schema does not carry."""
    assert any(error in e for e in cdi.naming_errors(doc)), cdi.naming_errors(doc)


def test_DEV_CDI_04_version_and_DEV_CDI_19_void_dropped_and_read_back() -> None:
    """Covers DEV-CDI-04, DEV-CDI-09..11, DEV-CDI-13, DEV-CDI-19, DEV-CDI-20, DEV-PASS-04, DLV-DEV-22."""
    vendor = cdi.parse_vendor_spec(
        json.dumps(
            {
                "cdiVersion": "0.8.0",
                "kind": "nvidia.com/gpu",
                "devices": [
                    {
                        "name": "GPU-1",
                        "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}], "env": ["X=1"]},
                    }
                ],
                "containerEdits": {
                    "env": ["NVIDIA_VISIBLE_DEVICES=void"],
                    "deviceNodes": [{"path": "/dev/nvidiactl"}],
                },
            }
        ).encode()
    )
    doc = cdi.build_hold_spec(
        allocation_id="a_1",
        reservation_id="r",
        generation=3,
        kubernetes=False,
        cgroup_parent=None,
        devices=[cdi.HoldDevice("GPU-1/s2", vendor.edits_for(["GPU-1"]))],
        env=["BCD_ALLOCATION_ID=a_1", "NVIDIA_VISIBLE_DEVICES=GPU-1"],
        vendor=vendor,
    )
    assert doc["cdiVersion"] == "0.8.0" and doc["devices"][0]["containerEdits"] == {
        "deviceNodes": [{"path": "/dev/nvidia0"}]
    }
    assert doc["containerEdits"]["env"] == ["BCD_ALLOCATION_ID=a_1", "NVIDIA_VISIBLE_DEVICES=GPU-1"]
    assert_cdi_valid(doc)
    rec = cdi.parse_hold_spec(cdi.encode_spec(doc), "a_1")
    assert rec.device_ids == ("GPU-1/s2",) and rec.generation == 3 and not rec.kubernetes
    bare = cdi.build_hold_spec(
        allocation_id="a_1",
        reservation_id="r",
        generation=3,
        kubernetes=False,
        cgroup_parent=None,
        devices=[cdi.HoldDevice("GPU-1")],
        env=["BCD_ALLOCATION_ID=a_1"],
        vendor=None,
    )
    assert bare["cdiVersion"] == "0.6.0" and bare["containerEdits"] == {"env": ["BCD_ALLOCATION_ID=a_1"]}
    with pytest.raises(cdi.CdiError, match="device-id"):
        cdi.parse_hold_spec(
            json.dumps(
                {
                    "cdiVersion": "0.6.0",
                    "kind": "bcd.dev/gpu",
                    "annotations": {"bcd.dev/allocation-id": "a_1", "bcd.dev/generation": "1"},
                    "devices": [{"name": "x", "containerEdits": {}}],
                }
            ).encode()
        )
    with pytest.raises(cdi.CdiError):
        cdi.cdi_spec_path("../etc/passwd")
    assert cdi.parse_env_file(b"BCD_ALLOCATION_ID=a_1\nFOO=bar\n", "a_1") == (
        "BCD_ALLOCATION_ID=a_1",
        "FOO=bar",
    )
    with pytest.raises(cdi.CdiError):
        cdi.encode_env_file(["FOO=bar\nEVIL=1"])


def test_orphan_env_files_are_those_without_a_cdi_spec_file(tmp_path: Path) -> None:
    """observe.read_orphan_envs (through cdi.env_files): the env files under /run/bcd/allocations whose
    allocation has no bcd-<id>.json, parsed or not, with their lines; one that does not parse is None;
    names that are no allocation's `<id>.env` are skipped."""
    from bcd_agent.sections.devices.observe import read_orphan_envs
    from bcd_shared.system import LocalSystem

    root = tmp_path
    d = root / "run/bcd/allocations"
    d.mkdir(parents=True)
    (d / "a.env").write_text("BCD_ALLOCATION_ID=a\n")
    (d / "b.env").write_text("BCD_ALLOCATION_ID=b\nNVIDIA_VISIBLE_DEVICES=GPU-1\n")
    (d / "c.env").write_text("BCD_ALLOCATION_ID=x\n")
    (d / "bad-name.env").write_text("BCD_ALLOCATION_ID=bad-name\n")
    (d / "d.txt").write_text("BCD_ALLOCATION_ID=d\n")
    (d / ".env").write_text("\n")
    system = LocalSystem(root=root)
    assert read_orphan_envs(system, {"a"}) == {
        "b": ("BCD_ALLOCATION_ID=b", "NVIDIA_VISIBLE_DEVICES=GPU-1"),
        "c": None,
    }
    assert [(a, p) for a, p, _ in cdi.env_files(system)] == [
        ("a", "/run/bcd/allocations/a.env"),
        ("b", "/run/bcd/allocations/b.env"),
        ("c", "/run/bcd/allocations/c.env"),
    ]
    assert read_orphan_envs(LocalSystem(root=root / "none"), set()) == {}


def test_DEV_CDI_09_10_11_20_one_named_device_per_atom_and_no_vendor_no_edits() -> None:
    """Covers DEV-CDI-09 (one `devices[]` entry per atom, in order), DEV-CDI-10 (the name is the atom id
    with EVERY `/` as `_`), DEV-CDI-11 (`bcd.dev/device-id` is the real atom id) and DEV-CDI-20 (without
    a vendor spec the hold grants nothing: no device node, mount or hook anywhere; each device has only
    its marker, docs/devices.md "Devices never bare")."""
    atoms = ["GPU-1", "GPU-2/gi1/ci0", "GPU-2/gi3/ci1", "GPU-3/s3", "GPU-3/s12"]
    doc = cdi.build_hold_spec(
        allocation_id="a_1",
        reservation_id="r",
        generation=3,
        kubernetes=False,
        cgroup_parent=None,
        devices=[cdi.HoldDevice(a) for a in atoms],
        env=["BCD_ALLOCATION_ID=a_1"],
        vendor=None,
    )
    assert [(d["name"], d["annotations"]) for d in doc["devices"]] == [
        ("GPU-1", {"bcd.dev/device-id": "GPU-1"}),
        ("GPU-2_gi1_ci0", {"bcd.dev/device-id": "GPU-2/gi1/ci0"}),
        ("GPU-2_gi3_ci1", {"bcd.dev/device-id": "GPU-2/gi3/ci1"}),
        ("GPU-3_s3", {"bcd.dev/device-id": "GPU-3/s3"}),
        ("GPU-3_s12", {"bcd.dev/device-id": "GPU-3/s12"}),
    ]
    assert [d["containerEdits"] for d in doc["devices"]] == [
        {"env": ["BCD_DEVICE_GPU_1=GPU-1"]},
        {"env": ["BCD_DEVICE_GPU_2_gi1_ci0=GPU-2/gi1/ci0"]},
        {"env": ["BCD_DEVICE_GPU_2_gi3_ci1=GPU-2/gi3/ci1"]},
        {"env": ["BCD_DEVICE_GPU_3_s3=GPU-3/s3"]},
        {"env": ["BCD_DEVICE_GPU_3_s12=GPU-3/s12"]},
    ]
    assert doc["containerEdits"] == {"env": ["BCD_ALLOCATION_ID=a_1"]}
    assert_cdi_valid(doc)
    assert cdi.parse_hold_spec(cdi.encode_spec(doc), "a_1").device_ids == tuple(atoms)
