"""Identity rebind (seeds/delivery.md "Identity rebind", DLV-REB): a memory restore's own SSH identity.

Pure parts:
- `parse_rebind(data)`: the sealed bundle `{"v":1,"account","principals","hostKey"?,"hostCertificate"?}`,
  strict (DLV-REB-03): JSON of at most 64 KiB, no duplicate or unknown key, `v` the integer 1, `account`
  a POSIX account name, `principals` a non-empty list of principals (or one string of lines; each 1 to
  256 printable ASCII characters, no space or comma), and either both a PEM OpenSSH host key and one
  OpenSSH certificate line, or neither. Anything else raises `BundleRefused` (not retried).
- `rebind_image(bundle, nonce)`: exactly 1 MiB: a ustar tar at offset 0 of `nonce`, `account`,
  `principals` and, with a host key, `host_key` (0600) and `host_key-cert.pub`; the last 4 KiB zero,
  for the guest's answer (DLV-REB-05/06). `answered(tail, nonce)`: the answer line is there.
- `plan_rebinds(spec, domains, state, now_ms, rebinders)`: which running instances to rebind now and the
  state pruned of instances no spec names (DLV-REB-15); a reference already rebound is never done again,
  a guest that did not answer is tried at most 3 times per reference, 5 minutes apart (DLV-REB-16), a
  refused or malformed bundle never again (DLV-REB-17).

The shell (`Rebinder.tick`, run by the node off the converge pass in a worker thread, DLV-REB-04):
fetch the bundle with a SecretRequest bound to the allocation (DLV-REB-02), check it, write and
hot-add the disk (the runtime's `rebind_attach`), wait up to 2 minutes for the answer, then remove the
disk and zero and delete its file whatever happened (`rebind_detach`, DLV-REB-10..12). On success the
reference is recorded durably in `data_dir/instances-rebound.json` (DLV-REB-13) before it is reported as
`InstanceStatus.identity_rebound_ref` (DLV-REB-14); otherwise nothing is reported (fail closed,
DLV-REB-18). Only runtimes with `rebind_attach` rebind (libvirt-kvm, cloud-hypervisor).
"""

from __future__ import annotations

import io
import json
import logging
import re
import secrets
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs
from attrs import frozen
from bcd_shared.errors import StepError
from bcd_shared.rebinddisk import ANSWER_SIZE, REBIND_SIZE
from bcd_shared.strictjson import unique_keys

from bcd_agent.sections.instances.model import Desired, InstancesSpec
from bcd_agent.sections.instances.runtimes.base import RUNNING, Domain

log = logging.getLogger("bcd.instances.rebind")

STATE_FILE = "instances-rebound.json"
MAX_BUNDLE = 64 * 1024
MAX_TRIES = 3
RETRY_MS = 5 * 60 * 1000
UNAVAILABLE_RETRY_MS = 30 * 1000  # the broker did not answer: not a try, asked again soon
WAIT_S = 120.0
_ACCOUNT = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
_PRINCIPAL = re.compile(r"^[\x21-\x2b\x2d-\x7e]{1,256}$")  # printable, no space, no comma
_PEM = re.compile(
    r"^-----BEGIN OPENSSH PRIVATE KEY-----\n(?:[A-Za-z0-9+/=]{1,80}\n){1,200}"
    r"-----END OPENSSH PRIVATE KEY-----\n?$"
)
_CERT = re.compile(
    r"^[a-z0-9@.-]{1,60}-cert-v01@openssh\.com [A-Za-z0-9+/]{1,16384}={0,2}(?: [\x20-\x7e]{0,200})?\n?$"
)
_NONCE = re.compile(r"^[0-9a-f]{32}$")


