"""`bcd status`: the node's published status (status.json) and the holder of each GPU, MIG instance
and slot read back from /etc/cdi on a simulated host. Covers DLV-CONV-18 (one state per section with
generation, reason and message), DLV-CONV-19 (conditions with ages, never timestamps), DLV-CONV-04/05
(a host section without a converger: UNSUPPORTED, reason "1", SectionUnsupported) as `bcd status` shows
them, and devices-and-holds "Seeing the holds"."""

from __future__ import annotations

import io
import json
import stat
import time
from pathlib import Path

import trio
from bcd_agent.converge.runner import ConvergeRunner
from bcd_agent.converge.section import PartsObserver
from bcd_agent.converge.types import Condition, NodeStatus, SectionState, SectionStatus
from bcd_agent.plan import desired_from_nodespec, load_spec_file
from bcd_agent.sections.devices.apply import DirectExecutor
from bcd_agent.sections.devices.events import KeyReportSigner, MemorySink
from bcd_agent.sections.devices.section import DevicesSection
from bcd_agent.status import StatusSnapshot, render, watch
from bcd_agent.statusfile import StatusFileError, decode, read_status, serve, status_path, write_status
from bcd_simhost import sim_system
from bcd_simhost.gpus import gpu_uuid
from clisupport import EXAMPLES, bcd, bcd_json, sim_root

DEVICES_DATA_DIR = "/var/lib/bcd"


async def converge_example(root: Path, data_dir: Path, example: str) -> NodeStatus:
    """Run the real converge runner with the devices section on the simulated host, publishing
    status.json through statusfile.serve, until the example's generation is observed."""
    system = sim_system(root)
    section = DevicesSection(
        system,
        DirectExecutor(system),
        MemorySink(),
        KeyReportSigner.fresh("node-cli-1", "boot-cli-1"),
        DEVICES_DATA_DIR,
    )
    desired = desired_from_nodespec(load_spec_file(EXAMPLES / example), 1)
    runner = ConvergeRunner([section], PartsObserver({}, trio.current_time), initial_spec=desired)
    async with trio.open_nursery() as nursery:
        await nursery.start(serve, runner.status, data_dir)
        await nursery.start(runner.run)
        with trio.fail_after(30):
            status = await runner.status.wait_newer(0)
            while status.observed_generation < 1:
                status = await runner.status.wait_newer(status.version)
            while (view := read_status(data_dir)) is None or view.status_version < status.version:  # noqa: ASYNC110
                await trio.sleep(0.01)  # the file is the other process's view: poll it as bcd status does
        nursery.cancel_scope.cancel()
    return status


async def test_status_shows_sections_and_holders(tmp_path: Path) -> None:
    """Covers DEV-SEE-01: per GPU, the allocation that holds it or one of its MIG instances."""
    root, data_dir = sim_root(tmp_path), tmp_path / "data"
    # The example's host units have no converger here: only devices runs (host is UNSUPPORTED).
    await converge_example(root, data_dir, "gpu-node.json")
    assert stat.S_IMODE(status_path(data_dir).stat().st_mode) == 0o640
    rc, doc = await trio.to_thread.run_sync(
        lambda: bcd_json("status", "--root", str(root), "--data-dir", str(data_dir))
    )
    st = doc["status"]
    assert st["applied_generation"] == 1 and st["observed_generation"] == 1
    sections = {s["section"]: s for s in st["sections"]}
    assert sections["devices"] == {"section": "devices", "state": "CONVERGED", "generation": 1, "reason": "",
                                   "message": ""}  # fmt: skip
    assert sections["host"]["state"] == "UNSUPPORTED" and sections["host"]["reason"] == "1"
    assert [c["type"] for c in st["conditions"]] == ["SectionUnsupported"]
    assert isinstance(st["conditions"][0]["age_ms"], int)
    assert rc == 0  # settled, nothing FAILED
    holders = {r["device"]: r["holder"] for r in doc["holders"]}
    assert holders[gpu_uuid(0)] == "alloc_train_0001"
    assert holders[gpu_uuid(1)] == "alloc_train_0001"
    assert holders[gpu_uuid(2)] is None
    assert holders[f"{gpu_uuid(7)}/gi1/ci0"] == "alloc_infer_0002"
    assert holders[f"{gpu_uuid(7)}/gi2/ci0"] is None
    assert len([r for r in doc["holders"] if r["device_class"] == "gpu"]) == 8

    text = await trio.to_thread.run_sync(
        lambda: bcd("status", "--root", str(root), "--data-dir", str(data_dir))
    )
    assert "generation: applied 1, observed 1 (settled)" in text.stdout
    assert "devices    CONVERGED       1" in text.stdout
    assert "gi1/ci0" in text.stdout and "alloc_infer_0002" in text.stdout


