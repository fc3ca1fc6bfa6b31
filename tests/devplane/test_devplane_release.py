"""`bcd devplane release`: the daemon section for a release artifact, its manifest signed with the
devplane's worker key as the control plane signs it (docs/devplane.md, docs/daemon.md). The whole flow
on a packaged host under a real systemd, with this command, is tests/deploy/test_units_booted.py."""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import json
import zipfile
from pathlib import Path

import pytest
from bcd_agent import cli
from bcd_agent.devplane.keys import load_or_create
from bcd_agent.sections.daemon.release import build_release
from bcd_shared.pki.chain import Roots
from bcd_shared.pki.errors import PkiError
from bcd_shared.release import ReleaseManifest, verify_release
from bcd_shared.subcommands import EX_DATAERR, EX_NOINPUT

URL = "https://releases.example/bcd/1.2.3/bcd"


def _artifact(tmp: Path, version: str = "1.2.3") -> Path:
    wheel = tmp / f"bcd_agent-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("bcd_agent/__init__.py", "")
        zf.writestr(f"bcd_agent-{version}.dist-info/METADATA", f"Name: bcd-agent\nVersion: {version}\n")
    out = tmp / "bcd.pyz"
    build_release([wheel], out)
    return out


def _main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        rc = cli.main(argv)
    except SystemExit as exc:
        rc = int(exc.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def plane(tmp_path: Path) -> Path:
    d = tmp_path / "plane"
    d.mkdir()
    load_or_create(d, dt.datetime.now(dt.UTC))  # as `bcd devplane serve` does at its first start
    return d


def test_the_section_is_signed_by_the_worker_over_the_artifacts_digest_and_version(
    tmp_path: Path, plane: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    artifact = _artifact(tmp_path)
    rc, out, err = _main(["devplane", "release", str(artifact), "--url", URL, "--dir", str(plane)], capsys)
    assert rc == 0, err
    section = json.loads(out)["daemon"]
    digest = hashlib.sha256(artifact.read_bytes()).hexdigest()
    assert {k: section[k] for k in ("version", "url", "sha256")} == {
        "version": "1.2.3",
        "url": URL,
        "sha256": digest,
    }
    assert "rollback" not in section
    keys = load_or_create(plane, dt.datetime.now(dt.UTC))
    roots = Roots.from_ders([keys.command_root_der])
    now = dt.datetime.now(dt.UTC)
    signature = base64.b64decode(section["signature"])
    verify_release(ReleaseManifest("1.2.3", URL, digest), signature, [keys.worker_der], roots, now)
    # The signature is over the manifest as given: another digest, or a rollback intent, does not verify.
    for other in (
        ReleaseManifest("1.2.3", URL, "0" * 64),
        ReleaseManifest("1.2.3", URL, digest, rollback=True),
    ):
        with pytest.raises(PkiError):
            verify_release(other, signature, [keys.worker_der], roots, now)


def test_a_rollback_intent_is_signed_and_shown_and_a_spec_keeps_its_sections(
    tmp_path: Path, plane: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    artifact = _artifact(tmp_path)
    spec = tmp_path / "spec.json"
    host = {"units": [{"name": "sysctl", "settings": '{"net.ipv4.ip_forward":1}'}]}
    spec.write_text(json.dumps({"host": host}))
    argv = [
        "devplane",
        "release",
        str(artifact),
        "--url",
        URL,
        "--dir",
        str(plane),
        "--rollback",
        "--spec",
        str(spec),
    ]
    rc, out, err = _main(argv, capsys)
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["host"] == host and doc["daemon"]["rollback"] is True
    keys = load_or_create(plane, dt.datetime.now(dt.UTC))
    digest = hashlib.sha256(artifact.read_bytes()).hexdigest()
    verify_release(
        ReleaseManifest("1.2.3", URL, digest, rollback=True),
        base64.b64decode(doc["daemon"]["signature"]),
        [keys.worker_der],
        Roots.from_ders([keys.command_root_der]),
        dt.datetime.now(dt.UTC),
    )


@pytest.mark.parametrize(
    ("extra", "rc", "message"),
    [
        (
            ["--url", "http://releases.example/bcd"],
            EX_DATAERR,
            "url: 'http://releases.example/bcd' is not an https URL",
        ),
        (
            ["--url", URL, "--version", "1.2.4"],
            EX_DATAERR,
            "--version 1.2.4: the artifact carries version 1.2.3",
        ),
    ],
)
def test_a_bad_manifest_is_refused_naming_the_field(
    tmp_path: Path, plane: Path, capsys: pytest.CaptureFixture[str], extra: list[str], rc: int, message: str
) -> None:
    got, out, err = _main(
        ["devplane", "release", str(_artifact(tmp_path)), "--dir", str(plane), *extra], capsys
    )
    assert (got, out) == (rc, "") and message in err


def test_not_a_release_and_no_keys_are_refused(
    tmp_path: Path, plane: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    notzip = tmp_path / "bcd"
    notzip.write_bytes(b"#!/bin/sh\n")
    rc, out, err = _main(["devplane", "release", str(notzip), "--url", URL, "--dir", str(plane)], capsys)
    assert (rc, out) == (EX_DATAERR, "") and "not a release artifact (not a zip archive)" in err
    wheel = tmp_path / "other.zip"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("__main__.py", "")
    rc, out, err = _main(["devplane", "release", str(wheel), "--url", URL, "--dir", str(plane)], capsys)
    assert (rc, out) == (EX_DATAERR, "") and "no __main__.py and bcd_agent's metadata" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, out, err = _main(
        ["devplane", "release", str(_artifact(tmp_path)), "--url", URL, "--dir", str(empty)], capsys
    )
    # Never made here: keys made now would not be the ones the nodes trust.
    assert (rc, out) == (EX_NOINPUT, "") and "no devplane keys" in err and not (empty / "keys.json").exists()
    rc, out, err = _main(
        ["devplane", "release", str(tmp_path / "nope"), "--url", URL, "--dir", str(plane)], capsys
    )
    assert (rc, out) == (EX_NOINPUT, "") and "nope: No such file or directory" in err
