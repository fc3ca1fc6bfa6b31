"""bcd_shared.cdi word for word: each refusal names its field and rule, each limit at the limit and one
past, each naming regex with several bad inputs (issue 14, mutation testing of `cdi`).

The documents are bcd's own hold specs (from `build_hold_spec`) and NVIDIA-style vendor specs, changed
one field at a time.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from bcd_shared import cdi
from bcd_shared.cdi import CdiError

ALLOC_RULE = "must match ^[A-Za-z0-9_]{1,80}$"
ENV_RULE = "must be KEY=VALUE with KEY of [A-Za-z_][A-Za-z0-9_]*"


def _errors(doc: Any) -> list[str]:
    return cdi.naming_errors(doc)


def _hold(**over: Any) -> dict[str, Any]:
    args: dict[str, Any] = {
        "allocation_id": "a_1",
        "reservation_id": "r-9",
        "generation": 12,
        "kubernetes": False,
        "cgroup_parent": None,
        "devices": [cdi.HoldDevice("GPU-1/s2"), cdi.HoldDevice("GPU-2")],
        "env": ["BCD_ALLOCATION_ID=a_1"],
        "vendor": None,
    }
    args.update(over)
    return cdi.build_hold_spec(**args)


def _parse_error(doc: Any, allocation_id: str | None = None) -> str:
    data = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    with pytest.raises(CdiError) as exc:
        cdi.parse_hold_spec(data, allocation_id)
    return str(exc.value)


# --- allocation ids and file names ---------------------------------------------------------------


@pytest.mark.parametrize("bad", ["", "a-b", "a/b", "../x", "a b", "a\n", "é", "a" * 81, "a.json"])
def test_allocation_ids_refused_naming_the_rule(bad: str) -> None:
    for call in (cdi.check_allocation_id, cdi.cdi_spec_path, cdi.env_file_path):
        with pytest.raises(CdiError) as exc:
            call(bad)
        assert str(exc.value) == f"allocation id {bad!r} {ALLOC_RULE}"


def test_allocation_id_paths_and_the_80_character_limit() -> None:
    assert cdi.cdi_spec_path("a_1") == "/etc/cdi/bcd-a_1.json"
    assert cdi.env_file_path("a_1") == "/run/bcd/allocations/a_1.env"
    assert cdi.check_allocation_id("Z" * 80) == "Z" * 80


@pytest.mark.parametrize(
    ("name", "alloc"),
    [
        ("bcd-a_1.json", "a_1"),
        ("bcd-" + "x" * 80 + ".json", "x" * 80),
        ("bcd-" + "x" * 81 + ".json", None),
        ("bcd-.json", None),
        ("bcd-a-b.json", None),
        ("bcd-a_1.JSON", None),
        ("bcd-a_1.json.tmp", None),
        ("bcd-a_1", None),
        ("xbcd-a_1.json", None),
        ("nvidia.json", None),
        ("a_1.json", None),
    ],
)
def test_allocation_of_spec_file(name: str, alloc: str | None) -> None:
    assert cdi.allocation_of_spec_file(name) == alloc


class _Files:
    def __init__(self, files: dict[str, bytes | None]) -> None:
        self.files = files
        self.listed: list[str] = []
        self.read: list[str] = []

    def listdir(self, path: str) -> list[str]:
        self.listed.append(path)
        return list(self.files)

    def read_bytes(self, path: str) -> bytes | None:
        self.read.append(path)
        return self.files[path.rpartition("/")[2]]


def test_hold_spec_files_skips_other_names_and_vanished_files() -> None:
    files = _Files(
        {"nvidia.json": b"v", "bcd-a.json": b"A", "bcd-gone.json": None, "bcd-b.json": b"B", "x": b""}
    )
    got = list(cdi.hold_spec_files(files))  # type: ignore[arg-type]
    assert got == [("a", "/etc/cdi/bcd-a.json", b"A"), ("b", "/etc/cdi/bcd-b.json", b"B")]
    assert files.listed == ["/etc/cdi"]
    assert files.read == ["/etc/cdi/bcd-a.json", "/etc/cdi/bcd-gone.json", "/etc/cdi/bcd-b.json"]


# --- CDI's naming rules ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "ok"),
    [
        ("bcd.dev/allocation-id", True),
        ("name", True),
        ("a" * 63, True),
        ("a" * 64, False),
        ("a" * 253 + "/n", True),
        ("a" * 254 + "/n", False),
        ("a" * 253 + "/" + "b" * 63, True),  # the longest key the rule allows (317 characters)
        ("a" * 253 + "/" + "b" * 64, False),
        ("/n", False),
        ("bcd.dev/", False),
        ("Bcd.dev/n", False),
        ("bcd..dev/n", False),
        ("-bcd.dev/n", False),
        ("bcd.dev-/n", False),
        ("bcd.dev/-n", False),
        ("bcd.dev/n-", False),
        ("bcd.dev/n_x.y-Z9", True),
        ("a/b/c", False),
        ("bcd dev/n", False),
    ],
)
def test_annotation_keys(key: str, ok: bool) -> None:
    assert cdi.valid_annotation_key(key) is ok


def test_annotation_keys_are_remembered_only_when_short_enough_to_be_valid() -> None:
    """The rule's memo (a hold names the same few keys at every write) keeps at most 256 keys, each at most
    317 characters: a node sending long or many keys cannot grow it."""
    long_key = "a" * 253 + "/" + "b" * 64
    before = cdi._annotation_key_rule.cache_info()
    assert cdi.valid_annotation_key(long_key) is False
    assert cdi._annotation_key_rule.cache_info() == before  # not even looked up
    for i in range(600):
        assert cdi.valid_annotation_key(f"bcd.dev/k{i}") is True
    assert cdi._annotation_key_rule.cache_info().currsize == 256


def test_kind_and_device_name_rules() -> None:
    for good in ("bcd.dev/gpu", "a/b", "nvidia.com/gpu", "a-b_c.d/x9"):
        assert cdi.valid_kind(good), good
    for bad in ("bcd.dev", "/gpu", "bcd/", "1a/b", "a/b-", "a/b/c", "a./b", "a/9", "a /b", ""):
        assert not cdi.valid_kind(bad), bad
    for good in ("0", "GPU-1_s2", "a:b.c-d", "MIG-x:1"):
        assert cdi.valid_device_name(good), good
    for bad in ("", "a/b", "-a", "a-", ":a", "a b", "a\n"):
        assert not cdi.valid_device_name(bad), bad


def _doc(**over: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "cdiVersion": "0.6.0",
        "kind": "bcd.dev/gpu",
        "devices": [{"name": "d0", "containerEdits": {"env": ["A=1"]}}],
    }
    doc.update(over)
    return doc


def test_a_document_that_loads_has_no_errors() -> None:
    assert _errors(_doc()) == []
    assert _errors(_hold()) == []


@pytest.mark.parametrize(
    ("doc", "errors"),
    [
        ([], ["spec: must be a JSON object"]),
        ("x", ["spec: must be a JSON object"]),
        (_doc(cdiVersion="six"), ["cdiVersion: cdiVersion 'six' is not a version (MAJOR.MINOR.PATCH)"]),
        (_doc(cdiVersion=6), ["cdiVersion: missing"]),
        ({"kind": "bcd.dev/gpu", "devices": []}, ["cdiVersion: missing"]),
        # "missing" is said only when nothing else is wrong
        ({"kind": "bcd.dev/gpu", "devices": [], "x": 1}, ["spec.x: unknown field"]),
        (_doc(kind="bcd"), ["kind 'bcd': must be vendor/class with CDI's character rules"]),
        (_doc(kind=7), ["kind 7: must be vendor/class with CDI's character rules"]),
        (_doc(annotations=["a"]), ["annotations: must be an object of strings"]),
        (
            _doc(annotations={"A/b": "x", "k": 1}),
            [
                "annotations: key 'A/b' breaks the Kubernetes annotation key rules",
                "annotations.k: value must be a string",
            ],
        ),
        (_doc(containerEdits=[]), ["containerEdits: must be an object"]),
        (_doc(containerEdits={"foo": 1}), ["containerEdits.foo: unknown field"]),
        (_doc(containerEdits={"env": "A=1"}), ["containerEdits.env: must be a list of KEY=VALUE strings"]),
        (_doc(containerEdits={"env": ["A"]}), ["containerEdits.env: must be a list of KEY=VALUE strings"]),
        (_doc(containerEdits={"env": [1]}), ["containerEdits.env: must be a list of KEY=VALUE strings"]),
        (_doc(devices={}), ["devices: must be a list"]),
        (_doc(devices=None), ["devices: must be a list"]),
        (
            _doc(devices=["x", {"name": "-", "containerEdits": {}}]),
            ["devices[0]: must be an object", "devices[1].name '-': breaks CDI's device name rules"],
        ),
        (
            _doc(devices=[{"name": "a", "containerEdits": {}, "x": 1}]),
            ["devices[0].x: unknown field"],
        ),
        (
            _doc(devices=[{"name": "a", "containerEdits": {}}, {"name": "a", "containerEdits": {}}]),
            ["devices[1].name 'a': listed twice"],
        ),
        (
            _doc(devices=[{"name": "a", "containerEdits": {}}, {"name": "b", "containerEdits": {}}]),
            [],
        ),
        (
            _doc(devices=[{"name": 3, "containerEdits": {}}]),
            ["devices[0].name 3: breaks CDI's device name rules"],
        ),
        (
            _doc(devices=[{"name": "a", "annotations": {"k": 1}, "containerEdits": {}}]),
            ["devices[0].annotations.k: value must be a string"],
        ),
        (
            _doc(devices=[{"name": "a", "annotations": "x", "containerEdits": {}}]),
            ["devices[0].annotations: must be an object of strings"],
        ),
        (_doc(devices=[{"name": "a"}]), ["devices[0].containerEdits: required"]),
        (
            _doc(devices=[{"name": "a", "containerEdits": {"env": ["B"], "bad": 1}}]),
            [
                "devices[0].containerEdits.bad: unknown field",
                "devices[0].containerEdits.env: must be a list of KEY=VALUE strings",
            ],
        ),
        (
            _doc(devices=[{"name": "a", "containerEdits": 1}]),
            ["devices[0].containerEdits: must be an object"],
        ),
        # the version rule is checked only when nothing else is wrong
        (
            _doc(cdiVersion="0.5.0", annotations={"a": "b"}),
            ["cdiVersion 0.5.0: the content needs at least 0.6.0"],
        ),
        (_doc(cdiVersion="0.5.0", annotations={"a": "b"}, x=1), ["spec.x: unknown field"]),
        (
            _doc(
                cdiVersion="0.5.0", devices=[{"name": "a", "annotations": {"a": "b"}, "containerEdits": {}}]
            ),
            ["cdiVersion 0.5.0: the content needs at least 0.6.0"],
        ),
        (
            _doc(devices=[{"name": "a", "containerEdits": {"intelRdt": {"closID": "c"}}}]),
            ["cdiVersion 0.6.0: the content needs at least 0.7.0"],
        ),
        (
            _doc(
                cdiVersion="0.7.0",
                devices=[{"name": "a", "containerEdits": {"netDevices": [{"hostInterfaceName": "e"}]}}],
            ),
            ["cdiVersion 0.7.0: the content needs at least 1.0.0"],
        ),
        (_doc(cdiVersion="v1.0.0", containerEdits={"netDevices": [{"hostInterfaceName": "e"}]}), []),
    ],
)
def test_naming_errors_word_for_word(doc: Any, errors: list[str]) -> None:
    assert _errors(doc) == errors


def test_version_keys() -> None:
    assert cdi.version_key("v0.10.2") == (0, 10, 2)
    assert cdi.later_version("0.10.0", "0.9.9") == "0.10.0"
    assert cdi.later_version("0.6.0", "0.6.0") == "0.6.0"
    for bad in ("0.6", "0.6.0.1", "x0.6.0", "0.6.0 ", "0.6.a"):
        with pytest.raises(CdiError) as exc:
            cdi.version_key(bad)
        assert str(exc.value) == f"cdiVersion {bad!r} is not a version (MAJOR.MINOR.PATCH)"


# --- the vendor spec --------------------------------------------------------------------------------


def _vendor_error(data: bytes) -> str:
    with pytest.raises(CdiError) as exc:
        cdi.parse_vendor_spec(data)
    return str(exc.value)


def test_vendor_spec_refusals() -> None:
    assert _vendor_error(b"{").startswith("vendor spec is not JSON: Expecting property name")
    assert _vendor_error(b"\xff").startswith("vendor spec is not JSON: ")
    no_list = "vendor spec: not a CDI spec (no devices list)"
    assert _vendor_error(b"[]") == no_list
    assert _vendor_error(b'{"cdiVersion": "0.6.0", "devices": "x"}') == no_list
    assert _vendor_error(b'{"cdiVersion": "0.6.0"}') == no_list
    assert _vendor_error(b'{"devices": []}') == "vendor spec: cdiVersion missing"
    assert _vendor_error(b'{"devices": [], "cdiVersion": 6}') == "vendor spec: cdiVersion missing"
    assert _vendor_error(b'{"devices": [], "cdiVersion": "6"}') == (
        "cdiVersion '6' is not a version (MAJOR.MINOR.PATCH)"
    )


def test_vendor_spec_edits_of_the_wrong_type_are_refused_by_name() -> None:
    """A containerEdits or env of the wrong type is a CdiError naming where, never a TypeError or a bare
    ValueError from dict() (the fuzz target `cdi` found both; an internal failure in root and the agent)."""
    base = '"cdiVersion": "0.5.0"'
    assert _vendor_error(b'{%s, "devices": [], "containerEdits": "ab"}' % base.encode()) == (
        "vendor spec: containerEdits: must be an object"
    )
    assert _vendor_error(b'{%s, "devices": [], "containerEdits": [["a", 1]]}' % base.encode()) == (
        "vendor spec: containerEdits: must be an object"
    )
    assert _vendor_error(b'{%s, "devices": [], "containerEdits": {"env": 3}}' % base.encode()) == (
        "vendor spec: containerEdits.env: must be a list of strings"
    )
    assert _vendor_error(b'{%s, "devices": [], "containerEdits": {"env": ["A=1", 2]}}' % base.encode()) == (
        "vendor spec: containerEdits.env: must be a list of strings"
    )
    dev = b'{%s, "devices": [{"name": "x"}, {"name": "a", "containerEdits": [1]}]}' % base.encode()
    assert _vendor_error(dev) == "vendor spec: devices[1].containerEdits: must be an object"
    dev_env = b'{%s, "devices": [{"name": "a", "containerEdits": {"env": "A=1"}}]}' % base.encode()
    assert _vendor_error(dev_env) == "vendor spec: devices[0].containerEdits.env: must be a list of strings"
    # a device's null edits are none; a nameless device is skipped, whatever its edits
    spec = cdi.parse_vendor_spec(
        b'{%s, "devices": [{"name": "a", "containerEdits": null}, {"containerEdits": 5}]}' % base.encode()
    )
    assert dict(spec.devices) == {"a": {}}


def test_json_nested_past_the_decoder_is_a_cdi_error() -> None:
    """json stops at the recursion limit with RecursionError; every parser turns it into a CdiError."""
    assert _vendor_error(b"[" * 5000) == "vendor spec is not JSON: nested past the decoder's depth"
    with pytest.raises(CdiError, match=r"^spec is not JSON: nested past the decoder's depth$"):
        cdi.parse_hold_spec(b'{"a":' * 5000, "a1")


def test_vendor_spec_common_edits_without_void() -> None:
    def common(edits: Any) -> Any:
        doc = {"cdiVersion": "0.5.0", "devices": []}
        if edits is not ...:
            doc["containerEdits"] = edits
        return cdi.parse_vendor_spec(json.dumps(doc).encode()).common_edits

    assert common(...) == {}
    assert common(None) == {}
    assert common({"env": ["NVIDIA_VISIBLE_DEVICES=void"], "hooks": [1]}) == {"hooks": [1]}
    assert common({"env": None}) == {}
    assert common({"env": ["A=1", "NVIDIA_VISIBLE_DEVICES=void", "B=2"]}) == {"env": ["A=1", "B=2"]}


def test_vendor_devices_and_edits_for() -> None:
    spec = cdi.parse_vendor_spec(
        json.dumps(
            {
                "cdiVersion": "0.5.0",
                "devices": [
                    {"name": "0", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}]}},
                    {"name": "GPU-1"},
                    {"name": 7, "containerEdits": {}},
                    "junk",
                ],
            }
        ).encode()
    )
    assert spec.cdi_version == "0.5.0"
    assert dict(spec.devices) == {"0": {"deviceNodes": [{"path": "/dev/nvidia0"}]}, "GPU-1": {}}
    assert spec.edits_for(["GPU-9", "0"]) == {"deviceNodes": [{"path": "/dev/nvidia0"}]}
    assert spec.edits_for(["GPU-1", "0"]) == {}
    assert spec.edits_for(["all"]) is None
    wsl = cdi.VendorSpec("0.5.0", {}, {"all": {"deviceNodes": [{"path": "/dev/dxg"}]}})
    assert wsl.edits_for(["0", "GPU-1"]) == {"deviceNodes": [{"path": "/dev/dxg"}]}
    two = cdi.VendorSpec("0.5.0", {}, {"all": {"a": 1}, "1": {"b": 2}})
    assert two.edits_for(["0"]) is None
    assert two.edits_for(["1"]) == {"b": 2}


# --- reading a hold back ------------------------------------------------------------------------------


def test_a_hold_reads_back_field_for_field() -> None:
    rec = cdi.parse_hold_spec(
        cdi.encode_spec(_hold(cgroup_parent="bcd-a_1.slice", env=["BCD_ALLOCATION_ID=a_1", "X=y"])), "a_1"
    )
    assert rec == cdi.HoldRecord(
        allocation_id="a_1",
        reservation_id="r-9",
        generation=12,
        kubernetes=False,
        cgroup_parent="bcd-a_1.slice",
        device_ids=("GPU-1/s2", "GPU-2"),
        env=("BCD_ALLOCATION_ID=a_1", "X=y"),
    )
    kube = cdi.parse_hold_spec(cdi.encode_spec(_hold(kubernetes=True, env=[])))
    assert (kube.kubernetes, kube.cgroup_parent, kube.env, kube.allocation_id) == (True, None, (), "a_1")


def test_hold_read_back_defaults() -> None:
    doc = _hold()
    del doc["annotations"]["bcd.dev/reservation-id"]
    doc["annotations"]["bcd.dev/cgroup-parent"] = ""
    rec = cdi.parse_hold_spec(json.dumps(doc).encode())
    assert (rec.reservation_id, rec.cgroup_parent, rec.env) == ("", None, ("BCD_ALLOCATION_ID=a_1",))
    doc["annotations"]["bcd.dev/cgroup-parent"] = "p.slice"
    doc["containerEdits"] = {"deviceNodes": [{"path": "/dev/x"}]}
    rec = cdi.parse_hold_spec(json.dumps(doc).encode())
    assert (rec.cgroup_parent, rec.env) == ("p.slice", ())


def test_hold_refusals_word_for_word() -> None:
    assert _parse_error(b"{").startswith("spec is not JSON: Expecting property name enclosed")
    assert _parse_error(b"\xfe").startswith("spec is not JSON: ")
    assert _parse_error(_doc(kind="x", devices={})) == (
        "kind 'x': must be vendor/class with CDI's character rules; devices: must be a list"
    )
    assert (
        _parse_error(_doc(kind="nvidia.com/gpu")) == "kind 'nvidia.com/gpu': a bcd hold's kind is bcd.dev/gpu"
    )
    missing = "annotations.bcd.dev/allocation-id: missing or not an allocation id"
    doc = _hold()
    del doc["annotations"]["bcd.dev/allocation-id"]
    assert _parse_error(doc) == missing
    for bad in ("a-b", "", "x" * 81):
        doc["annotations"]["bcd.dev/allocation-id"] = bad
        assert _parse_error(doc) == missing
    assert (
        _parse_error(_hold(), "b_2")
        == "annotations.bcd.dev/allocation-id: 'a_1' is not the file's allocation 'b_2'"
    )
    gen = "annotations.bcd.dev/generation: must be a decimal generation (1 to 20 digits 0-9)"
    for bad in ("", "-1", "1.0", "x", " 1", "\u00b2", "\u0663", "1" * 21):
        doc = _hold()
        doc["annotations"]["bcd.dev/generation"] = bad
        assert _parse_error(doc) == gen, bad
    doc = _hold()
    del doc["annotations"]["bcd.dev/generation"]
    assert _parse_error(doc) == gen
    doc = _hold()
    doc["annotations"]["bcd.dev/binding"] = "Kubernetes"
    assert _parse_error(doc) == "annotations.bcd.dev/binding: 'Kubernetes' is not 'kubernetes'"
    doc = _hold()
    del doc["devices"][1]["annotations"]
    assert _parse_error(doc) == "devices[1].annotations.bcd.dev/device-id: missing"
    doc["devices"][1]["annotations"] = {"bcd.dev/device-id": ""}
    assert _parse_error(doc) == "devices[1].annotations.bcd.dev/device-id: missing"
    doc["devices"][1]["annotations"] = {"bcd.dev/device-id": "GPU-3"}
    assert _parse_error(doc) == "devices[1].name 'GPU-2': is not the device id 'GPU-3' with '/' as '_'"


# --- the env file ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("line", ["", "A", "=x", "1A=x", "A-B=x", "A B=x", " A=x", "é=x"])
def test_env_lines_refused_naming_the_rule(line: str) -> None:
    with pytest.raises(CdiError) as exc:
        cdi.check_env_line(line)
    assert str(exc.value) == f"env line {line!r}: {ENV_RULE}"


@pytest.mark.parametrize("value", ["\x00", "a\nb", "\x1f", "\r", "\t", "\x7f"])
def test_env_values_with_control_characters_refused(value: str) -> None:
    with pytest.raises(CdiError) as exc:
        cdi.check_env_line(f"K_1={value}")
    assert str(exc.value) == "env line for K_1: the value carries a control character"


@pytest.mark.parametrize("line", ["A=", "A=b=c", "_a9=x y", "K=\x80", "K=é ~!"])
def test_env_lines_kept(line: str) -> None:
    assert cdi.check_env_line(line) == line


def test_env_file_encode_and_parse() -> None:
    assert cdi.encode_env_file(["BCD_ALLOCATION_ID=a", "X=1"]) == b"BCD_ALLOCATION_ID=a\nX=1\n"
    assert cdi.encode_env_file([]) == b""
    assert cdi.parse_env_file(b"") == ()
    assert cdi.parse_env_file(b"X=1\n") == ("X=1",)

    def error(data: bytes, alloc: str | None = None) -> str:
        with pytest.raises(CdiError) as exc:
            cdi.parse_env_file(data, alloc)
        return str(exc.value)

    assert error(b"\xff\n") == "env file is not UTF-8"
    assert error(b"X=1") == "env file must end with a newline"
    assert error(b"X=1\nY\n") == f"env line 'Y': {ENV_RULE}"
    assert error(b"", "a") == "env file: the first line must be BCD_ALLOCATION_ID=a"
    assert error(b"X=1\nBCD_ALLOCATION_ID=a\n", "a") == "env file: the first line must be BCD_ALLOCATION_ID=a"
    assert error(b"BCD_ALLOCATION_ID=b\n", "a") == "env file: the first line must be BCD_ALLOCATION_ID=a"
    assert cdi.parse_env_file(b"BCD_ALLOCATION_ID=a\n", "a") == ("BCD_ALLOCATION_ID=a",)


# --- building a hold ---------------------------------------------------------------------------------


def test_versions_and_names() -> None:
    assert cdi.later_version("0.6.0", "v0.6.0") == "0.6.0"  # equal: the first
    assert cdi.later_version("v0.6.0", "0.6.0") == "v0.6.0"
    assert cdi.device_name("GPU-1/s2/x") == "GPU-1_s2_x"
    assert cdi.qualified_name("GPU-1_s2") == "bcd.dev/gpu=GPU-1_s2"


@pytest.mark.parametrize(
    ("doc", "need"),
    [
        ({}, "0.3.0"),
        ({"devices": [{"name": "a"}]}, "0.3.0"),
        ({"annotations": {"a": "b"}}, "0.6.0"),
        ({"devices": [{"name": "a"}, {"name": "b", "annotations": {"a": "b"}}]}, "0.6.0"),
        ({"containerEdits": {"additionalGids": [44]}}, "0.7.0"),
        ({"containerEdits": {"intelRdt": {"closID": "c"}}}, "0.7.0"),
        ({"devices": [{"containerEdits": {"intelRdt": {"closID": "c"}}}]}, "0.7.0"),
        ({"containerEdits": {"netDevices": [{"hostInterfaceName": "e"}]}}, "1.0.0"),
        (
            {"devices": [{"name": "a"}, {"containerEdits": {"netDevices": [{"hostInterfaceName": "e"}]}}]},
            "1.0.0",
        ),
        (
            {"containerEdits": {"intelRdt": {"closID": "c"}, "netDevices": [{"hostInterfaceName": "e"}]}},
            "1.0.0",
        ),
        ({"containerEdits": {"intelRdt": None, "netDevices": [], "additionalGids": []}}, "0.3.0"),
    ],
)
def test_required_version(doc: dict[str, Any], need: str) -> None:
    assert cdi.required_version(doc) == need


def _vendor(common: dict[str, Any], version: str = "0.5.0") -> cdi.VendorSpec:
    return cdi.VendorSpec(version, common, {})


def test_build_takes_the_vendors_common_edits() -> None:
    vendor = _vendor(
        {
            "env": ["B=2", "A=1"],
            "hooks": [],
            "mounts": None,
            "deviceNodes": [{"path": "/dev/nvidiactl"}],
            "additionalGids": [44],
        }
    )
    doc = _hold(env=["A=1"], vendor=vendor, cgroup_parent="bcd-a_1.slice")
    assert doc["containerEdits"] == {
        "env": ["A=1", "B=2"],
        "deviceNodes": [{"path": "/dev/nvidiactl"}],
        "additionalGids": [44],
    }
    assert doc["cdiVersion"] == "0.7.0"  # additionalGids
    assert doc["annotations"] == {
        "bcd.dev/allocation-id": "a_1",
        "bcd.dev/reservation-id": "r-9",
        "bcd.dev/generation": "12",
        "bcd.dev/cgroup-parent": "bcd-a_1.slice",
    }
    assert cdi.naming_errors(doc) == []
    assert _hold(env=[], vendor=_vendor({"env": ["B=2"]}, "1.1.0"))["containerEdits"] == {"env": ["B=2"]}
    assert _hold(env=[], vendor=_vendor({"env": ["B=2"]}, "1.1.0"))["cdiVersion"] == "1.1.0"


def test_a_kubernetes_hold_takes_nothing_from_the_vendor() -> None:
    vendor = _vendor({"env": ["B=2"], "deviceNodes": [{"path": "/dev/nvidiactl"}]}, "0.8.0")
    doc = _hold(kubernetes=True, env=[], vendor=vendor, devices=[cdi.HoldDevice("0", {"mounts": [{"a": 1}]})])
    assert "containerEdits" not in doc
    assert doc["cdiVersion"] == "0.6.0"
    assert doc["annotations"]["bcd.dev/binding"] == "kubernetes"
    assert doc["devices"] == [
        {
            "name": "0",
            "annotations": {"bcd.dev/device-id": "0"},
            "containerEdits": {"env": ["BCD_DEVICE_0=0"]},
        }
    ]


def test_encode_spec_bytes() -> None:
    assert cdi.encode_spec({"a": [1], "b": "x"}) == b'{\n  "a": [\n    1\n  ],\n  "b": "x"\n}\n'


def test_a_device_marker_names_the_device_with_every_other_character_as_underscore() -> None:
    # docs/devices.md "Devices never bare": the key is the CDI device name with every character outside
    # [A-Za-z0-9_] as `_` (upper and lower case letters, digits and `_` kept), the value the device id.
    gpu = "GPU-5f1c2a90-0000-4000-8000-000000000001"
    assert cdi.device_marker_env(gpu) == f"BCD_DEVICE_GPU_5f1c2a90_0000_4000_8000_000000000001={gpu}"
    mig = "MIG-GPU-aB9/1.0:z_Y"
    assert cdi.device_marker_env(mig) == f"BCD_DEVICE_MIG_GPU_aB9_1_0_z_Y={mig}"


def test_a_cdi_version_is_ascii_digits_at_most_9_each() -> None:
    """Red team round 8, in process (`version_key` is cached, so mutmut makes no mutant of it; this pins
    the rule): `\\d` took any script's digits, which int() parses, and any count of them."""
    assert cdi.version_key("v999999999.0.1") == (999999999, 0, 1)
    for bad in (
        "\u0663.0.0",
        "0.\u0661.0",
        "0.0.\u00b2",
        "1234567890.0.0",
        "0.1234567890.0",
        "0.0.1234567890",
    ):
        cdi.version_key.cache_clear()
        with pytest.raises(CdiError) as exc:
            cdi.version_key(bad)
        assert str(exc.value) == f"cdiVersion {bad!r} is not a version (MAJOR.MINOR.PATCH)"