async def test_status_failed_section_exits_1_with_reason(tmp_path: Path) -> None:
    root, data_dir = sim_root(tmp_path), tmp_path / "data"
    await converge_example(root, data_dir, "assignment-fails.json")
    rc, doc = await trio.to_thread.run_sync(
        lambda: bcd_json("status", "--root", str(root), "--data-dir", str(data_dir))
    )
    assert rc == 1
    devices = next(s for s in doc["status"]["sections"] if s["section"] == "devices")
    assert devices["state"] == "FAILED" and devices["reason"] == "AllocationFailed"
    assert "alloc_ghost_0002: " in devices["message"] and "alloc_huge_0003: " in devices["message"]
    holders = {r["device"]: r["holder"] for r in doc["holders"]}
    assert holders[gpu_uuid(2)] == "alloc_ok_0001"
    assert holders[gpu_uuid(4)] is None  # the refused hold took nothing


def test_status_without_a_node_says_so(tmp_path: Path) -> None:
    res = bcd("status", "--no-holds", "--data-dir", str(tmp_path))
    assert res.returncode == 1
    assert "no status published yet" in res.stdout
    # The file it looked for: under --root, a config's data_dir is the simulated host's, not the real path.
    assert f"{tmp_path / 'status.json'} does not exist" in res.stdout


def _status(version: int, state: SectionState = SectionState.CONVERGED) -> NodeStatus:
    reason = "R" if state is not SectionState.CONVERGED else ""
    reboot = Condition("RebootRequired", "hugepages", "reboot the node", "host", since_monotonic=10.0)
    return NodeStatus(
        version=version,
        applied_generation=3,
        observed_generation=3 if state.settled else 2,
        spec_hash="h",
        sections=(SectionStatus("devices", state, 3, reason, ""),),
        conditions=(reboot,),
        passes=version,
        last_pass_monotonic=0.0,
    )


def test_statusfile_ages_grow_and_format_is_checked(tmp_path: Path) -> None:
    """DLV-CONV-19: an age on the monotonic clock at write time, grown by the wall time since."""
    write_status(tmp_path, _status(1), now_monotonic=12.5, now_wall=1000.0)
    view = read_status(tmp_path, now_wall=1003.0)
    assert view is not None
    assert view.conditions[0].age_ms == 2500 + 3000
    assert view.converged
    data = status_path(tmp_path).read_bytes()
    try:
        decode(data.replace(b'"format": 1', b'"format": 2'))
    except StatusFileError as e:
        assert "format 2 is not 1" in str(e)
    else:
        raise AssertionError("format 2 accepted")
    try:
        decode(b"{not json")
    except StatusFileError as e:
        assert "not JSON" in str(e)
    else:
        raise AssertionError("garbage accepted")


def test_watch_prints_only_changes_when_not_a_tty(tmp_path: Path) -> None:
    states = iter([SectionState.PROGRESSING, SectionState.PROGRESSING, SectionState.CONVERGED])

    def take() -> StatusSnapshot:
        write_status(tmp_path, _status(1, next(states)), now_monotonic=11.0)
        return StatusSnapshot(read_status(tmp_path), None)

    out = io.StringIO()
    snap = watch(take, out, interval=0, tty=False, count=3, sleep=lambda _: None)
    assert snap.exit_code == 0
    blocks = out.getvalue().split("\n\n\n")
    assert out.getvalue().count("SECTION") == 2  # PROGRESSING once, then CONVERGED
    assert "PROGRESSING" in blocks[0]
    assert render(snap).count("devices") == 1


def test_status_json_of_holds_alone(tmp_path: Path) -> None:
    root = sim_root(tmp_path)
    rc, doc = bcd_json("status", "--root", str(root), "--data-dir", str(tmp_path / "none"))
    assert rc == 1 and doc["status"] is None
    assert all(r["holder"] is None for r in doc["holders"])
    assert json.dumps(doc)


