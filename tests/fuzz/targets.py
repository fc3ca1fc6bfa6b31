"""Fuzz targets: every parser that faces bytes from outside, called the way production calls it.

Each target takes the fuzzer's bytes and either returns or raises one of its documented error types;
anything else (or a run over 1 s) is a crash. Signed inputs are signed with a real test key before they
reach the parser, so the fuzzer gets past the signature check in front of it and exercises the decoder
behind it (a random signature would stop every input at the check).

Used by tests/fuzz/run.py (atheris, coverage-guided) and tests/fuzz/test_fuzz.py (corpus replay in CI).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import json
from collections.abc import Callable
from pathlib import Path

import attrs


@attrs.frozen
class Target:
    name: str
    run: Callable[[bytes], object]
    expected: tuple[type[BaseException], ...]
    doc: str


T0 = dt.datetime(2026, 11, 20, 12, 0, tzinfo=dt.UTC)


@functools.cache
def _keys() -> dict[str, object]:
    """A command-signing root, a worker leaf under it, and a JoinService key (built once per process)."""
    from bcd_shared.pki import KeyPair, TrustBundle, issue_leaf, issue_root
    from bcd_shared.pki import Role as PkiRole

    day = dt.timedelta(days=1)
    root_key, worker_key, join_key = KeyPair.generate(), KeyPair.generate(), KeyPair.generate()
    root = issue_root(root_key, "fuzz root", T0 - 365 * day, T0 + 3650 * day)
    leaf = issue_leaf(
        root, root_key, worker_key.public_key, PkiRole.WORKER, "worker", T0 - day, T0 + 30 * day
    )
    bundle = TrustBundle(version=1, command_roots=(root,))
    return {"worker": worker_key, "chain": (leaf,), "bundle": bundle, "join": join_key}


# --- the helper ------------------------------------------------------------------------------------------


def helper_frame(data: bytes) -> object:
    """A frame body as the helper's server decodes it (strict JSON)."""
    from bcd_helper.protocol import decode_body

    return decode_body(data)


def helper_request(data: bytes) -> object:
    """The first byte picks an op of the OPS table; the rest is its request frame, decoded strictly and
    structured into the op's typed request."""
    from bcd_helper.ops.table import OPS
    from bcd_helper.protocol import decode_body, structure

    if not data:
        return None
    names = sorted(OPS)
    spec = OPS[names[data[0] % len(names)]]
    return structure(decode_body(data[1:]), spec.request)


# --- the session's signed inputs ----------------------------------------------------------------------------


def desired_state(data: bytes) -> object:
    """A DesiredState whose body is the fuzzer's bytes, signed by the worker: judged as the session does.
    judge() returns a verdict for every input (refusals are verdicts, never exceptions)."""
    from bcd_agent.session.spec import judge
    from bcd_shared import wire
    from bcd_shared.pki import KeyPair
    from bcd_shared.pki.signing import Purpose

    keys = _keys()
    worker = keys["worker"]
    assert isinstance(worker, KeyPair)
    envelope = wire.DesiredState(
        body=data,
        signature=worker.sign(Purpose.DESIRED_STATE, data),
        signer_chain=list(keys["chain"]),  # type: ignore[call-overload]
    )
    return judge(envelope, node_id="node-a", applied=None, trust=keys["bundle"], now=T0)  # type: ignore[arg-type]


def command(data: bytes) -> object:
    """A Command whose body is the fuzzer's bytes, signed by the worker: the wire edge, then the
    signature check against the trust bundle, as the dispatcher runs them."""
    from bcd_agent.dispatch.trust import BundleTrust
    from bcd_agent.dispatch.wire import envelope_from_wire
    from bcd_shared import wire
    from bcd_shared.pki import KeyPair
    from bcd_shared.pki.signing import Purpose

    keys = _keys()
    worker = keys["worker"]
    assert isinstance(worker, KeyPair)
    message = wire.Command(
        body=data,
        signature=worker.sign(Purpose.COMMAND, data),
        signer_chain=list(keys["chain"]),  # type: ignore[call-overload]
    )
    envelope = envelope_from_wire(message)
    BundleTrust(keys["bundle"]).verify_command(envelope, T0)  # type: ignore[arg-type]
    return envelope


def gateway_message(data: bytes) -> object:
    """A frame from the gateway, decoded strictly as the session decodes every message."""
    from bcd_shared import wire
    from bcd_shared.wire.strict import decode

    return decode(wire.GatewayMessage, data)


def trust_bundle(data: bytes) -> object:
    """A SignedTrustBundle whose bundle is the fuzzer's bytes, signed by the pinned JoinService key."""
    from bcd_shared import wire
    from bcd_shared.pki import JoinKeyPin, KeyPair
    from bcd_shared.pki.bundle import verify_signed_trust_bundle
    from bcd_shared.pki.pins import spki_der
    from bcd_shared.pki.signing import Purpose

    join = _keys()["join"]
    assert isinstance(join, KeyPair)
    signed = wire.SignedTrustBundle(
        bundle=data, signature=join.sign(Purpose.TRUST_BUNDLE, data), signer_spki=spki_der(join.public_key)
    )
    return verify_signed_trust_bundle(bytes(signed), JoinKeyPin.of_key(join.public_key))


