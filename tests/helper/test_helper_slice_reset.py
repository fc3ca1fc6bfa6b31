"""`slice.apply` with `reset` against a real `bcd helper serve` process on the simulated host: a kept
hold whose spec dropped limits gets exactly the seeds' properties back to their defaults, and every
reset outside the rules is refused with nothing changed.

Covers Q-DEV-PASS-01 under the helper (limits the spec dropped are reset), DEV-SLICE-09..16 (the
properties and huge page files), DEV-SLICE-23 (slice.apply is the helper's only slice change)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from bcd_simhost import sim_system
from helperproc import HelperProcess, tree

CG = "sys/fs/cgroup/bcd.slice/bcd-alloc.slice"


def _files(helper: HelperProcess, name: str) -> dict[str, str]:
    base = helper.root / CG / name
    wanted = ("cpuset.cpus", "cpuset.mems", "cpu.max", "memory.max", "memory.high")
    out = {f: (base / f).read_text().strip() for f in wanted}
    out |= {f: (base / f).read_text().strip() for f in ("hugetlb.2MB.max", "hugetlb.1GB.max")}
    return out


def _shown(helper: HelperProcess, name: str) -> dict[str, str]:
    text = sim_system(helper.root).run(["systemctl", "show", name]).stdout.decode()
    return dict(line.split("=", 1) for line in text.splitlines())


def _set_property_calls(root: Path, name: str) -> list[str]:
    log = root / "var/lib/bcd-sim/systemd/log"
    return [c for c in log.read_text().splitlines() if c.startswith(f"set-property --runtime {name}")]


def test_Q_DEV_PASS_01_slice_apply_resets_the_dropped_limits(helper: HelperProcess) -> None:
    """The hold first books every limit; the next apply keeps cpus and cpu_millis (changed) and resets
    mems, memory and both huge page sizes in the same call, resets first."""
    name = "bcd-alloc-alloc_r1.slice"
    helper.client.slice_apply(
        name, cpus="0-7", mems="0", cpu_millis=1500, memory_bytes=8 << 30, hugepages_2mi=4
    )
    before = _files(helper, name)
    assert before["cpuset.mems"] == "0" and before["memory.max"] == str(8 << 30)
    assert before["hugetlb.2MB.max"] == str(4 << 21) and before["hugetlb.1GB.max"] == "0"

    answer = helper.client.slice_apply(
        name,
        cpus="0-3",
        cpu_millis=500,
        reset=("mems", "memory_bytes", "hugepages_2mi", "hugepages_1gi"),
    )
    assert answer["properties"] == [
        "AllowedMemoryNodes=",
        "MemoryMax=infinity",
        "MemoryHigh=infinity",
        "AllowedCPUs=0-3",
        "CPUQuota=50%",
    ]
    assert answer["reset"] == ["mems", "memory_bytes", "hugepages_2mi", "hugepages_1gi"]
    assert _files(helper, name) == {
        "cpuset.cpus": "0-3",
        "cpuset.mems": "",
        "cpu.max": "50000 100000",
        "memory.max": "max",
        "memory.high": "max",
        "hugetlb.2MB.max": "max",
        "hugetlb.1GB.max": "max",
    }
    assert _set_property_calls(helper.root, name)[-1] == (
        f"set-property --runtime {name} AllowedMemoryNodes= MemoryMax=infinity MemoryHigh=infinity "
        "AllowedCPUs=0-3 CPUQuota=50%"
    )
    shown = _shown(helper, name)
    assert shown["ActiveState"] == "active" and shown["MemoryMax"] == "infinity"
    audit = helper.last_audit()
    assert audit["op"] == "slice.apply" and audit["decision"] == "accepted"
    assert audit["args"]["reset"] == ["mems", "memory_bytes", "hugepages_2mi", "hugepages_1gi"]

    # Every limit dropped: the slice stays (its workload keeps running), unrestricted.
    (helper.root / CG / name / "cgroup.events").write_text("populated 1\nfrozen 0\n")
    helper.client.slice_apply(name, reset=("cpus", "cpu_millis"))
    files = _files(helper, name)
    assert files["cpuset.cpus"] == "" and files["cpu.max"] == "max 100000"
    assert not (helper.root / "var/lib/bcd-sim/killed-workloads").exists()
    (helper.root / CG / name / "cgroup.events").write_text("populated 0\nfrozen 0\n")
    assert helper.client.slice_remove(name)["stopped"] is True


def test_a_huge_page_reset_of_a_slice_without_hugetlb_files_is_a_no_op(helper: HelperProcess) -> None:
    """A slice whose cgroup has no `hugetlb.<size>.max` (controller not enabled) has no such limit."""
    name = "bcd-alloc-alloc_r2.slice"
    helper.client.slice_apply(name, cpus="0")
    (helper.root / CG / name / "hugetlb.1GB.max").unlink()
    helper.client.slice_apply(name, cpus="0", reset=("hugepages_1gi",))
    assert not (helper.root / CG / name / "hugetlb.1GB.max").exists()
    assert helper.client.slice_remove(name)["stopped"] is True


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"reset": ["MemoryMax"]}, "reset: 'MemoryMax' is not a limit (one of cpus, mems, cpu_millis,"),
        ({"reset": ["../x"]}, "reset: '../x' is not a limit"),
        ({"reset": ["cpus", "cpus"]}, "reset: cpus is listed twice"),
        ({"cpus": "0-3", "reset": ["cpus"]}, "reset: cpus is also given"),
        (
            {"hugepages_1gi": 2, "reset": ["hugepages_2mi"]},
            "reset: hugepages_2mi while hugepages_1gi is given",
        ),
        (
            {"memory_bytes": 1 << 30, "reset": ["hugepages_1gi", "memory_bytes"]},
            "reset: memory_bytes is also",
        ),
    ],
)
def test_resets_outside_the_rules_are_refused_and_change_nothing(
    helper: HelperProcess, args: dict[str, Any], message: str
) -> None:
    name = "bcd-alloc-alloc_r3.slice"
    helper.client.slice_apply(name, cpus="0-1", memory_bytes=1 << 30, hugepages_1gi=1)
    before = tree(helper.root)
    answer = helper.raw({"op": "slice.apply", "args": {"name": name, **args}})
    assert answer["ok"] is False and answer["reason"] == "bad-reset", answer
    assert message in answer["message"]
    assert tree(helper.root) == before  # no systemctl call, no cgroup write
    audit = helper.last_audit()
    assert audit["decision"] == "refused" and audit["reason"] == "bad-reset"


@pytest.mark.parametrize("reset", ["memory_bytes", [1], [None], {"cpus": True}])
def test_a_reset_of_the_wrong_json_type_is_bad_arguments(helper: HelperProcess, reset: object) -> None:
    before = tree(helper.root)
    answer = helper.raw({"op": "slice.apply", "args": {"name": "bcd-alloc-alloc_r4.slice", "reset": reset}})
    assert answer["ok"] is False and answer["reason"] == "bad-arguments", answer
    assert "reset" in answer["message"]
    assert tree(helper.root) == before