def test_a_gpu_passed_through_to_a_vm_shows_its_instance(tmp_path: Path) -> None:
    """A GPU passed through to an instance is held by no CDI file: `bcd status` takes its holder from the
    node's published `passthrough` map (status.json), shows a GPU nvidia-smi no longer lists (bound to
    vfio-pci) on a row of its own, and ignores entries that are not two strings."""
    root, data_dir = sim_root(tmp_path), tmp_path / "data"
    unlisted = "GPU-00000000-dead-beef-0000-000000000042"
    passthrough = {gpu_uuid(3): "vm-gpu-0001", unlisted: "vm-gpu-0002", gpu_uuid(5): 7, "": "vm-x"}
    write_status(data_dir, _status(1), now_monotonic=11.0, extra={"passthrough": passthrough})
    _rc, doc = bcd_json("status", "--root", str(root), "--data-dir", str(data_dir))
    rows = {r["device"]: r for r in doc["holders"]}
    assert (rows[gpu_uuid(3)]["holder"], rows[gpu_uuid(3)]["instance"]) == (None, "vm-gpu-0001")
    assert rows[gpu_uuid(3)]["gpu_index"] == 3
    assert rows[unlisted] == {"gpu_index": None, "device": unlisted, "device_class": "gpu",
                              "detail": "passed through", "holder": None,
                              "instance": "vm-gpu-0002"}  # fmt: skip
    assert rows[gpu_uuid(5)]["instance"] is None and rows[gpu_uuid(2)]["instance"] is None
    assert "" not in rows
    text = bcd("status", "--root", str(root), "--data-dir", str(data_dir)).stdout
    [line3] = [line for line in text.splitlines() if gpu_uuid(3) in line]
    assert line3.split()[0] == "3" and line3.endswith("instance vm-gpu-0001")
    [line_unlisted] = [line for line in text.splitlines() if unlisted in line]
    assert line_unlisted.startswith("?") and "passed through" in line_unlisted
    [line5] = [line for line in text.splitlines() if gpu_uuid(5) in line]
    assert line5.endswith(" -")


async def test_a_gpu_both_held_and_passed_through_shows_both(tmp_path: Path) -> None:
    """A conflict (a hold's CDI file and an instance name the same GPU) is shown as such, not hidden:
    `bcd status` over a real hold (the example's, bound on the simulated host) and a published
    passthrough map naming the same GPU shows the allocation and the instance on its row."""
    from bcd_agent.status import HolderRow

    root, data_dir = sim_root(tmp_path), tmp_path / "data"
    status = await converge_example(root, data_dir, "gpu-node.json")
    write_status(data_dir, status, now_monotonic=11.0, extra={"passthrough": {gpu_uuid(0): "vm-1"}})
    _rc, doc = await trio.to_thread.run_sync(
        lambda: bcd_json("status", "--root", str(root), "--data-dir", str(data_dir))
    )
    rows = {r["device"]: r for r in doc["holders"]}
    assert (rows[gpu_uuid(0)]["holder"], rows[gpu_uuid(0)]["instance"]) == ("alloc_train_0001", "vm-1")
    assert (rows[gpu_uuid(1)]["holder"], rows[gpu_uuid(1)]["instance"]) == ("alloc_train_0001", None)
    text = await trio.to_thread.run_sync(
        lambda: bcd("status", "--root", str(root), "--data-dir", str(data_dir)).stdout
    )
    [line0] = [line for line in text.splitlines() if gpu_uuid(0) in line and "/gi" not in line]
    assert line0.endswith("alloc_train_0001, instance vm-1")
    assert HolderRow(0, gpu_uuid(0), "gpu", "", "", "").holders() == "-"
    assert HolderRow(0, gpu_uuid(0), "gpu", "", "alloc_a").holders() == "alloc_a"