class BundleRefused(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@frozen
class RebindBundle:
    account: str
    principals: tuple[str, ...]
    host_key: str | None = None
    host_certificate: str | None = None


_pairs = unique_keys(lambda k: BundleRefused(f"bundle: key {k[:40]!r} appears twice"))


def parse_rebind(data: bytes) -> RebindBundle:
    """The checked bundle (DLV-REB-03; rules in the module docstring), or BundleRefused naming the field."""
    if len(data) > MAX_BUNDLE:
        raise BundleRefused(f"bundle: {len(data)} bytes, at most {MAX_BUNDLE}")
    try:
        doc = json.loads(data.decode("utf-8"), object_pairs_hook=_pairs)
    except (UnicodeDecodeError, ValueError) as exc:
        raise BundleRefused(f"bundle: not JSON: {str(exc)[:100]}") from None
    if not isinstance(doc, dict):
        raise BundleRefused("bundle: not a JSON object")
    unknown = sorted(set(doc) - {"v", "account", "principals", "hostKey", "hostCertificate"})
    if unknown:
        raise BundleRefused(f"bundle: unknown field {unknown[0][:40]!r}")
    v = doc.get("v")
    if type(v) is not int or v != 1:
        raise BundleRefused(f"bundle: v must be 1, not {str(v)[:20]}")
    account = doc.get("account")
    if not isinstance(account, str) or not _ACCOUNT.fullmatch(account):
        raise BundleRefused("bundle: account must be an account name ([a-z_][a-z0-9_-]{0,31})")
    raw = doc.get("principals")
    lines = raw.splitlines() if isinstance(raw, str) else raw
    if not isinstance(lines, list) or not lines or len(lines) > 256:
        raise BundleRefused("bundle: principals must be 1 to 256 principal lines")
    for p in lines:
        if not isinstance(p, str) or not _PRINCIPAL.fullmatch(p):
            raise BundleRefused(f"bundle: principal {str(p)[:40]!r} is not 1 to 256 printable characters")
    key, cert = doc.get("hostKey"), doc.get("hostCertificate")
    if (key is None) != (cert is None):
        raise BundleRefused("bundle: hostKey and hostCertificate come together or not at all")
    if key is not None:
        if not isinstance(key, str) or not _PEM.fullmatch(key):
            raise BundleRefused("bundle: hostKey is not a PEM OpenSSH private key")
        if not isinstance(cert, str) or not _CERT.fullmatch(cert):
            raise BundleRefused("bundle: hostCertificate is not one OpenSSH certificate line")
    return RebindBundle(account, tuple(lines), key, cert)


def rebind_image(bundle: RebindBundle, nonce: str) -> bytes:
    """The 1 MiB disk: the tar at offset 0, the last 4 KiB zero for the answer (DLV-REB-05/06)."""
    if not _NONCE.fullmatch(nonce):
        raise ValueError("nonce: 32 lowercase hex digits")
    files: list[tuple[str, bytes, int]] = [
        ("nonce", nonce.encode() + b"\n", 0o600),
        ("account", bundle.account.encode() + b"\n", 0o600),
        ("principals", "".join(p + "\n" for p in bundle.principals).encode(), 0o600),
    ]
    if bundle.host_key is not None and bundle.host_certificate is not None:
        files.append(("host_key", bundle.host_key.rstrip("\n").encode() + b"\n", 0o600))
        files.append(("host_key-cert.pub", bundle.host_certificate.rstrip("\n").encode() + b"\n", 0o644))
    import tarfile  # here, not at start: only a rebind writes a tar (the idle node's memory)

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data, mode in files:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), mode, 0
            tar.addfile(info, io.BytesIO(data))
    body = buf.getvalue()
    if len(body) > REBIND_SIZE - ANSWER_SIZE:
        raise BundleRefused(f"bundle: its tar of {len(body)} bytes does not fit the rebind disk")
    return body + b"\0" * (REBIND_SIZE - len(body))


def answered(tail: bytes, nonce: str) -> bool:
    """The guest's answer: `BCREBOUND <nonce>` at the start of the last 4 KiB, ended by a newline or NUL."""
    want = f"BCREBOUND {nonce}".encode()
    return tail.startswith(want) and tail[len(want) : len(want) + 1] in (b"\n", b"\0")


# --- the planner (pure) ---------------------------------------------------------------------------


@frozen
class Attempt:
    ref: str
    tries: int = 0
    retry_at_ms: int = 0
    final: bool = False  # refused or malformed, or MAX_TRIES reached: never again for this reference


