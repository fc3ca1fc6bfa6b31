"""Property tests of the helper's refusals against a real helper process on a real socket.

For generated requests outside the rules: refused, audited (one refused line for that op), and the
file tree under the simulated root byte-for-byte unchanged. Inside the rules: accepted. Example
counts come from the hypothesis profile (conftest: helper-ci runs 1000 per property).
Covers DLV-PRIV-02, DLV-PRIV-04, DEV-BIND-06, DEV-SLICE-17/18/24, HST-HLP-04, HST-HLP-05, HST-ROOT-08.
"""

from __future__ import annotations

import re
from typing import Any

from bcd_shared import cdi
from bcd_shared.units import REGISTRY
from helperproc import HELPER_SETTINGS, HelperProcess, assert_refused, tree
from hypothesis import given
from hypothesis import strategies as st

ALLOC_RE = re.compile(r"^[A-Za-z0-9_]{1,80}$")
SLICE_RE = re.compile(r"^bcd-alloc-[A-Za-z0-9_]{1,80}\.slice$")
UNIT_RE = re.compile(r"^[a-z0-9-]{1,64}$")
CPULIST_RE = re.compile(r"^[0-9]{1,5}(-[0-9]{1,5})?(,[0-9]{1,5}(-[0-9]{1,5})?)*$")

good_ids = st.from_regex(ALLOC_RE, fullmatch=True)
any_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=100)
path_like = st.sampled_from(
    ["../../etc/passwd", "a/b", "/etc/shadow", ".", "..", "", "x" * 81, "a b", "a\x00b", "é"]
)
ids = st.one_of(good_ids, any_text, path_like)


def _hold(alloc: str, other: str | None = None) -> str:
    doc = cdi.build_hold_spec(
        allocation_id=other or alloc,
        reservation_id="rsv_1",
        generation=7,
        kubernetes=False,
        cgroup_parent=None,
        devices=[cdi.HoldDevice("GPU-5f1c2a90-0000-4000-8000-000000000001")],
        env=[f"BCD_ALLOCATION_ID={other or alloc}"],
        vendor=None,
    )
    return cdi.encode_spec(doc).decode()


@HELPER_SETTINGS
@given(ident=ids, kind=st.sampled_from(["cdi", "allocation-env"]), mutate=st.integers(0, 5), junk=any_text)
def test_file_write_outside_the_rules_is_refused_and_writes_nothing(
    helper: HelperProcess, ident: str, kind: str, mutate: int, junk: str
) -> None:
    valid_id = bool(ALLOC_RE.fullmatch(ident))
    if kind == "cdi":
        content = [
            _hold(ident if valid_id else "a1", other="someone_else"),  # another allocation's hold
            junk,
            _hold(ident if valid_id else "a1").replace("bcd.dev/gpu", "evil.dev/gpu"),
            _hold(ident if valid_id else "a1") + junk + "x",  # trailing data
            '{"cdiVersion": "0.6.0"}',
            _hold(ident) if valid_id else junk,
        ][mutate]
    else:
        content = [
            "BCD_ALLOCATION_ID=other\n",
            junk + "=x\n" if not junk.isidentifier() else "1" + junk + "=x\n",
            f"BCD_ALLOCATION_ID={ident}\nX=\x07\n",
            f"BCD_ALLOCATION_ID={ident}",  # no final newline
            "# comment\n",
            f"BCD_ALLOCATION_ID={ident}\n" if valid_id else junk,
        ][mutate]
    inside = valid_id and mutate == 5
    doc = {"op": "file.write", "args": {"kind": kind, "id": ident, "content": content}}
    if inside:
        answer = helper.raw(doc)
        assert answer["ok"] is True, answer
        assert helper.last_audit()["decision"] == "accepted"
        helper.raw({"op": "file.remove", "args": {"kind": kind, "id": ident}})
    else:
        assert_refused(helper, doc)