def test_text_the_node_chose_never_reaches_the_terminal_raw(tmp_path: Path) -> None:
    """status.json is the node's file, and `bcd status` is often run as root: a section message, a
    condition or an instance id carrying terminal escapes (a title, a clipboard write, a screen clear) or a
    newline is shown escaped, on its own line, in the table and in `--check`'s FAIL line."""
    root, data_dir = sim_root(tmp_path), tmp_path / "data"
    evil = "\x1b]52;c;cm0gLXJmIH4=\x07\x1b[2J\nFAKE LINE\u202e"
    status = NodeStatus(
        version=1,
        applied_generation=3,
        observed_generation=2,
        spec_hash="h",
        sections=(SectionStatus("devices", SectionState.PROGRESSING, 3, "R", evil),),
        conditions=(Condition("RebootRequired", "hugepages", evil, "host", since_monotonic=10.0),),
        passes=1,
        last_pass_monotonic=0.0,
    )
    session = {"state": "disconnected", "since": time.time() - 1000, "last_error": evil}
    extra = {"passthrough": {gpu_uuid(3): evil}, "node": {"session": session}}
    write_status(data_dir, status, now_monotonic=11.0, extra=extra)
    text = bcd("status", "--root", str(root), "--data-dir", str(data_dir)).stdout
    assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text
    assert not any(line.startswith("FAKE LINE") for line in text.splitlines())
    assert text.count("\\x1b]52;c;cm0gLXJmIH4=\\x07\\x1b[2J\\nFAKE LINE\\u202e") == 4
    check = bcd("status", "--check", "--data-dir", str(data_dir)).stdout
    assert check.startswith("FAIL: disconnected for ") and "\x1b" not in check and check.count("\n") == 1


def test_plan_doctor_and_journal_views_escape_what_they_quote() -> None:
    """`bcd plan`, `bcd doctor` and `bcd journal` quote the spec, files, tools' output and the journal's
    rows: an escape or a newline in any of them is shown escaped, never sent to the terminal raw."""
    from bcd_agent import doctor, journalcli, plan

    evil = "x\x1b[2J\nFAKE\u202e"
    escaped = "x\\x1b[2J\\nFAKE\\u202e"
    out = plan.render([plan.SectionPlan("host", "host units", steps=(evil,), notes=(evil,))])
    assert "\x1b" not in out and out.count(escaped) == 2
    out = doctor.render([doctor.Finding("config", "fail", evil, fix=evil)])
    assert "\x1b" not in out and escaped in out
    meta = {"journal_id": evil, "node_id": "n", "next_event_seq": 1, "acked_event_seq": 0, "last_epoch": 1,
            "applied_generation": 0, "server_time_mark": 0.0}  # fmt: skip
    out = journalcli.render(journalcli.JournalView("/j", 1, meta, None, (), ()))
    assert "\x1b" not in out and escaped in out


def test_DEV_SEE_01_each_gpu_shows_its_whole_mig_and_slot_holders(tmp_path: Path) -> None:
    """Covers DEV-SEE-01 for each way of holding a GPU: held whole (on the GPU's row), by a MIG instance
    and by a slot (each on a row under its GPU, with the GPU's index), and the free ones shown free."""
    from bcd_agent.sections.devices.model import DeviceAssignment, DeviceRef, DevicesSpec
    from bcd_agent.status import read_holders
    from devices.devhost import Host

    root = sim_root(tmp_path)
    g0, g3, g7 = gpu_uuid(0), gpu_uuid(3), gpu_uuid(7)
    out = Host(root).run(
        DevicesSpec(
            1,
            (
                DeviceAssignment("whole", "r", "BINDING_HOLD", (DeviceRef(g0, "gpu"),)),
                DeviceAssignment("mig", "r", "BINDING_HOLD", (DeviceRef(f"{g7}/gi2/ci0", "gpu.mig"),)),
                DeviceAssignment("slot", "r", "BINDING_HOLD", (DeviceRef(f"{g3}/s1", "gpu.slot"),)),
            ),
        )
    )
    assert out.state is SectionState.CONVERGED, out.message
    rows = [(r.gpu_index, r.device, r.kind, r.holder) for r in read_holders(sim_system(root)).rows]
    assert (0, g0, "gpu", "whole") in rows and (1, gpu_uuid(1), "gpu", "") in rows
    assert rows[rows.index((3, g3, "gpu", "")) + 1] == (3, f"{g3}/s1", "gpu.slot", "slot")
    assert (7, f"{g7}/gi2/ci0", "gpu.mig", "mig") in rows and (7, f"{g7}/gi1/ci0", "gpu.mig", "") in rows
    assert [r for r in rows if r[3]] == [
        (0, g0, "gpu", "whole"),
        (3, f"{g3}/s1", "gpu.slot", "slot"),
        (7, f"{g7}/gi2/ci0", "gpu.mig", "mig"),
    ]
