"""`bcd plan --spec FILE --root DIR`: the dry run (every section in the seeds' order, nothing applied),
and strict spec files (house rule 4: unknown keys, duplicates, wrong types and ranges name the field)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from bcd_agent.plan import SpecFileError, parse_spec_json
from bcd_shared import wire
from clisupport import EXAMPLES, bcd, bcd_json, sim_root

SECTIONS = ["host", "devices", "instances", "access", "telemetry", "daemon", "site"]


def _tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        if p.is_file() and not p.is_symlink():
            h.update(p.read_bytes())
    return h.hexdigest()


def test_plan_gpu_node_lists_steps_and_applies_nothing(tmp_path: Path) -> None:
    root = sim_root(tmp_path)
    before = _tree_digest(root)
    rc, doc = bcd_json("plan", "--spec", str(EXAMPLES / "gpu-node.json"), "--root", str(root),
                       "--data-dir", "/var/lib/bcd")  # fmt: skip
    assert rc == 2  # it plans steps (terraform plan -detailed-exitcode)
    assert [s["section"] for s in doc["sections"]] == SECTIONS
    by = {s["section"]: s for s in doc["sections"]}
    devices = by["devices"]
    assert devices["failures"] == []
    assert "bind bind:alloc_train_0001: write /etc/cdi/bcd-alloc_train_0001.json" in devices["steps"]
    assert (
        "bind bind:alloc_train_0001: create or update slice bcd-alloc-alloc_train_0001.slice "
        "(AllowedCPUs=0-15, AllowedMemoryNodes=0, CPUQuota=1600%, MemoryMax=68719476736, "
        f"MemoryHigh={68719476736 * 9 // 10}; hugetlb.2MB.max={1024 * 2 * 1024 * 1024}, hugetlb.1GB.max=0)"
        in devices["steps"]
    )
    assert devices["binds"] == [
        "alloc_train_0001: GPU-5f1c2a90-0000-4000-8000-000000000001, GPU-5f1c2a90-0000-4000-8000-000000000002"
        " in bcd-alloc-alloc_train_0001.slice",
        "alloc_infer_0002: GPU-5f1c2a90-0000-4000-8000-000000000008/gi1/ci0",
    ]
    assert devices["releases"] == []
    assert "bind bind:alloc_infer_0002: send Bound for alloc_infer_0002" in devices["steps"]
    host = by["host"]
    assert "kernel-modules: run modprobe -- vfio_pci" in host["steps"]
    assert "sysctl: write /etc/sysctl.d/90-bcd.conf" in host["steps"]
    assert all(by[s]["converged"] for s in SECTIONS[2:])
    # A dry run: the simulated host is byte for byte what it was.
    assert _tree_digest(root) == before
    assert not (root / "etc/cdi/bcd-alloc_train_0001.json").exists()


def test_plan_vm_node_shows_the_instance_steps_and_applies_nothing(tmp_path: Path) -> None:
    """`bcd plan` runs the instances planner too: list (read-only), plan, nothing applied."""
    root = sim_root(tmp_path)
    before = _tree_digest(root)
    rc, doc = bcd_json("plan", "--spec", str(EXAMPLES / "vm-node.json"), "--root", str(root),
                       "--data-dir", "/var/lib/bcd")  # fmt: skip
    assert rc == 2  # it plans changes (terraform plan -detailed-exitcode)
    inst = {s["section"]: s for s in doc["sections"]}["instances"]
    assert inst["planner"] == "instances" and inst["failures"] == []
    assert inst["steps"] == [
        "define vm-gpu-0001 (8 vCPUs, 32768 MiB, image 39d1d3de8476 (qcow2), GPUs 0000:5d:00.0)",
        "start vm-gpu-0001",
    ]
    assert _tree_digest(root) == before


def test_plan_failing_assignment_names_the_reasons(tmp_path: Path) -> None:
    root = sim_root(tmp_path)
    rc, doc = bcd_json("plan", "--spec", str(EXAMPLES / "assignment-fails.json"), "--root", str(root),
                       "--data-dir", "/var/lib/bcd")  # fmt: skip
    assert rc == 2
    devices = next(s for s in doc["sections"] if s["section"] == "devices")
    failures = "\n".join(devices["failures"])
    assert "alloc_ghost_0002: device-missing" in failures
    assert "alloc_huge_0003: resources-exhausted" in failures
    assert "bind bind:alloc_ok_0001: write /etc/cdi/bcd-alloc_ok_0001.json" in devices["steps"]


def test_plan_text_output(tmp_path: Path) -> None:
    root = sim_root(tmp_path)
    res = bcd("plan", "--spec", str(EXAMPLES / "assignment-fails.json"), "--root", str(root),
              "--data-dir", "/var/lib/bcd")  # fmt: skip
    assert res.returncode == 2, res.stderr
    # The bind's spec, env file and event, two failures, the ledger and its keys' removal.
    assert "devices    7 step(s), 2 failure(s)" in res.stdout
    assert "forget 1 journal event key(s)" in res.stdout
    assert "  ! alloc_ghost_0002: device-missing" in res.stdout


def test_plan_refuses_a_bad_spec_file_naming_the_field(tmp_path: Path) -> None:
    spec = tmp_path / "bad.json"
    spec.write_text('{"devices": {"assignments": [{"allocationId": "a", "limits": {"cpuMilis": 5}}]}}')
    res = bcd("plan", "--spec", str(spec), "--root", str(sim_root(tmp_path)))
    assert res.returncode == 65  # EX_DATAERR
    assert f"{spec}: devices.assignments[0].limits.cpuMilis: unknown field of DeviceLimits" in res.stderr


@pytest.mark.parametrize(
    ("text", "path", "rule"),
    [
        ('{"devices": {"assignments": {}}}', "devices.assignments", "must be a JSON array"),
        ('{"devices": {"assignments": [{"binding": "HOLD"}]}}', "devices.assignments[0].binding",
         "is not a Binding"),
        ('{"devices": {"assignments": [{"allocationId": 7}]}}', "devices.assignments[0].allocationId",
         "must be a JSON string"),
        ('{"devices": {"assignments": [{"limits": {"cpuMillis": "-1"}}]}}',
         "devices.assignments[0].limits.cpuMillis", "out of range for uint64"),
        ('{"devices": {"assignments": [{"limits": {"memoryBytes": 1.5}}]}}',
         "devices.assignments[0].limits.memoryBytes", "must be an integer"),
        ('{"devices": {}, "devices": {}}', "devices", "key appears twice"),
        ('{"devices": {"assignments": [{"allocation_id": "a", "allocationId": "b"}]}}',
         "devices.assignments[0].allocationId", "given twice"),
        ('{"telemetry": {"exportIntervalMs": true}}', "telemetry.exportIntervalMs", "got a boolean"),
        ('{"host": {}} x', "", "is not JSON"),
        ('[]', "", "must be a JSON object"),
        ('{"hosts": {}}', "hosts", "unknown field of NodeSpec"),
    ],
)  # fmt: skip
def test_spec_file_strict(text: str, path: str, rule: str) -> None:
    with pytest.raises(SpecFileError) as info:
        parse_spec_json(text, "s.json")
    assert info.value.path == path
    assert rule in info.value.rule


def test_spec_file_accepts_the_proto3_json_forms() -> None:
    doc = {
        "devices": {"assignments": [{
            "allocation_id": "a1", "binding": 2,
            "devices": [{"id": "GPU-1"}],
            "limits": {"cpuMillis": 2000, "memoryBytes": "1073741824", "hugepages1gi": None},
        }]},
        "telemetry": {"resourceAttributes": {"site": "fra"}, "exportIntervalMs": "15000"},
        "daemon": {"signature": "AAEC"},
    }  # fmt: skip
    spec = parse_spec_json(json.dumps(doc))
    a = spec.devices.assignments[0] if spec.devices else None
    assert a is not None and a.allocation_id == "a1" and a.binding == wire.Binding.KUBERNETES
    assert a.limits is not None and a.limits.cpu_millis == 2000 and a.limits.memory_bytes == 2**30
    assert a.limits.hugepages_1gi is None
    assert spec.telemetry is not None and spec.telemetry.resource_attributes == {"site": "fra"}
    assert spec.daemon is not None and spec.daemon.signature == b"\x00\x01\x02"


def test_examples_parse() -> None:
    for path in sorted(EXAMPLES.glob("*.json")):
        spec = parse_spec_json(path.read_bytes(), str(path))
        assert bytes(spec), path


def test_plan_data_dir_inside_root_is_the_simulated_hosts(tmp_path: Path) -> None:
    """`--data-dir` is a real path, as `bcd status --data-dir` takes it: `ROOT/var/lib/bcd` under
    `--root ROOT` is the simulated host's /var/lib/bcd, for every section (here the devices section's
    releases file, which claims every GPU when it does not parse), the same plan as `--data-dir
    /var/lib/bcd`. Before, only the instances section translated it and the devices section read nothing."""
    root = sim_root(tmp_path)
    (root / "var/lib/bcd").mkdir(parents=True, exist_ok=True)
    (root / "var/lib/bcd/releasing.json").write_text("{")
    spec = str(EXAMPLES / "gpu-node.json")
    _rc, host_form = bcd_json("plan", "--spec", spec, "--root", str(root), "--data-dir", "/var/lib/bcd")
    rc, real_form = bcd_json(
        "plan", "--spec", spec, "--root", str(root), "--data-dir", str(root / "var/lib/bcd")
    )
    assert real_form == host_form and rc == 2
    devices = {s["section"]: s for s in real_form["sections"]}["devices"]
    assert any("releases-unreadable" in step for step in devices["steps"]), devices