@HELPER_SETTINGS
@given(kind=st.text(max_size=30), ident=ids)
def test_unknown_kinds_and_bad_ids_are_refused(helper: HelperProcess, kind: str, ident: str) -> None:
    known = {"cdi", "allocation-env", "k8s-token"}
    if kind in known:
        kind = kind + "x"
    assert_refused(helper, {"op": "file.remove", "args": {"kind": kind, "id": ident}})
    if not ALLOC_RE.fullmatch(ident):
        assert_refused(helper, {"op": "file.remove", "args": {"kind": "cdi", "id": ident}})


cpulists = st.one_of(
    st.from_regex(CPULIST_RE, fullmatch=True),
    st.text(alphabet="0123456789,-x ", max_size=40),
    st.just("0-" + "1" * 1030),
    st.lists(st.integers(0, 99999), min_size=1, max_size=300).map(lambda xs: ",".join(map(str, xs))),
)


def _cpulist_ok(value: str) -> bool:
    if len(value) > 1024 or not CPULIST_RE.fullmatch(value):
        return False
    for part in value.split(","):
        lo, _, hi = part.partition("-")
        if int(lo) > int(hi or lo) or int(hi or lo) >= 65536:
            return False
    return True


@HELPER_SETTINGS
@given(
    name=st.one_of(
        st.from_regex(SLICE_RE, fullmatch=True), any_text, st.sampled_from(["ssh.service", "-.slice"])
    ),
    cpus=st.none() | cpulists,
    mems=st.none() | cpulists,
)
def test_slice_apply_outside_the_rules_is_refused(
    helper: HelperProcess, name: str, cpus: str | None, mems: str | None
) -> None:
    args: dict[str, Any] = {"name": name}
    if cpus is not None:
        args["cpus"] = cpus
    if mems is not None:
        args["mems"] = mems
    inside = bool(SLICE_RE.fullmatch(name)) and all(v is None or _cpulist_ok(v) for v in (cpus, mems))
    doc = {"op": "slice.apply", "args": args}
    if inside:
        answer = helper.raw(doc)
        assert answer["ok"] is True, answer
        assert helper.raw({"op": "slice.remove", "args": {"name": name}})["ok"] is True
    else:
        assert_refused(helper, doc)


@HELPER_SETTINGS
@given(
    unit=st.one_of(
        st.from_regex(UNIT_RE, fullmatch=True), any_text, st.sampled_from(["../etc", "Sysctl", "", "a" * 65])
    ).filter(lambda u: u not in REGISTRY),
    busy=st.integers(0, 1100),
    settings=st.none() | any_text,
)
def test_HST_HLP_04_05_host_unit_names_and_busy_limits(
    helper: HelperProcess, unit: str, busy: int, settings: str | None
) -> None:
    """Covers HST-HLP-04, HST-HLP-05, HST-HLP-10: names outside the pattern, more than 1024 busy GPUs
    and units this bcd does not know are refused, for that reason, and nothing is written."""
    doc = {
        "op": "host.unit",
        "args": {"unit": unit, "settings": settings, "busy_gpus": [f"GPU-{i}" for i in range(busy)]},
    }
    answer = assert_refused(helper, doc)
    if not UNIT_RE.fullmatch(unit):
        assert answer["reason"] == "bad-unit-name" and "not a config unit name" in answer["message"]
    elif busy > 1024:
        assert answer["reason"] == "too-many-busy-gpus"
    else:
        assert answer["reason"] == "not-supported"


@HELPER_SETTINGS
@given(
    doc=st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=10),
        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
        max_leaves=10,
    )
)
def test_arbitrary_documents_are_refused_or_answered_never_crash(helper: HelperProcess, doc: Any) -> None:
    before = tree(helper.root)
    answer = helper.raw(doc)
    assert answer["ok"] in (True, False)
    if isinstance(doc, dict) and doc.get("op") == "helper.ping" and doc.get("args") == {}:
        assert answer["ok"] is True
    assert tree(helper.root) == before
