"""slice.apply and slice.remove called in process over a temporary root whose programs are recorded: the
argument rules word for word, the exact `systemctl` argv, the cgroup files written, the remove rule
(DEV-SLICE-07..24; docs/mutation.md)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from bcd_helper.ops import slices
from bcd_helper.ops.base import Failed, HelperContext, Refused
from bcd_helper.ops.slices import (
    MAX_CPULIST,
    MAX_MEMORY,
    MAX_MILLIS,
    MAX_PAGES,
    SliceApply,
    SliceRemove,
    check_cpulist,
    check_reset,
    properties,
    slice_apply,
    slice_remove,
)
from opskit import call, context, make_root, programs, refused

NAME = "bcd-alloc-a1.slice"
CG = f"sys/fs/cgroup/bcd.slice/bcd-alloc.slice/{NAME}"


@pytest.fixture
def ctx(tmp_path: Path) -> Iterator[HelperContext]:
    c = context(make_root(tmp_path))
    yield c
    c.audit.close()


# --- the argument rules ---------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["0", "0-3", "1,3,5-7", "65535", "0-65535", "7-7"])
def test_a_cpulist_is_taken(value: str) -> None:
    assert check_cpulist(value, "cpus") == value


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("", "cpus: empty"),
        ("a", "cpus: 'a' is not N or N-M"),
        ("1-", "cpus: '1-' is not N or N-M"),
        ("1,,2", "cpus: '' is not N or N-M"),
        (" 1", "cpus: ' 1' is not N or N-M"),
        ("123456", "cpus: '123456' is not N or N-M"),
        ("1-2-3", "cpus: '1-2-3' is not N or N-M"),
        ("3-1", "cpus: '3-1' is not an increasing range below 65536"),
        ("65536", "cpus: '65536' is not an increasing range below 65536"),
        ("0-65536", "cpus: '0-65536' is not an increasing range below 65536"),
    ],
)
def test_a_bad_cpulist_is_named(value: str, message: str) -> None:
    assert refused(check_cpulist, value, "cpus") == ("bad-cpulist", message)


def test_a_cpulist_at_the_length_limit() -> None:
    at = ",".join(["1"] * (MAX_CPULIST // 2)) + "1" * (MAX_CPULIST % 2)
    at = ("1," * MAX_CPULIST)[: MAX_CPULIST - 1] + "1" if len(at) != MAX_CPULIST else at
    assert len(at) == MAX_CPULIST
    assert check_cpulist(at, "mems") == at
    assert refused(check_cpulist, at + "1", "mems") == (
        "bad-cpulist",
        f"mems: longer than {MAX_CPULIST} characters",
    )


@pytest.mark.parametrize("name", [NAME, "bcd-alloc-A_b9.slice", "bcd-alloc-" + "x" * 80 + ".slice"])
def test_a_hold_slice_name_is_taken(name: str) -> None:
    assert slices.check_slice_name(name) == name


@pytest.mark.parametrize(
    "name",
    [
        "bcd-alloc-.slice",
        "bcd-alloc-" + "x" * 81 + ".slice",
        "bcd-alloc-a-b.slice",
        "bcd-alloc-a1.slice\n",
        "xbcd-alloc-a1.slice",
        "bcd-alloc-a1.service",
        "bcd-alloc-a1xslice",
        "system.slice",
    ],
)
def test_a_name_that_is_not_a_hold_slice_is_refused(name: str) -> None:
    assert refused(slices.check_slice_name, name) == (
        "bad-slice-name",
        f"{name!r} is not a hold slice name (bcd-alloc-<allocation-id>.slice)",
    )


def test_the_properties_of_every_limit() -> None:
    req = SliceApply(NAME, cpus="0-3", mems="0", cpu_millis=1501, memory_bytes=1000, hugepages_2mi=1)
    assert properties(req) == [
        "AllowedCPUs=0-3",
        "AllowedMemoryNodes=0",
        "CPUQuota=151%",
        "MemoryMax=1000",
        "MemoryHigh=900",
    ]
    assert properties(SliceApply(NAME, cpu_millis=1500)) == ["CPUQuota=150%"]
    assert properties(SliceApply(NAME, cpu_millis=0, memory_bytes=0)) == [
        "CPUQuota=0%",
        "MemoryMax=0",
        "MemoryHigh=0",
    ]
    assert properties(SliceApply(NAME, memory_bytes=19)) == ["MemoryMax=19", "MemoryHigh=17"]
    assert properties(SliceApply(NAME)) == []


def test_resets_come_first_with_systemds_defaults() -> None:
    req = SliceApply(NAME, cpus="1", reset=("memory_bytes", "mems", "cpu_millis", "hugepages_2mi"))
    assert check_reset(req) == ("memory_bytes", "mems", "cpu_millis", "hugepages_2mi")
    assert properties(req) == [
        "MemoryMax=infinity",
        "MemoryHigh=infinity",
        "AllowedMemoryNodes=",
        "CPUQuota=",
        "AllowedCPUs=1",
    ]
    assert properties(SliceApply(NAME, reset=("cpus",))) == ["AllowedCPUs="]


@pytest.mark.parametrize(
    ("req", "message"),
    [
        (
            SliceApply(NAME, reset=("nope",)),
            "reset: 'nope' is not a limit (one of cpus, mems, cpu_millis, "
            "memory_bytes, hugepages_2mi, hugepages_1gi)",
        ),
        (
            SliceApply(NAME, reset=("x" * 50,)),
            f"reset: {'x' * 40!r} is not a limit (one of cpus, mems, "
            "cpu_millis, memory_bytes, hugepages_2mi, hugepages_1gi)",
        ),
        (SliceApply(NAME, reset=("cpus", "cpus")), "reset: cpus is listed twice"),
        (SliceApply(NAME, cpus="1", reset=("cpus",)), "reset: cpus is also given"),
        (SliceApply(NAME, cpu_millis=0, reset=("cpu_millis",)), "reset: cpu_millis is also given"),
        (
            SliceApply(NAME, hugepages_1gi=1, reset=("hugepages_2mi",)),
            "reset: hugepages_2mi while hugepages_1gi is given (a hold gets the huge pages it booked and no "
            "others: that size is then 0)",
        ),
        (
            SliceApply(NAME, hugepages_2mi=0, reset=("hugepages_1gi",)),
            "reset: hugepages_1gi while hugepages_2mi is given (a hold gets the huge pages it booked and no "
            "others: that size is then 0)",
        ),
    ],
)
def test_a_bad_reset_is_named(req: SliceApply, message: str) -> None:
    assert refused(check_reset, req) == ("bad-reset", message)


def test_both_huge_page_sizes_may_be_reset_together() -> None:
    assert check_reset(SliceApply(NAME, reset=("hugepages_2mi", "hugepages_1gi"))) == (
        "hugepages_2mi",
        "hugepages_1gi",
    )
    assert check_reset(SliceApply(NAME, cpus="1", reset=("hugepages_1gi",))) == ("hugepages_1gi",)


@pytest.mark.parametrize(
    ("field", "hi"),
    [
        ("cpu_millis", MAX_MILLIS),
        ("memory_bytes", MAX_MEMORY),
        ("hugepages_2mi", MAX_PAGES),
        ("hugepages_1gi", MAX_PAGES),
    ],
)
def test_limits_are_bounded(ctx: HelperContext, field: str, hi: int) -> None:
    for bad in (-1, hi + 1):
        assert refused(slice_apply, call(ctx), SliceApply(NAME, **{field: bad})) == (
            "bad-limit",
            f"{field}: must be from 0 to {hi}",
        )
    assert programs(ctx).runs == []  # refused before any program


# --- apply ------------------------------------------------------------------------------------------------


def cgroup_files(root: Path, *, hugetlb: bool = True) -> None:
    for parent in ("sys/fs/cgroup", "sys/fs/cgroup/bcd.slice", "sys/fs/cgroup/bcd.slice/bcd-alloc.slice"):
        (root / parent).mkdir(parents=True, exist_ok=True)
        (root / parent / "cgroup.subtree_control").write_bytes(b"")
    (root / CG).mkdir(parents=True, exist_ok=True)
    if hugetlb:
        for f in ("hugetlb.2MB.max", "hugetlb.1GB.max"):
            (root / CG / f).write_bytes(b"old")


def test_apply_starts_the_slice_then_sets_its_properties_at_runtime(ctx: HelperContext) -> None:
    got = slice_apply(call(ctx), SliceApply(NAME, cpus="0-1", memory_bytes=100))
    assert programs(ctx).runs == [
        ("systemctl", "start", NAME),
        ("systemctl", "set-property", "--runtime", NAME, "AllowedCPUs=0-1", "MemoryMax=100", "MemoryHigh=90"),
    ]
    assert got == {
        "name": NAME,
        "cgroup": "/" + CG,
        "properties": ["AllowedCPUs=0-1", "MemoryMax=100", "MemoryHigh=90"],
        "reset": [],
    }


def test_apply_without_limits_only_starts(ctx: HelperContext) -> None:
    assert slice_apply(call(ctx), SliceApply(NAME))["properties"] == []
    assert programs(ctx).runs == [("systemctl", "start", NAME)]


def test_huge_pages_are_enabled_up_the_tree_and_both_sizes_written(ctx: HelperContext) -> None:
    cgroup_files(ctx.root)
    slice_apply(call(ctx), SliceApply(NAME, hugepages_2mi=3))
    for parent in ("sys/fs/cgroup", "sys/fs/cgroup/bcd.slice", "sys/fs/cgroup/bcd.slice/bcd-alloc.slice"):
        assert (ctx.root / parent / "cgroup.subtree_control").read_bytes() == b"+hugetlb"
    assert (ctx.root / CG / "hugetlb.2MB.max").read_bytes() == str(3 * 2 * 1024 * 1024).encode()
    assert (ctx.root / CG / "hugetlb.1GB.max").read_bytes() == b"0"
    slice_apply(call(ctx), SliceApply(NAME, hugepages_1gi=2))
    assert (ctx.root / CG / "hugetlb.1GB.max").read_bytes() == str(2 << 30).encode()
    assert (ctx.root / CG / "hugetlb.2MB.max").read_bytes() == b"0"
    slice_apply(call(ctx), SliceApply(NAME, hugepages_2mi=0))
    assert (ctx.root / CG / "hugetlb.2MB.max").read_bytes() == b"0"
    assert (ctx.root / "sys/fs/cgroup/cgroup.subtree_control").read_bytes() == b"+hugetlb"


def test_no_huge_pages_writes_no_cgroup_file(ctx: HelperContext) -> None:
    cgroup_files(ctx.root)
    slice_apply(call(ctx), SliceApply(NAME, cpus="0"))
    assert (ctx.root / "sys/fs/cgroup/cgroup.subtree_control").read_bytes() == b""
    assert (ctx.root / CG / "hugetlb.2MB.max").read_bytes() == b"old"


def test_a_reset_huge_page_size_gets_max_where_the_file_exists(ctx: HelperContext) -> None:
    cgroup_files(ctx.root)
    got = slice_apply(call(ctx), SliceApply(NAME, reset=("hugepages_1gi",)))
    assert got["reset"] == ["hugepages_1gi"] and got["properties"] == []
    assert (ctx.root / CG / "hugetlb.1GB.max").read_bytes() == b"max"
    assert (ctx.root / CG / "hugetlb.2MB.max").read_bytes() == b"old"
    (ctx.root / CG / "hugetlb.2MB.max").unlink()
    slice_apply(call(ctx), SliceApply(NAME, reset=("hugepages_2mi",)))  # no file: no such limit to reset
    assert not (ctx.root / CG / "hugetlb.2MB.max").exists()
    assert programs(ctx).runs == [("systemctl", "start", NAME)] * 2


def test_a_missing_cgroup_file_fails_naming_it(ctx: HelperContext) -> None:
    cgroup_files(ctx.root, hugetlb=False)
    with pytest.raises(Failed) as info:
        slice_apply(call(ctx), SliceApply(NAME, hugepages_2mi=1))
    assert (info.value.reason, info.value.message) == (
        "cgroup",
        f"writing /{CG}/hugetlb.2MB.max: No such file or directory",
    )


def test_a_symlinked_cgroup_file_is_refused(ctx: HelperContext, tmp_path: Path) -> None:
    cgroup_files(ctx.root)
    target = ctx.root / CG / "hugetlb.2MB.max"
    target.unlink()
    target.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(Failed) as info:
        slice_apply(call(ctx), SliceApply(NAME, hugepages_2mi=1))
    assert (info.value.reason, info.value.message) == (
        "cgroup",
        f"writing /{CG}/hugetlb.2MB.max: Too many levels of symbolic links",
    )
    assert not (tmp_path / "elsewhere").exists()  # never followed


def test_a_failing_systemctl_fails_the_call(tmp_path: Path) -> None:
    ctx = context(
        make_root(tmp_path),
        script=lambda argv: (
            (1, b"", b"Unit not found.\nmore") if argv[1] == "set-property" else (0, b"", b"")
        ),
    )
    with pytest.raises(Failed) as info:
        slice_apply(call(ctx), SliceApply(NAME, cpus="1"))
    assert (info.value.reason, info.value.message) == ("systemctl", "systemctl exited 1: Unit not found.")
    ctx.audit.close()


def test_a_bad_name_runs_nothing(ctx: HelperContext) -> None:
    assert refused(slice_apply, call(ctx), SliceApply("x.slice"))[0] == "bad-slice-name"
    assert refused(slice_remove, call(ctx), SliceRemove("x.slice"))[0] == "bad-slice-name"
    assert programs(ctx).runs == []


# --- remove -----------------------------------------------------------------------------------------------


def events(root: Path, text: str) -> None:
    (root / CG).mkdir(parents=True, exist_ok=True)
    (root / CG / "cgroup.events").write_text(text)


def test_remove_stops_only_an_empty_slice(ctx: HelperContext) -> None:
    assert slice_remove(call(ctx), SliceRemove(NAME)) == {
        "name": NAME,
        "stopped": False,
        "populated": False,
        "absent": True,
    }
    events(ctx.root, "populated 1\nfrozen 0\n")
    assert slice_remove(call(ctx), SliceRemove(NAME)) == {
        "name": NAME,
        "stopped": False,
        "populated": True,
        "absent": False,
    }
    assert programs(ctx).runs == []
    events(ctx.root, "frozen 0\npopulated 0 \n")
    assert slice_remove(call(ctx), SliceRemove(NAME)) == {
        "name": NAME,
        "stopped": True,
        "populated": False,
        "absent": False,
    }
    assert programs(ctx).runs == [("systemctl", "stop", NAME)]


def test_remove_fails_when_the_events_file_has_no_populated_line(ctx: HelperContext) -> None:
    events(ctx.root, "frozen 0\npopulatedx 0\n")
    with pytest.raises(Failed) as info:
        slice_remove(call(ctx), SliceRemove(NAME))
    assert (info.value.reason, info.value.message) == ("cgroup", f"/{CG}/cgroup.events has no populated line")


def test_a_symlinked_directory_on_the_way_is_refused(ctx: HelperContext, tmp_path: Path) -> None:
    cgroup_files(ctx.root)
    real = ctx.root / "sys/fs/cgroup/bcd.slice"
    real.rename(tmp_path / "moved")
    real.symlink_to(tmp_path / "moved")
    with pytest.raises(Refused) as info:
        slice_apply(call(ctx), SliceApply(NAME, hugepages_2mi=1))
    assert info.value.reason == "root-only"
    assert info.value.message.startswith("/sys/fs/cgroup/bcd.slice")
    assert (tmp_path / "moved/cgroup.subtree_control").read_bytes() == b""


def test_limits_at_their_bounds_are_taken(ctx: HelperContext) -> None:
    req = SliceApply(NAME, cpu_millis=MAX_MILLIS, memory_bytes=MAX_MEMORY, hugepages_2mi=MAX_PAGES)
    cgroup_files(ctx.root)
    got = slice_apply(call(ctx), req)
    assert got["properties"][0] == f"CPUQuota={-(-MAX_MILLIS // 10)}%"


def test_a_bad_cpulist_names_its_field(ctx: HelperContext) -> None:
    assert refused(slice_apply, call(ctx), SliceApply(NAME, cpus="x")) == (
        "bad-cpulist",
        "cpus: 'x' is not N or N-M",
    )
    assert refused(slice_apply, call(ctx), SliceApply(NAME, mems="")) == ("bad-cpulist", "mems: empty")


def test_kernel_files_are_written_in_place_never_created(ctx: HelperContext) -> None:
    cgroup_files(ctx.root)
    path = f"/{CG}/hugetlb.1GB.max"
    assert slices.write_kernel_file(call(ctx), path, b"7") is True
    assert (ctx.root / CG / "hugetlb.1GB.max").read_bytes() == b"7"
    assert slices.write_kernel_file(call(ctx), f"/{CG}/nope", b"7", missing_ok=True) is False
    assert not (ctx.root / CG / "nope").exists()
    gone = "sys/fs/cgroup/bcd.slice/bcd-alloc.slice/bcd-alloc-gone.slice"
    with pytest.raises(Failed):
        slices.write_kernel_file(call(ctx), f"/{gone}/hugetlb.2MB.max", b"1")
    assert not (ctx.root / gone).exists()  # a missing cgroup is never made by a write


def test_a_hold_file_names_its_slice_decoded_and_fails_closed(ctx: HelperContext) -> None:
    """`names_slice` (slice.remove's `hold-exists` with roots): a CDI spec names the slice when any of
    its strings, decoded, holds the name (a JSON escape hides nothing), an env file when its bytes do; a
    file that is absent names nothing; one root cannot decode, or cannot read under the root-only rule
    (a symlink), names it."""
    import os

    name = "bcd-alloc-a.slice"
    cdi_path, env_path = "/etc/cdi/bcd-a.json", "/run/bcd/allocations/a.env"
    host = ctx.root

    def put(path: str, data: bytes) -> None:
        target = host / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_symlink() or target.exists():
            target.unlink()
        target.write_bytes(data)

    c = call(ctx)
    assert slices.names_slice(c, cdi_path, name) is False  # absent
    put(cdi_path, b'{"annotations":{"bcd.dev/cgroup-parent":"bcd-alloc-a\\u002eslice"}}')
    assert slices.names_slice(c, cdi_path, name) is True
    put(cdi_path, b'{"devices":[{"containerEdits":{"env":["BCD_CGROUP_PARENT=bcd-alloc-a.slice"]}}]}')
    assert slices.names_slice(c, cdi_path, name) is True
    put(cdi_path, b'{"bcd-alloc-a.slice":1}')  # a key is a string too
    assert slices.names_slice(c, cdi_path, name) is True
    put(cdi_path, b'{"annotations":{"bcd.dev/cgroup-parent":"bcd-alloc-ab.slice"},"n":[1,true,null]}')
    assert slices.names_slice(c, cdi_path, name) is False
    put(cdi_path, b'{"annotations":')  # cannot decode
    assert slices.names_slice(c, cdi_path, name) is True
    put(cdi_path, b"[" * 300_000 + b"]" * 300_000)  # past the hold's value bound
    assert slices.names_slice(c, cdi_path, name) is True
    from bcd_helper.ops.files import MAX_CONTENT, MAX_HOLD_VALUES

    put(cdi_path, b"[" + b"0," * (MAX_HOLD_VALUES - 1) + b"0]")  # at the bound: decoded
    assert slices.names_slice(c, cdi_path, name) is False
    put(cdi_path, b'"' + b"x" * MAX_CONTENT + b'"')  # larger than a hold root writes
    assert slices.names_slice(c, cdi_path, name) is True
    (host / cdi_path.lstrip("/")).unlink()  # (the suite checks every CDI spec left under a test's root)
    put(env_path, b"BCD_RESERVATION_ID=r1\nNVIDIA_VISIBLE_DEVICES=GPU-1\n")
    assert slices.names_slice(c, env_path, name) is False
    put(env_path, b"BCD_CGROUP_PARENT=bcd-alloc-a.slice\n")
    assert slices.names_slice(c, env_path, name) is True
    (host / env_path.lstrip("/")).unlink()
    os.symlink("/etc/hostname", host / env_path.lstrip("/"))  # not readable under the rule
    assert slices.names_slice(c, env_path, name) is True