# --- config, tool output, CDI ---------------------------------------------------------------------


def node_config(data: bytes) -> object:
    from bcd_agent.config import parse_config

    return parse_config(data.decode("utf-8", errors="replace"), "fuzz.toml")


def helper_config(data: bytes) -> object:
    from bcd_helper.config import parse_config

    return parse_config(data, "/etc/bcd/config.toml")


def nvidia_smi(data: bytes) -> object:
    """The first byte picks what runs (bcd_shared.nvsmi, each as its callers call it): 0 `-L`; 1 a CSV
    `--query-gpu`; 2 `-q -x` (XML); 3 `-L` and `-q -x` (split at the first NUL) parsed and joined per GPU
    by `join_migs`, with the GPU's `-q -x` and without it (old drivers' names), as root's `_mig_names` and
    the node's `build_inventory` do; 4 a CSV `--query-compute-apps` (the devices section's busy check);
    5 `mig -lgi` and `mig -lci` tables."""
    from bcd_shared import nvsmi

    if not data:
        return None
    which, rest = data[0] % 6, data[1:]
    if which == 0:
        return nvsmi.parse_list(rest.decode("utf-8", errors="replace"))
    if which == 1:
        rows = nvsmi.parse_csv(rest.decode("utf-8", errors="replace"), nvsmi.QUERY_GPU_FIELDS)
        return nvsmi.queried_gpus(rows)
    if which == 2:
        return nvsmi.parse_qx(rest)
    if which == 3:
        listing, _, xml = rest.partition(b"\0")
        listed = nvsmi.parse_list(listing.decode("utf-8", errors="replace"))
        qx = {g.uuid: g for g in nvsmi.parse_qx(xml).gpus}
        return [(nvsmi.join_migs(g, qx.get(g.uuid)), nvsmi.join_migs(g, None)) for g in listed]
    if which == 4:
        return nvsmi.compute_apps(
            nvsmi.parse_csv(rest.decode("utf-8", errors="replace"), ("gpu_uuid", "pid"))
        )
    text = rest.decode("utf-8", errors="replace")
    return nvsmi.parse_lgi(text), nvsmi.parse_lci(text)


def cdi(data: bytes) -> object:
    """The first byte picks the parser: a hold spec, root's vendor spec, or an allocation env file."""
    from bcd_shared import cdi as c

    if not data:
        return None
    which, rest = data[0] % 3, data[1:]
    if which == 0:
        return c.parse_hold_spec(rest, "a1")
    if which == 1:
        return c.parse_vendor_spec(rest)
    return c.parse_env_file(rest, "a1")


def _errors(name: str) -> tuple[type[BaseException], ...]:
    """The documented error types of each target (imported lazily: atheris instruments on import)."""
    if name in ("helper_frame", "helper_request"):
        from bcd_helper.protocol import DecodeError, ProtocolError

        return (ProtocolError, DecodeError)
    if name == "desired_state":
        return ()
    if name == "command":
        from bcd_agent.dispatch.command import InvalidCommand
        from bcd_shared.pki.errors import PkiError

        return (InvalidCommand, PkiError)
    if name == "gateway_message":
        from bcd_shared.wire.strict import WireError

        return (WireError,)
    if name == "trust_bundle":
        from bcd_shared.pki.errors import PkiError

        return (PkiError,)
    if name == "node_config":
        from bcd_agent.config import ConfigError

        return (ConfigError,)
    if name == "helper_config":
        from bcd_helper.config import ConfigError as HelperConfigError

        return (HelperConfigError,)
    if name == "nvidia_smi":
        from bcd_shared.nvsmi import NvsmiParseError

        return (NvsmiParseError,)
    if name == "cdi":
        from bcd_shared.cdi import CdiError

        return (CdiError,)
    raise KeyError(name)


RUNNERS: dict[str, Callable[[bytes], object]] = {
    "helper_frame": helper_frame,
    "helper_request": helper_request,
    "desired_state": desired_state,
    "command": command,
    "gateway_message": gateway_message,
    "trust_bundle": trust_bundle,
    "node_config": node_config,
    "helper_config": helper_config,
    "nvidia_smi": nvidia_smi,
    "cdi": cdi,
}

CORPUS = Path(__file__).parent / "corpus"


def target(name: str) -> Target:
    run = RUNNERS[name]
    return Target(name, run, _errors(name), (run.__doc__ or "").strip())


def call(name: str, data: bytes) -> None:
    """Run one input; re-raise anything that is not a documented error."""
    t = target(name)
    with contextlib.suppress(*t.expected):
        t.run(data)


def seeds(name: str) -> list[Path]:
    folder = CORPUS / name
    return sorted(p for p in folder.iterdir() if p.is_file()) if folder.is_dir() else []


def dump(doc: object) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()
