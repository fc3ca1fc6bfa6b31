"""A real identity-rebind bundle for the tests: an ed25519 host key and its host certificate made by
ssh-keygen (a CA of the test's own), so the bundle's PEM and certificate line are what OpenSSH writes."""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path


def host_identity() -> tuple[str, str]:
    """(PEM private host key, its OpenSSH host certificate line)."""
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        for name in ("ca", "host"):
            subprocess.run(
                ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", name, "-f", str(d / name)], check=True
            )
        subprocess.run(
            ["ssh-keygen", "-q", "-s", str(d / "ca"), "-h", "-I", "restore-1", "-n", "restore-1.example",
             str(d / "host.pub")],
            check=True, capture_output=True,
        )  # fmt: skip
        return (d / "host").read_text(), (d / "host-cert.pub").read_text()


def bundle(with_key: bool = True, **override: object) -> bytes:
    doc: dict[str, object] = {"v": 1, "account": "tenant", "principals": ["alloc-7", "sandbox-7"]}
    if with_key:
        key, cert = host_identity()
        doc["hostKey"], doc["hostCertificate"] = key, cert
    doc.update(override)
    return json.dumps(doc).encode()
