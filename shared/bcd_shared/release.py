"""Self-update releases: the signed release manifest and its verification (pki purpose `daemon-release`).

A release is one artifact (the file that is installed and run) described by a manifest:

    manifest bytes = canonical JSON {"sha256": <64 lowercase hex>, "url": <https URL>, "version": <version>}
                     (keys sorted, no whitespace, ASCII only, nothing else); a rollback manifest, the
                     signed intent that lets a release move backwards to the version it names, has
                     `"rollback": true` too (the key is absent otherwise, so forward manifests keep
                     the bytes they always had)

The control plane's worker key signs those exact bytes under purpose `daemon-release`
(`Ed25519(b"bcd-sig-v1/daemon-release\\x00" || manifest)`), and the worker's certificate chains to the
command-signing roots, exactly as for commands and desired state. `DaemonSection.signature` and
`DaemonUpgradeRequest.signature` carry that signature; the chain is the signer chain of the DesiredState
or Command that carried the section or command (the same worker signs both). Because every field of the
manifest is in the section or command, the verifier rebuilds the manifest bytes from them (the encoding
is canonical, so there is exactly one byte string per manifest) and checks the artifact's SHA-256 against
the signed one.

Versions are ordered (`compare_versions`) so that releases only move forward (issue 9 item 4, TUF's
rollback attack): a release version is `N(.N)*` with an optional PEP 440 suffix `aN`, `bN`, `rcN`
(pre-releases, before their release), `.postN` (after it) and `.devN` (before everything else of that
release); trailing `.0`s do not count (1.2 == 1.2.0). A version outside that grammar has no order:
it is a valid manifest field, but a swap refuses it (`unordered-version`), since nothing could prove it
moves forward.

Pure: no clock, no I/O. docs/pki.md "Daemon releases" has the rules.
"""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Sequence
from typing import Final

from attrs import frozen

from bcd_shared.pki.chain import ChainCache, Roots, VerifiedSigner, verify_signed
from bcd_shared.pki.errors import PkiError
from bcd_shared.pki.signing import KeyPair, Purpose

VERSION_RE: Final = re.compile(r"^[0-9A-Za-z][0-9A-Za-z.+_~-]{0,63}$")
SHA256_RE: Final = re.compile(r"^[0-9a-f]{64}$")
URL_RE: Final = re.compile(r"^https://[A-Za-z0-9.\-\[\]:]{1,261}(/[\x21-\x7e]*)?$")
MAX_URL: Final = 2048
# The chain of a release signer is checked for the worker role: the role that signs commands and
# desired state (pki's ROLE_FOR_PURPOSE has no row for daemon-release, so the chain is verified for
# desired-state's role and the signature itself under daemon-release).
_WORKER_CHAIN_PURPOSE: Final = Purpose.DESIRED_STATE


class BadManifest(PkiError):
    """A manifest field breaks its rule."""

    rule = "bad-release-manifest"


class UnorderedVersion(PkiError):
    """A version outside the ordered grammar: no forward-only decision can be made for it."""

    rule = "unordered-version"


class ArtifactMismatch(PkiError):
    """The artifact's SHA-256 is not the signed one."""

    rule = "artifact-mismatch"


@frozen
class ReleaseManifest:
    version: str
    url: str
    sha256: str
    rollback: bool = False  # a signed rollback intent: the release may be older than the installed one

    def __attrs_post_init__(self) -> None:
        if not VERSION_RE.fullmatch(self.version):
            raise BadManifest(
                f"version: {self.version[:80]!r} is not a release version ([0-9A-Za-z.+_~-], 1-64)"
            )
        if len(self.url) > MAX_URL or not URL_RE.fullmatch(self.url):
            raise BadManifest(f"url: {self.url[:80]!r} is not an https URL without credentials")
        if not SHA256_RE.fullmatch(self.sha256):
            raise BadManifest(f"sha256: {self.sha256[:80]!r} is not 64 lowercase hex digits")

    def encode(self) -> bytes:
        """The exact bytes signed: canonical JSON, sorted keys, no whitespace, ASCII."""
        doc: dict[str, object] = {"sha256": self.sha256, "url": self.url, "version": self.version}
        if self.rollback:
            doc["rollback"] = True
        return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def sign_release(worker_key: KeyPair, manifest: ReleaseManifest) -> bytes:
    """The issuer's side (the control plane's worker, and tests): the signature of the manifest."""
    return worker_key.sign(Purpose.DAEMON_RELEASE, manifest.encode())


def verify_release(
    manifest: ReleaseManifest,
    signature: bytes,
    signer_chain: Sequence[bytes],
    roots: Roots,
    now: datetime.datetime,
    cache: ChainCache | None = None,
) -> VerifiedSigner:
    """Raise a PkiError unless `signature` is a worker's, chained to `roots`, over the manifest's bytes."""
    return verify_signed(
        Purpose.DAEMON_RELEASE,
        manifest.encode(),
        signature,
        signer_chain,
        roots,
        now,
        cache,
        chain_purpose=_WORKER_CHAIN_PURPOSE,
    )


def check_artifact(manifest: ReleaseManifest, artifact_sha256: str) -> None:
    """Raise ArtifactMismatch unless the artifact's digest is the manifest's."""
    if artifact_sha256 != manifest.sha256:
        raise ArtifactMismatch(
            f"artifact sha256 {artifact_sha256} is not the release's signed sha256 {manifest.sha256}"
        )


_ORDERED_RE: Final = re.compile(
    r"^(?P<release>[0-9]{1,9}(?:\.[0-9]{1,9}){0,7})"
    r"(?:(?P<pre>a|b|rc)(?P<pre_n>[0-9]{1,9}))?"
    r"(?:\.post(?P<post>[0-9]{1,9}))?"
    r"(?:\.dev(?P<dev>[0-9]{1,9}))?$"
)
_PRE_RANK: Final = {"a": 0, "b": 1, "rc": 2}


def version_key(version: str) -> tuple[tuple[int, ...], tuple[int, int], int, int]:
    """The sort key of an ordered release version; raises UnorderedVersion outside the grammar."""
    m = _ORDERED_RE.fullmatch(version)
    if m is None:
        raise UnorderedVersion(
            f"version {version[:80]!r} has no release order (N(.N)* with an optional aN, bN, rcN, "
            ".postN or .devN suffix)"
        )
    release = [int(x) for x in m["release"].split(".")]
    while len(release) > 1 and release[-1] == 0:
        release.pop()
    # A .devN with no pre-release sorts before every pre-release of its release; a final release
    # sorts after all of them.
    if m["pre"] is not None:
        pre = (_PRE_RANK[m["pre"]], int(m["pre_n"]))
    elif m["dev"] is not None and m["post"] is None:
        pre = (-1, 0)
    else:
        pre = (3, 0)
    post = int(m["post"]) if m["post"] is not None else -1
    dev = int(m["dev"]) if m["dev"] is not None else 1 << 62  # no .dev: after every .devN
    return tuple(release), pre, post, dev


def compare_versions(a: str, b: str) -> int:
    """-1, 0 or 1 as release `a` is older than, the same as, or newer than `b` (UnorderedVersion)."""
    ka, kb = version_key(a), version_key(b)
    return (ka > kb) - (ka < kb)