@frozen
class RebindState:
    rebound: Mapping[str, str] = attrs.field(factory=dict)  # instance id -> reference installed
    attempts: Mapping[str, Attempt] = attrs.field(factory=dict)


@frozen
class RebindJob:
    instance_id: str
    runtime: str
    allocation_id: str
    ref: str


def plan_rebinds(
    spec: InstancesSpec,
    domains: Iterable[Domain],
    state: RebindState,
    now_ms: int,
    rebinders: frozenset[str],
) -> tuple[tuple[RebindJob, ...], RebindState]:
    named = {i.id for i in spec.instances if i.desired is not Desired.DELETED}
    pruned = RebindState(
        {k: v for k, v in state.rebound.items() if k in named},
        {k: v for k, v in state.attempts.items() if k in named},
    )
    running = {d.name: d for d in domains if d.managed and d.state == RUNNING}
    jobs = []
    for inst in spec.instances:
        ref = inst.identity_rebind_ref
        d = running.get(inst.id)
        if not ref or inst.desired is not Desired.RUNNING or d is None or d.runtime != inst.runtime:
            continue
        if d.runtime not in rebinders or pruned.rebound.get(inst.id) == ref:
            continue
        tried = pruned.attempts.get(inst.id)
        if (
            tried is not None
            and tried.ref == ref
            and (tried.final or tried.tries >= MAX_TRIES or now_ms < tried.retry_at_ms)
        ):
            continue
        jobs.append(RebindJob(inst.id, inst.runtime, inst.allocation_id, ref))
    return tuple(jobs), pruned


# --- the state file -------------------------------------------------------------------------------


def state_to_json(state: RebindState) -> bytes:
    doc = {
        "v": 1,
        "rebound": dict(sorted(state.rebound.items())),
        "attempts": {
            k: {"ref": a.ref, "tries": a.tries, "retry_at_ms": a.retry_at_ms, "final": a.final}
            for k, a in sorted(state.attempts.items())
        },
    }
    return json.dumps(doc, indent=1).encode() + b"\n"


def state_from_json(data: bytes) -> RebindState:
    """Strict: anything but the shape `state_to_json` writes raises ValueError."""
    doc = json.loads(data)
    if not isinstance(doc, dict) or set(doc) != {"v", "rebound", "attempts"} or doc["v"] != 1:
        raise ValueError("not an instances-rebound.json of version 1")
    rebound, attempts = doc["rebound"], doc["attempts"]
    if not isinstance(rebound, dict) or not all(isinstance(v, str) for v in rebound.values()):
        raise ValueError("rebound: instance id -> reference")
    if not isinstance(attempts, dict):
        raise ValueError("attempts: instance id -> attempt")
    out = {}
    for k, a in attempts.items():
        if not isinstance(a, dict) or set(a) != {"ref", "tries", "retry_at_ms", "final"}:
            raise ValueError(f"attempts[{k[:40]!r}]: ref, tries, retry_at_ms, final")
        if not isinstance(a["ref"], str) or type(a["tries"]) is not int or type(a["retry_at_ms"]) is not int:
            raise ValueError(f"attempts[{k[:40]!r}]: bad types")
        out[k] = Attempt(a["ref"], a["tries"], a["retry_at_ms"], bool(a["final"]))
    return RebindState(dict(rebound), out)


# --- the shell ------------------------------------------------------------------------------------


