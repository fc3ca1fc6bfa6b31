"""`bcd devplane serve|token|apply|command|cancel|show|secret|release` (docs/devplane.md)."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from pathlib import Path
from typing import Any

from bcd_shared.subcommands import positive_float

TERMINAL = {"succeeded", "failed", "rejected", "cancelled", "expired"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="devplane_command", metavar="ACTION", required=True)
    p = sub.add_parser("serve", help="run the development control plane")
    p.add_argument("--dir", required=True, help="state directory (keys, devplane.db, admin.sock)")
    p.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT of the TLS listener ('' for none)")
    p.add_argument("--unix", default=None, help="also serve on this Unix socket (no TLS)")
    p.add_argument("--no-test-kinds", action="store_true", help="do not accept test.* kinds")
    p = sub.add_parser("token", help="mint a one-time join token")
    p.add_argument("--dir", required=True)
    p = sub.add_parser("apply", help="apply a NodeSpec (protobuf JSON mapping)")
    p.add_argument("spec", help="SPEC.json")
    p.add_argument("--dir", required=True)
    p.add_argument("--node", default=None)
    p = sub.add_parser("command", help="enqueue a signed command")
    p.add_argument("kind")
    p.add_argument("--dir", required=True)
    p.add_argument("--node", default=None)
    p.add_argument("--payload", default=None, help="JSON: the kind's request in protobuf JSON mapping")
    p.add_argument("--not-after", type=positive_float, default=300.0, help="seconds from now")
    p.add_argument("--wait", action="store_true", help="wait for a terminal state and print the record")
    p.add_argument("--timeout", type=positive_float, default=300.0)
    p = sub.add_parser("cancel", help="cancel a command")
    p.add_argument("id")
    p.add_argument("--dir", required=True)
    p = sub.add_parser("show", help="print a node's record")
    p.add_argument("--dir", required=True)
    p.add_argument("--node", default=None)
    p = sub.add_parser("secret", help="store a secret the broker may release")
    p.add_argument("ref")
    p.add_argument("value")
    p.add_argument("--dir", required=True)
    p = sub.add_parser(
        "release",
        help="sign a release artifact (worker key); print the spec's daemon section, or SPEC with it",
    )
    p.add_argument("artifact", type=Path, help="a release artifact (`bcd release build`)")
    p.add_argument("--url", required=True, help="https URL the node downloads the artifact from")
    p.add_argument("--dir", required=True, help="the devplane's state directory (its keys.json)")
    p.add_argument("--version", default=None, help="default: the version the artifact carries")
    p.add_argument("--rollback", action="store_true", help="a signed rollback intent: may be older")
    p.add_argument("--spec", type=Path, default=None, help="print this SPEC.json with the daemon section set")


def _print(value: Any) -> None:
    print(json.dumps(value, indent=1, sort_keys=True, default=str))


def _serve(args: argparse.Namespace) -> int:
    import trio

    from bcd_agent.devplane.plane import DevPlane

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    plane = DevPlane(
        args.dir, listen=args.listen or None, unix_socket=args.unix, test_kinds=not args.no_test_kinds
    )

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(plane.run)
            print(json.dumps(json.loads((Path(args.dir) / "endpoint.json").read_text())), flush=True)
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    break

    trio.run(main)
    return 0


def _release(args: argparse.Namespace) -> int:
    """The daemon section a spec carries for `args.artifact`, its manifest signed with the devplane's
    worker key (purpose daemon-release), as the control plane signs it (docs/daemon.md). Offline: reads
    `DIR/keys.json` (0600, the devplane's user), needs no running devplane."""
    import base64
    import datetime as dt
    import hashlib

    from bcd_shared.release import BadManifest, ReleaseManifest, sign_release
    from bcd_shared.subcommands import EX_DATAERR, EX_NOINPUT, CliError

    from bcd_agent.devplane.keys import KEYS_FILE, load_or_create
    from bcd_agent.sections.daemon.release import artifact_version

    keys_file = Path(args.dir) / KEYS_FILE
    if not keys_file.is_file():  # never create keys here: they would not be the ones the nodes trust
        raise CliError(
            f"{keys_file}: no devplane keys (run `bcd devplane serve --dir {args.dir}` once)", EX_NOINPUT
        )
    spec: dict[str, Any] = {}
    if args.spec is not None:
        from bcd_agent.plan import SpecFileError, load_spec_file

        try:
            load_spec_file(str(args.spec))
        except SpecFileError as exc:
            raise CliError(str(exc), EX_DATAERR) from None
        spec = json.loads(args.spec.read_bytes())
    try:
        data = args.artifact.read_bytes()
        version = artifact_version(args.artifact)
    except OSError as exc:
        raise CliError(f"{args.artifact}: {exc.strerror or exc}", EX_NOINPUT) from None
    except ValueError as exc:
        raise CliError(str(exc), EX_DATAERR) from None
    if args.version is not None and args.version != version:
        raise CliError(f"--version {args.version}: the artifact carries version {version}", EX_DATAERR)
    try:
        manifest = ReleaseManifest(version, args.url, hashlib.sha256(data).hexdigest(), args.rollback)
    except BadManifest as exc:
        raise CliError(f"release manifest: {exc}", EX_DATAERR) from None
    keys = load_or_create(Path(args.dir), dt.datetime.now(dt.UTC))
    section: dict[str, Any] = {
        "version": manifest.version,
        "url": manifest.url,
        "sha256": manifest.sha256,
        "signature": base64.b64encode(sign_release(keys.key("worker"), manifest)).decode(),
    }
    if manifest.rollback:
        section["rollback"] = True
    spec["daemon"] = section
    _print(spec)
    return 0


def run(args: argparse.Namespace) -> int:
    from bcd_agent.devplane.admin import AdminClient, AdminError

    action = args.devplane_command
    if action == "serve":
        return _serve(args)
    if action == "release":
        return _release(args)
    from bcd_shared.subcommands import EX_DATAERR, EX_USAGE, CliError

    client = AdminClient(args.dir)
    # The inputs first, each named in its refusal (before: a JSONDecodeError traceback).
    spec: Any = None
    payload: Any = None
    if action == "apply":
        from bcd_agent.plan import SpecFileError, load_spec_file

        try:  # here, as `bcd plan` reads it: a refusal names the file and the field
            load_spec_file(args.spec)
        except SpecFileError as exc:
            raise CliError(str(exc), EX_DATAERR) from None
        spec = json.loads(Path(args.spec).read_bytes())
    if action == "command" and args.payload:
        try:
            payload = json.loads(args.payload)
        except ValueError as exc:
            raise CliError(f"--payload: not JSON: {exc}", EX_USAGE) from None
    try:
        if action == "token":
            print(client.call("token"))
        elif action == "apply":
            print(client.call("apply", spec=spec, node=args.node))
        elif action == "command":
            cid = client.call(
                "enqueue", kind=args.kind, payload=payload, node=args.node, not_after_s=args.not_after
            )
            if not args.wait:
                print(cid)
                return 0
            deadline = time.monotonic() + args.timeout
            while True:
                record = client.call("command", id=cid)
                if record and record["state"] in TERMINAL:
                    _print(record)
                    return 0 if record["state"] == "succeeded" else 1
                if time.monotonic() > deadline:
                    _print(record)
                    return 1
                time.sleep(0.2)
        elif action == "cancel":
            print(client.call("cancel", id=args.id))
        elif action == "show":
            _print(client.call("node", node=args.node))
        elif action == "secret":
            client.call("secret", ref=args.ref, value=args.value)
    except AdminError as exc:
        print(f"bcd devplane {action}: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # the admin socket: name it, and what serves it
        print(
            f"bcd devplane {action}: {client.path}: {exc.strerror or exc} "
            f"(is `bcd devplane serve --dir {args.dir}` or `bcd sim` running?)",
            file=sys.stderr,
        )
        return 1
    return 0
