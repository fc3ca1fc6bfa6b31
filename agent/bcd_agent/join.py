"""`bcd join --token T --address HOST:PORT|unix:/PATH`: become a node of a control plane (docs/session.md).

1. On a node already joined (`identity.json` exists), return at once: no request, no record, nothing
   written (HST-SIGN-37; re-running the install script must not pin a node). `bcd join --reset --yes`
   joins again (below).
2. Generate the node key (Ed25519) and a PKCS#10 request signed by it.
3. Call the JoinService (TLS, server-authenticated with `--ca-file` or `[control_plane] ca_file`; or a
   Unix socket). The JoinResponse is verified: signed under `join-response` by the JoinService key, which
   must match `join_signing_key_pin` when config.toml sets one (else the key is pinned on first use and
   recorded in identity.json); the certificate names the node id and holds our key; the trust bundle
   verifies against the same pin.
4. As root with `[helper] socket` set, write root's join record `/var/lib/bcd-hostconfig/join-response.pb`
   through `bcd_shared.joinrecord.write_join_record` (verified against the pin again, then written 0600
   under the root-only rule, the bytes exactly as received) before the identity (HST-SIGN-34); with
   `--root DIR` (a simulated host) under DIR, never on the real host. A record that cannot be verified or
   written fails the join, and no identity is written (HST-SIGN-35).
5. Write `identity.json` (0600) beside the journal, the server time mark mirrored from `issued_at`.

**Re-join** (`reset=True`, `bcd join --reset --yes`, HST-SIGN-36): for a node that must join again (joined
before root's join record existed, moved to another control plane, a lost or compromised key). Nothing is
ever deleted; the old files get the suffix `.reset-<UTC yyyymmddThhmmssZ>[-n]`:

- refused while `bcd node` runs on the data directory (its `journal.lock` is held): the running node would
  write its old identity back. The lock is held until the re-join is done, so no node starts meanwhile;
- the join (steps 2-4) happens first, so a refused token or response changes nothing on disk;
- then `identity.json` is linked aside (the old identity stays in place until the new one replaces it
  atomically, so no crash leaves the node without one);
- when the new node id differs from the old one, the journal (`journal.db` and its WAL) and
  `host-intent.json` move aside too: they are the old node's (its commands, results, events, spec) and
  the new node starts with a fresh journal (a new `journal_id`, SpecRequest NO_SPEC). When the node id is
  kept (a `--node-id` re-join the control plane accepts: tpm / provisioned), the journal stays: it is the
  node's at-most-once memory for commands the server may still redeliver;
- the server time mark carries over (the larger of the old identity's and the new `issued_at`), so a
  re-join does not reopen the 5-minute window of DLV-JRN-13;
- the node's other records (the quorum ledger, the devices section's files) describe the host, not the
  identity, and stay.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import logging
import os
import socket
import stat
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import trio
from bcd_shared.version import VERSION

from bcd_agent.config import Config

log = logging.getLogger("bcd.join")

JOIN_RECORD = "/var/lib/bcd-hostconfig/join-response.pb"
RESET_SUFFIX = ".reset-"
# The journal's lock (docs/journal.md: one process per data_dir, `journal.lock` flocked).
JOURNAL_LOCK = "journal.lock"
JOURNAL_FILES = ("journal.db", "journal.db-wal", "journal.db-shm")
HOST_INTENT_FILE = "host-intent.json"


class JoinError(Exception):
    pass


class AlreadyJoined(JoinError):
    """The node already joined: nothing was requested or written (HST-SIGN-37)."""

    def __init__(self, node_id: str, path: Path) -> None:
        super().__init__(f"already joined as {node_id or '(unreadable identity)'} ({path}): nothing written")
        self.node_id = node_id
        self.path = path


def _csr(key: Any, node_id_hint: str) -> bytes:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519
    from cryptography.x509.oid import NameOID

    private = ed25519.Ed25519PrivateKey.from_private_bytes(key.seed)
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id_hint or "bcd-node")]))
        .sign(private, None)
    )
    return csr.public_bytes(serialization.Encoding.DER)


async def join(
    config: Config,
    *,
    token: str,
    address: str,
    ca_file: str | None = None,
    root: str = "/",
    hostname: str | None = None,
    node_id: str = "",
    reset: bool = False,
) -> Any:
    """Join and write the identity; returns it (session.identity.Identity).

    Raises AlreadyJoined when identity.json exists and `reset` is false, JoinError when the join is
    refused (the message says why; nothing of the new identity is written)."""
    from bcd_agent.session import identity as ident

    path = ident.identity_path(config.data_dir)
    if not reset and path.exists():
        raise AlreadyJoined(_node_id_of(config.data_dir), path)
    os.makedirs(config.data_dir, mode=0o700, exist_ok=True)
    with _data_dir_lock(Path(config.data_dir)) if reset else contextlib.nullcontext():
        old = _old_identity(config.data_dir) if reset and path.exists() else None
        if reset and old is None and path.exists():
            log.warning("join --reset: %s cannot be read; it is moved aside all the same", path)
        identity, data = await _join_call(
            config, token=token, address=address, ca_file=ca_file, hostname=hostname, node_id=node_id
        )
        if os.geteuid() == 0 and config.helper.socket is not None:
            _write_record(Path(root), data, identity.pin)
        if old is not None:
            identity = ident.with_mark(identity, old.server_time_mark_ms)
            if old.node_id == identity.node_id:  # a new node id starts its generations over
                identity = ident.with_generation(identity, old.applied_generation_mark)
        if reset and path.exists():
            stamp = _stamp(Path(config.data_dir))
            _link_aside(path, stamp)
            if old is None or old.node_id != identity.node_id:
                moved = _move_aside(Path(config.data_dir), (*JOURNAL_FILES, HOST_INTENT_FILE), stamp)
                log.warning(
                    "join --reset: node %s becomes %s; moved aside: %s",
                    old.node_id if old else "(unreadable)",
                    identity.node_id,
                    ", ".join(p.name for p in moved) or "nothing else",
                )
            else:
                log.warning("join --reset: node %s joined again; the journal is kept", identity.node_id)
        ident.save(config.data_dir, identity)
        _give_to_the_node(ident.identity_path(config.data_dir))
    return identity


def _give_to_the_node(path: Path, fd: int | None = None) -> None:
    """Root joins (so that root keeps the join record), but what it leaves in data_dir is the node's:
    identity.json (its key) and a journal.lock a reset made go to the account that owns data_dir
    (install.sh: `bcd`), else the unprivileged node cannot open them. The file is opened without
    following a link and must still be root's one link, so a name swapped in data_dir cannot turn the
    chown onto another file."""
    if os.geteuid() != 0:
        return
    owner = os.stat(path.parent)
    if owner.st_uid == 0:
        return
    own = fd is None
    if fd is None:
        # O_NONBLOCK: a FIFO swapped in would otherwise hold root's open (it is then refused below).
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if st.st_uid == owner.st_uid and stat.S_ISREG(st.st_mode):
            return
        if st.st_uid != 0 or st.st_nlink != 1 or not stat.S_ISREG(st.st_mode):
            raise JoinError(f"{path} changed while it was written; join again")
        os.fchown(fd, owner.st_uid, owner.st_gid)
    finally:
        if own:
            os.close(fd)


def _node_id_of(data_dir: str) -> str:
    from bcd_agent.session import identity as ident

    try:
        return ident.load(data_dir).node_id
    except ident.IdentityError:
        return ""


def _old_identity(data_dir: str) -> Any:
    from bcd_agent.session import identity as ident

    try:
        return ident.load(data_dir)
    except ident.IdentityError:
        return None


async def _join_call(
    config: Config, *, token: str, address: str, ca_file: str | None, hostname: str | None, node_id: str
) -> tuple[Any, bytes]:
    """The JoinService call and every check of its answer: (the new Identity, the JoinResponse bytes
    exactly as received). Writes nothing."""
    from bcd_shared import wire
    from bcd_shared.pki import KeyPair, parse_certificate, verify_join_response
    from bcd_shared.pki.errors import PkiError
    from bcd_shared.pki.pins import JoinKeyPin

    from bcd_agent.session import identity as ident
    from bcd_agent.session.transport import Endpoint, join_call

    ca_path = ca_file or config.control_plane.ca_file
    ca_pem = Path(ca_path).read_text() if ca_path else None  # noqa: ASYNC240 (one small file at start)
    endpoint = Endpoint.parse(address, ca_pem=ca_pem, server_name=config.control_plane.server_name)
    key = KeyPair.generate()
    request = wire.JoinRequest(
        token=token,
        node_public_key=key.public_key,
        csr=_csr(key, node_id),
        hostname=hostname or socket.gethostname(),
        role=wire.Role.NODE,
        version=VERSION,  # one constant (docs/operations.md "Version and logs"), not a literal
        node_id=node_id,
    )
    try:
        data = await join_call(endpoint, request)  # the JoinResponse exactly as received (strictly checked)
    except Exception as exc:  # grpclib's GRPCError, a connection error, inside trio-asyncio's group
        raise JoinError(f"the JoinService at {address} refused or failed: {_describe(exc)}") from exc
    response = wire.JoinResponse.parse(data)
    pin = config.join_signing_key_pin
    if pin is None:
        from bcd_shared.pki.bundle import _raw_key_of_spki
        from bcd_shared.pki.errors import UntrustedJoinSigner

        try:
            pin = JoinKeyPin.of_key(_raw_key_of_spki(bytes(response.signer_spki), UntrustedJoinSigner))
        except PkiError as exc:
            raise JoinError(f"join response refused: {exc}") from None
        log.warning(
            "join: no join_signing_key_pin configured; pinning the JoinService key %s on first use", pin
        )
    try:
        verified = verify_join_response(data, pin)
        leaf = parse_certificate(verified.certificate_chain[0])
    except (PkiError, IndexError) as exc:
        raise JoinError(f"join response refused: {exc}") from None
    if leaf.public_key != key.public_key or leaf.name != verified.node_id:
        raise JoinError("join response refused: the certificate is not for this node's key and id")
    bundle = verified.trust_bundle
    identity = ident.Identity(
        node_id=verified.node_id,
        node_key=key,
        certificate_chain=verified.certificate_chain,
        join_pin=str(pin),
        address=address,
        trust_bundle=None
        if bundle is None
        else ident.SignedBundle(bundle.bundle_bytes, bundle.signature, bundle.signer_spki),
        gateway_ca_pem=ca_pem,
        server_time_mark_ms=max(0, verified.issued_at_ms),
    )
    return identity, data


def _describe(exc: BaseException) -> str:
    """The leaf errors of a (nested) exception group, as one line: a GRPCError as `STATUS: message`."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_describe(e) for e in exc.exceptions)
    status, message = getattr(exc, "status", None), getattr(exc, "message", None)
    if status is not None and message is not None:
        return f"{getattr(status, 'name', status)}: {message}"
    return f"{type(exc).__name__}: {exc}"