class Rebinder:
    """Runs the jobs `plan_rebinds` gives, one at a time. `secrets` is the user-data source (a
    SecretRequest bound to the allocation); `system` reads and writes `data_dir/instances-rebound.json`."""

    def __init__(
        self,
        system: Any,
        data_dir: str,
        runtimes: Mapping[str, Any],
        secrets_source: Any,
        *,
        wait_s: float = WAIT_S,
        poll_s: float = 1.0,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.system = system
        self.path = f"{data_dir.rstrip('/')}/{STATE_FILE}"
        self.runtimes = runtimes
        self.secrets = secrets_source
        self.wait_s = wait_s
        self.poll_s = poll_s
        self.clock = clock
        self.sleep = sleep
        self.state = self.load()
        self.on_rebound: Callable[[], None] | None = None  # the section refreshes its report

    @property
    def rebinders(self) -> frozenset[str]:
        return frozenset(n for n, rt in self.runtimes.items() if hasattr(rt, "rebind_attach"))

    def load(self) -> RebindState:
        data = self.system.read_bytes(self.path)
        if data is None:
            return RebindState()
        try:
            return state_from_json(data)
        except (ValueError, KeyError, TypeError) as exc:
            # Fail closed: nothing is reported rebound; the instances are rebound again.
            log.warning("rebind: %s is unreadable (%s): starting from nothing", self.path, exc)
            return RebindState()

    def save(self, state: RebindState) -> None:
        if state != self.state:
            self.system.write_atomic(self.path, state_to_json(state), 0o600)
            self.state = state

    def rebound(self) -> dict[str, str]:
        return dict(self.state.rebound)

    def tick(self, spec: InstancesSpec, domains: Iterable[Domain]) -> list[tuple[str, str]]:
        """Plan, then run each job: (instance, outcome) pairs, outcome `rebound` or why not."""
        now_ms = int(self.clock() * 1000)
        jobs, pruned = plan_rebinds(spec, domains, self.state, now_ms, self.rebinders)
        self.save(pruned)
        out = []
        for job in jobs:
            outcome = self.run_one(job)
            out.append((job.instance_id, outcome))
        return out

    def _attempt(
        self, job: RebindJob, *, final: bool = False, counted: bool = True, wait_ms: int = RETRY_MS
    ) -> None:
        prev = self.state.attempts.get(job.instance_id)
        tries = prev.tries if prev is not None and prev.ref == job.ref else 0
        tries += 1 if counted else 0
        attempt = Attempt(job.ref, tries, int(self.clock() * 1000) + wait_ms, final or tries >= MAX_TRIES)
        self.save(RebindState(self.state.rebound, {**self.state.attempts, job.instance_id: attempt}))

    def run_one(self, job: RebindJob) -> str:
        got = self.secrets.fetch(job.instance_id, job.allocation_id, job.ref)
        if got.refused is not None:
            self._attempt(job, final=True)
            log.warning("rebind: %s: the bundle was refused: %s (not retried)", job.instance_id, got.refused)
            return f"refused: {got.refused}"
        if got.data is None:
            self._attempt(job, counted=False, wait_ms=UNAVAILABLE_RETRY_MS)
            return f"unavailable: {got.unavailable}"
        try:
            image = rebind_image(parse_rebind(got.data), nonce := secrets.token_hex(16))
        except BundleRefused as exc:
            self._attempt(job, final=True)
            log.warning("rebind: %s: %s (not retried)", job.instance_id, exc.message)
            return f"malformed: {exc.message}"
        rt = self.runtimes[job.runtime]
        ok = False
        try:
            rt.rebind_attach(job.instance_id, image)
        except (StepError, OSError) as exc:  # counted as a try: a broken attach is not retried forever
            self._attempt(job)
            why = exc.message if isinstance(exc, StepError) else str(exc)
            log.warning("rebind: %s: attach failed: %s", job.instance_id, why)
            return f"attach failed: {why}"
        try:
            deadline = time.monotonic() + self.wait_s
            while True:
                if answered(rt.rebind_answer(job.instance_id, ANSWER_SIZE), nonce):
                    ok = True
                    break
                if time.monotonic() >= deadline:
                    break
                self.sleep(self.poll_s)
        finally:
            try:
                rt.rebind_detach(job.instance_id)
            except (StepError, OSError) as exc:  # the runtime zeroes and deletes the file whatever it did
                log.warning("rebind: %s: detach: %s", job.instance_id, exc)
        if not ok:
            self._attempt(job)
            return "the guest did not answer"
        attempts = {k: v for k, v in self.state.attempts.items() if k != job.instance_id}
        self.save(RebindState({**self.state.rebound, job.instance_id: job.ref}, attempts))
        log.info("rebind: %s rebound to %s", job.instance_id, job.ref)
        if self.on_rebound is not None:
            self.on_rebound()
        return "rebound"