def _write_record(root: Path, data: bytes, pin: Any) -> None:
    """Root's join record through bcd_shared.joinrecord (verify against the pin, then write root-only
    0600). Any failure fails the join before the identity is written (HST-SIGN-35)."""
    from bcd_shared.joinrecord import write_join_record
    from bcd_shared.pki.errors import PkiError
    from bcd_shared.rootpath import RootPathRefused

    try:
        write_join_record(root, data, pin, JOIN_RECORD)
    except (PkiError, RootPathRefused, OSError) as exc:
        raise JoinError(f"root's join record {JOIN_RECORD} not written: {exc}; no identity written") from None


@contextlib.contextmanager
def _data_dir_lock(data_dir: Path) -> Iterator[None]:
    """The journal's lock, held while a re-join replaces the identity (no `bcd node` runs meanwhile)."""
    fd = os.open(data_dir / JOURNAL_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        _give_to_the_node(data_dir / JOURNAL_LOCK, fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise JoinError(
                f"bcd node is running on {data_dir} ({JOURNAL_LOCK} is held): stop it first "
                "(systemctl stop bcd-node), then run bcd join --reset --yes again"
            ) from None
        yield
    finally:
        os.close(fd)


def _stamp(data_dir: Path) -> str:
    """`.reset-<UTC stamp>[-n]`, unused by any file in data_dir."""
    base = RESET_SUFFIX + time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    names = set(os.listdir(data_dir))
    n = 0
    while any(name.endswith(base + (f"-{n}" if n else "")) for name in names):
        n += 1
    return base + (f"-{n}" if n else "")


def _link_aside(path: Path, stamp: str) -> Path:
    """A second name for the old identity: it stays in place until the new one replaces it."""
    from bcd_shared.system import fsync_dir

    aside = path.with_name(path.name + stamp)
    os.link(path, aside)
    fsync_dir(path.parent)
    return aside


def _move_aside(data_dir: Path, names: tuple[str, ...], stamp: str) -> list[Path]:
    from bcd_shared.system import fsync_dir

    moved = []
    for name in names:
        src = data_dir / name
        dst = data_dir / (name + stamp)
        try:
            os.rename(src, dst)
        except FileNotFoundError:
            continue
        moved.append(dst)
    fsync_dir(data_dir)
    return moved


def _check_ca_file(path: str | None, named_by: str) -> None:
    """The CA file, if any, is there and holds a PEM certificate: before, a missing one was
    "FileNotFoundError: ..." (exit 1) and one of another format an SSLError from deep in the call."""
    import errno

    from bcd_shared.subcommands import EX_DATAERR, EX_NOINPUT, CliError, os_error_code

    if path is None:
        return
    try:
        text = Path(path).read_bytes()
    except OSError as exc:
        code = EX_NOINPUT if exc.errno == errno.ENOENT else os_error_code(exc)
        raise CliError(f"the CA file {path} (from {named_by}) cannot be read: {exc.strerror}", code) from None
    if b"-----BEGIN CERTIFICATE-----" not in text:
        raise CliError(f"the CA file {path} (from {named_by}) holds no PEM certificate", EX_DATAERR)


def _address(text: str) -> str:
    """argparse type of --address: a bad one is a usage error (64) naming the rule, not a ValueError."""
    from bcd_agent.session.transport import Endpoint

    try:
        endpoint = Endpoint.parse(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT or unix:/PATH, got {text!r}") from None
    if endpoint.port is not None and not 1 <= endpoint.port <= 65535:
        raise argparse.ArgumentTypeError(f"port {endpoint.port} is outside 1-65535 in {text!r}")
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from bcd_shared.subcommands import root_dir

    from bcd_agent.config import add_config_argument

    add_config_argument(parser)
    parser.add_argument("--token", required=True, help="the one-time join token")
    parser.add_argument(
        "--address", required=True, type=_address, help="the JoinService: HOST:PORT (TLS) or unix:/PATH"
    )
    parser.add_argument(
        "--ca-file", default=None, help="PEM of the CA the control plane's TLS certificate has"
    )
    parser.add_argument("--node-id", default="", help="keep this node id (a re-join)")
    parser.add_argument(
        "--root",
        default="/",
        type=root_dir,
        help="the directory standing for / (a simulated host): root's join record goes there",
    )
    parser.add_argument(
        "--reset",
        action="store_true",
        help="join again: the old identity (and, for a new node id, the journal) moved aside, never deleted; "
        "needs --yes",
    )
    parser.add_argument("--yes", action="store_true", help="confirm --reset")


RESET_NEEDS_YES = (
    "--reset joins this node again with the token and moves {identity} aside as "
    "identity.json.reset-<time> (never deleted); when the control plane gives a new node id, the journal "
    "and host-intent.json move aside too and the node starts as the new node. Stop bcd node first. "
    "Run again with --reset --yes to do it."
)


def run(args: argparse.Namespace) -> int:
    from bcd_shared.subcommands import EX_CONFIG, EX_USAGE, CliError

    from bcd_agent.config import ConfigError, default_config_path, load_config

    # A bad command line is a usage error (64) whatever the config says: checked before the file is read.
    if args.yes and not args.reset:
        raise CliError("--yes confirms --reset; without --reset it means nothing", EX_USAGE)
    try:
        config = load_config(args.config or default_config_path())
    except ConfigError as exc:
        raise CliError(str(exc), EX_CONFIG) from None
    if args.reset and not args.yes:
        raise CliError(RESET_NEEDS_YES.format(identity=config.identity_path), EX_USAGE)
    _check_ca_file(
        args.ca_file or config.control_plane.ca_file, "--ca-file" if args.ca_file else config.source
    )
    try:
        identity = trio.run(
            lambda: join(
                config,
                token=args.token,
                address=args.address,
                ca_file=args.ca_file,
                node_id=args.node_id,
                root=args.root,
                reset=args.reset,
            )
        )
    except AlreadyJoined as exc:
        # HST-SIGN-37: at once and successfully, so that re-running the install script changes nothing.
        print(f"bcd join: {exc}; to join again: bcd join --reset --yes --token ...", file=sys.stderr)
        if exc.node_id:
            print(exc.node_id)
        return 0
    except JoinError as exc:
        print(f"bcd join: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        print(f"bcd join: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    # stdout stays the node id alone (scripts read it); the next step goes to stderr.
    print(
        f"bcd join: joined as {identity.node_id}; next: systemctl enable --now bcd-node (or run `bcd node`), "
        "then `bcd doctor`",
        file=sys.stderr,
    )
    print(identity.node_id)
    return 0
