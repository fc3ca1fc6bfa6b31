"""`bcd join`: root's join record through `bcd_shared.joinrecord`, a joined node returning at once, and the
re-join `bcd join --reset --yes`, against the development control plane on a Unix socket.

Root's join record goes under a simulated root (`root=`), never the real host's /var/lib. The record
tests need euid 0 (the record is written only by root on a node with `[helper]`).

Covers HST-SIGN-34 (the record written, verified, 0600, the exact bytes, before the identity),
HST-SIGN-35 (a failed record fails the join and leaves no identity), HST-SIGN-36 (`--reset --yes` moves
the identity aside and joins again; a kept node id keeps the journal), HST-SIGN-37 (a joined node
returns at once, writes no record, uses no token), DLV-JRN-07 (the certificate chain and the trust bundle
in identity.json) and DLV-JRN-14 (the server time mark survives a re-join).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import stat
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio
from bcd_agent import join as joinmod
from bcd_agent.config import Config, load_config
from bcd_agent.devplane.plane import DevPlane
from bcd_agent.join import AlreadyJoined, JoinError, join
from bcd_agent.journal import CommandFlags, Journal, NewCommand
from bcd_agent.session import identity as ident
from bcd_shared import wire
from bcd_shared.joinrecord import JOIN_RECORD, read_join_record
from bcd_shared.pki import KeyPair, issue_node_certificate, issue_root
from bcd_shared.pki.pins import JoinKeyPin
from bcd_shared.subcommands import EX_USAGE, CliError

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="root's join record is written by root only")


class World:
    def __init__(self, tmp: Path) -> None:
        os.chmod(tmp, 0o755)
        self.tmp = tmp
        self.root = tmp / "host"
        self.root.mkdir(mode=0o755)
        self.gw = tmp / "gw.sock"
        self.plane = DevPlane(tmp / "dp", listen=None, unix_socket=self.gw)
        self.data = tmp / "data"

    def config(self, *, helper: bool = True, pin: str | None = None) -> Config:
        toml = self.tmp / "node.toml"
        pin = self.plane.join_pin if pin is None else pin
        text = f'data_dir = "{self.data}"\njoin_signing_key_pin = "{pin}"\n'
        if helper:
            # Nothing listens there: join only needs to know the node runs beside a helper.
            text += '[helper]\nsocket = "/run/bcd/helper.sock"\n'
        toml.write_text(text)
        return load_config(str(toml))

    @property
    def record(self) -> Path:
        return self.root / JOIN_RECORD.lstrip("/")

    async def join(self, config: Config, **kw: object) -> ident.Identity:
        identity: ident.Identity = await join(
            config, token=self.plane.issue_token(), address=f"unix:{self.gw}", root=str(self.root), **kw
        )
        return identity

    def aside(self, name: str) -> list[Path]:
        return sorted(self.data.glob(f"{name}.reset-*"))

    def token_used(self, token: str) -> bool:
        row = self.plane.store.one("SELECT used_at FROM tokens WHERE token = ?", token)
        return row is not None and row[0] is not None


@asynccontextmanager
async def serving(tmp_path: Path) -> AsyncIterator[World]:
    world = World(tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(world.plane.run)
        yield world
        nursery.cancel_scope.cancel()


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# --- root's join record -------------------------------------------------------------------------------


@as_root
async def test_HST_SIGN_34_root_writes_the_verified_record_before_the_identity(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with serving(tmp_path) as world:
        config = world.config()
        seen_at_save: list[bool] = []
        save = ident.save

        def save_after_record(data_dir: object, identity: ident.Identity) -> None:
            seen_at_save.append(world.record.exists())
            save(data_dir, identity)  # type: ignore[arg-type]

        monkeypatch.setattr(ident, "save", save_after_record)
        identity = await world.join(config)
        assert seen_at_save == [True]  # the record was there before the identity was written
        assert _mode(world.record) == 0o600 and world.record.stat().st_uid == 0
        got = read_join_record(world.root, JoinKeyPin.parse(world.plane.join_pin))
        assert got is not None
        data, verified = got
        assert verified.node_id == identity.node_id
        # The exact bytes as signed: the body the JoinService signed, re-verified from the file.
        assert wire.JoinResponseBody.parse(wire.JoinResponse.parse(data).body).node_id == identity.node_id
        # DLV-JRN-07: the certificate chain and the trust bundle are kept in identity.json.
        loaded = ident.load(config.data_dir)
        assert loaded.certificate_chain == verified.certificate_chain
        assert verified.trust_bundle is not None and loaded.trust_bundle is not None
        assert loaded.trust_bundle.bundle == verified.trust_bundle.bundle_bytes
        bundle = loaded.verified_bundle()
        assert bundle is not None and bundle.bundle.has_command_roots


@as_root
async def test_root_joins_but_the_identity_is_the_nodes(tmp_path: Path) -> None:
    """`bcd join` as root (for root's join record) on a data_dir the node's account owns (install.sh makes
    it bcd:bcd 0700) leaves identity.json to that account, 0600: the unprivileged node must read it."""
    async with serving(tmp_path) as world:
        world.data.mkdir(mode=0o700)
        os.chown(world.data, 65534, 65534)
        await world.join(world.config())
        st = ident.identity_path(world.data).stat()
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (65534, 65534, 0o600)
        assert world.record.stat().st_uid == 0  # root's record stays root's
        # A reset as root creates the journal's lock: the node's too (it opens it read-write).
        await world.join(world.config(), reset=True)
        for name in ("identity.json", "journal.lock"):
            assert (world.data / name).stat().st_uid == 65534, name


async def test_no_record_without_helper(tmp_path: Path) -> None:
    async with serving(tmp_path) as world:
        await world.join(world.config(helper=False))
        assert not world.record.exists()
        assert ident.identity_path(world.data).exists()


@as_root
async def test_HST_SIGN_35_a_record_refused_by_the_root_only_rule_fails_the_join(tmp_path: Path) -> None:
    async with serving(tmp_path) as world:
        (world.root / "var/lib").mkdir(parents=True)
        os.chmod(world.root / "var", 0o777)  # a directory the node could have swapped things under
        with pytest.raises(
            JoinError, match=r"join record .* not written: .*/var is not a directory only root"
        ):
            await world.join(world.config())
        assert not world.record.exists()
        assert not ident.identity_path(world.data).exists()  # no identity


@as_root
async def test_HST_SIGN_35_a_record_the_pin_does_not_verify_fails_the_join(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """write_join_record verifies the bytes against the pin itself before writing: bytes that do not
    verify (here: a record changed after the response was checked) fail the join, nothing written."""
    from bcd_shared import joinrecord

    write = joinrecord.write_join_record

    def tampered(root: Path, data: bytes, pin: JoinKeyPin, path: str = JOIN_RECORD) -> object:
        return write(root, data[:-1] + bytes([data[-1] ^ 1]), pin, path)

    monkeypatch.setattr(joinrecord, "write_join_record", tampered)
    async with serving(tmp_path) as world:
        with pytest.raises(JoinError, match=r"join record .* not written"):
            await world.join(world.config())
        assert not world.record.exists()
        assert not ident.identity_path(world.data).exists()


async def test_HST_SIGN_35_a_response_another_key_signed_is_refused(tmp_path: Path) -> None:
    async with serving(tmp_path) as world:
        other = str(JoinKeyPin.of_key(KeyPair.generate().public_key))
        with pytest.raises(JoinError, match="join response refused"):
            await world.join(world.config(pin=other))
        assert not world.record.exists()
        assert not ident.identity_path(world.data).exists()


# --- a joined node ------------------------------------------------------------------------------------


@as_root
async def test_HST_SIGN_37_a_joined_node_returns_at_once_and_writes_no_record(tmp_path: Path) -> None:
    async with serving(tmp_path) as world:
        config = world.config()
        first = await world.join(config)
        world.record.unlink()  # as on a node joined before records existed
        before = ident.identity_path(world.data).read_bytes()
        token = world.plane.issue_token()
        with pytest.raises(AlreadyJoined) as refused:
            await join(config, token=token, address=f"unix:{world.gw}", root=str(world.root))
        assert refused.value.node_id == first.node_id
        assert not world.record.exists()  # no record: re-running the install script pins nothing
        assert ident.identity_path(world.data).read_bytes() == before
        assert not world.token_used(token)  # not even a request


def _args(config_path: Path, **kw: object) -> argparse.Namespace:
    base: dict[str, object] = {
        "config": str(config_path),
        "token": "t",
        "address": "unix:/nonexistent/gw.sock",
        "ca_file": None,
        "node_id": "",
        "root": "/nonexistent-root",
        "reset": False,
        "yes": False,
    }
    base.update(kw)
    return argparse.Namespace(**base)


def _joined_data_dir(tmp_path: Path) -> tuple[Path, Path, bytes]:
    now = dt.datetime.now(dt.UTC)
    ca_key, node_key = KeyPair.generate(), KeyPair.generate()
    ca = issue_root(ca_key, "ca", now, now + dt.timedelta(days=1), path_length=0)
    cert = issue_node_certificate(
        ca, ca_key, node_key.public_key, "node-cli", now, now + dt.timedelta(days=1)
    )
    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    ident.save(data, ident.Identity("node-cli", node_key, (cert,), str(JoinKeyPin.of_key(ca_key.public_key))))
    toml = tmp_path / "node.toml"
    toml.write_text(f'data_dir = "{data}"\n')
    return toml, data, ident.identity_path(data).read_bytes()


def test_HST_SIGN_37_cli_exits_0_on_a_joined_node(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    toml, data, before = _joined_data_dir(tmp_path)
    assert joinmod.run(_args(toml)) == 0  # no control plane at that address: nothing was asked
    out, err = capsys.readouterr()
    assert out.strip() == "node-cli" and "already joined as node-cli" in err and "--reset --yes" in err
    assert ident.identity_path(data).read_bytes() == before and not list(data.glob("*.reset-*"))


def test_HST_SIGN_36_cli_reset_needs_yes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    toml, data, before = _joined_data_dir(tmp_path)
    with pytest.raises(CliError) as refused:
        joinmod.run(_args(toml, reset=True))
    err = refused.value.message
    assert refused.value.code == EX_USAGE
    assert "--reset --yes" in err and "never deleted" in err and "Stop bcd node first" in err
    with pytest.raises(CliError) as refused:
        joinmod.run(_args(toml, yes=True))
    assert refused.value.code == EX_USAGE
    assert ident.identity_path(data).read_bytes() == before and not list(data.glob("*.reset-*"))


# --- re-join ------------------------------------------------------------------------------------------


def _journal_with_a_command(data: Path, cid: str = "01J00000000000000000000CMD") -> str:
    with Journal.open(data, boot_id="b1") as journal:
        journal.accept_command(NewCommand(cid, "inventory.refresh", CommandFlags(retry_safe=True)))
        return journal.journal_id


@as_root
async def test_HST_SIGN_36_reset_yes_moves_the_old_node_aside_and_joins_as_a_new_one(tmp_path: Path) -> None:
    async with serving(tmp_path) as world:
        config = world.config()
        old = await world.join(config)
        # DLV-JRN-14: a mark well ahead of the new join's issued_at, mirrored in the old identity.
        ahead = old.server_time_mark_ms + 3_600_000
        # And the old node's applied generation mark, which a new node id must not inherit (its
        # generations start over).
        ident.save(world.data, ident.with_generation(ident.with_mark(old, ahead), 12))
        old_bytes = ident.identity_path(world.data).read_bytes()
        journal_id = _journal_with_a_command(world.data)
        (world.data / "host-intent.json").write_text("{}")
        os.chmod(world.data / "host-intent.json", 0o600)

        new = await world.join(config, reset=True)
        assert new.node_id != old.node_id
        # Nothing deleted: the old identity, journal and host intent are kept under one suffix.
        [aside] = world.aside("identity.json")
        assert aside.read_bytes() == old_bytes and _mode(aside) == 0o600
        suffix = aside.name.removeprefix("identity.json")
        assert (world.data / f"journal.db{suffix}").exists()
        assert (world.data / f"host-intent.json{suffix}").read_text() == "{}"
        assert not (world.data / "journal.db").exists() and not (world.data / "host-intent.json").exists()
        loaded = ident.load(world.data)
        assert loaded.node_id == new.node_id and loaded.server_time_mark_ms == ahead
        assert loaded.applied_generation_mark == 0
        # Root's record now names the new node (the helper's binding moves, HST-SIGN-22).
        got = read_join_record(world.root, JoinKeyPin.parse(world.plane.join_pin))
        assert got is not None and got[1].node_id == new.node_id
        # The new node starts with a fresh journal (a new journal_id: the server sees a new node).
        with Journal.open(world.data, boot_id="b2") as fresh:
            assert fresh.journal_id != journal_id


@as_root
async def test_HST_SIGN_36_reset_keeping_the_node_id_keeps_the_journal(tmp_path: Path) -> None:
    async with serving(tmp_path) as world:
        config = world.config()
        old = await world.join(config)
        # The applied generation mark stays with the node id (hostile gateway, round 2: a lost journal,
        # or a re-join, must not let an older signed generation in).
        ident.save(world.data, ident.with_generation(old, 12))
        journal_id = _journal_with_a_command(world.data)
        new = await world.join(config, reset=True, node_id=old.node_id)  # a tpm / provisioned re-join
        assert new.node_id == old.node_id and new.node_key.seed != old.node_key.seed
        assert ident.load(world.data).applied_generation_mark == 12
        assert len(world.aside("identity.json")) == 1 and not world.aside("journal.db")
        with Journal.open(world.data, boot_id="b2") as kept:
            assert kept.journal_id == journal_id
            assert kept.get_command("01J00000000000000000000CMD") is not None


async def test_HST_SIGN_36_reset_is_refused_while_the_node_runs(tmp_path: Path) -> None:
    async with serving(tmp_path) as world:
        config = world.config(helper=False)
        await world.join(config)
        before = ident.identity_path(world.data).read_bytes()
        token = world.plane.issue_token()
        # What a running bcd node holds: the journal's lock.
        with Journal.open(world.data, boot_id="b1"), pytest.raises(JoinError, match="bcd node is running"):
            await join(config, token=token, address=f"unix:{world.gw}", reset=True)
        assert ident.identity_path(world.data).read_bytes() == before
        assert not world.aside("identity.json") and not world.token_used(token)


async def test_HST_SIGN_36_a_refused_re_join_changes_nothing(tmp_path: Path) -> None:
    async with serving(tmp_path) as world:
        config = world.config(helper=False)
        await world.join(config)
        before = ident.identity_path(world.data).read_bytes()
        journal_id = _journal_with_a_command(world.data)
        with pytest.raises(JoinError, match=r"refused or failed: .*token unknown or already used"):
            await join(config, token="not-a-token", address=f"unix:{world.gw}", reset=True)
        assert ident.identity_path(world.data).read_bytes() == before
        assert not list(world.data.glob("*.reset-*"))
        with Journal.open(world.data, boot_id="b2") as kept:
            assert kept.journal_id == journal_id


async def test_HST_SIGN_36_reset_on_a_node_never_joined_just_joins(tmp_path: Path) -> None:
    async with serving(tmp_path) as world:
        identity = await world.join(world.config(helper=False), reset=True)
        assert ident.load(world.data).node_id == identity.node_id
        assert not list(world.data.glob("*.reset-*"))


async def test_HST_SIGN_36_two_resets_keep_every_old_identity(tmp_path: Path) -> None:
    async with serving(tmp_path) as world:
        config = world.config(helper=False)
        ids = [(await world.join(config)).node_id]
        for _ in range(2):
            ids.append((await world.join(config, reset=True)).node_id)
        asides = world.aside("identity.json")
        assert len(asides) == 2 and len(set(ids)) == 3
        assert {json.loads(p.read_bytes())["node_id"] for p in asides} == set(ids[:2])


@as_root
def test_root_hands_over_only_its_own_plain_file(tmp_path: Path) -> None:
    """What root chowns to the node after a join must still be the regular file root wrote, with one
    link: a FIFO, another account's file or a hard link swapped into the node's data_dir is refused,
    and nothing is chowned (a FIFO does not hold the open)."""
    give = joinmod._give_to_the_node
    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    os.chown(data, 65534, 65534)
    fifo = data / "identity.json"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(JoinError, match="changed while it was written"):
        give(fifo)
    assert fifo.stat().st_uid == 0
    fifo.unlink()
    plain = data / "identity.json"
    plain.write_text("{}")
    os.link(plain, tmp_path / "other")
    with pytest.raises(JoinError, match="changed while it was written"):
        give(plain)
    assert plain.stat().st_uid == 0
    (tmp_path / "other").unlink()
    give(plain)
    assert (plain.stat().st_uid, plain.stat().st_gid) == (65534, 65534)


def test_identity_json_applied_generation_mark_is_optional_and_a_non_negative_integer(tmp_path: Path) -> None:
    """identity.json's `applied_generation_mark` (hostile gateway round 2): absent in a file written
    before it (0), otherwise a non-negative integer (not a bool, not a string); every other key stays
    required and an unknown one is refused by name (mutation session 26)."""
    _toml, data, before = _joined_data_dir(tmp_path)
    path = ident.identity_path(data)
    doc = json.loads(before)
    assert ident.load(data).applied_generation_mark == doc.get("applied_generation_mark", 0)

    def load_with(**changes: object) -> ident.Identity:
        d = dict(doc)
        for k, v in changes.items():
            if v is None:
                d.pop(k, None)
            else:
                d[k] = v
        path.write_text(json.dumps(d))
        return ident.load(data)

    assert load_with(applied_generation_mark=None).applied_generation_mark == 0
    assert load_with(applied_generation_mark=0).applied_generation_mark == 0
    assert load_with(applied_generation_mark=7).applied_generation_mark == 7
    for bad in (-1, True, "7", 7.0):
        with pytest.raises(
            ident.IdentityError, match="applied_generation_mark: must be a non-negative integer"
        ):
            load_with(applied_generation_mark=bad)
    with pytest.raises(ident.IdentityError, match=r"unknown keys \['extra'\]$"):
        load_with(extra=1)
    with pytest.raises(ident.IdentityError, match=r"unknown keys \['extra'\], missing keys \['address'\]$"):
        load_with(extra=1, address=None)
    with pytest.raises(ident.IdentityError, match=r"missing keys \['address'\]$"):
        load_with(address=None, applied_generation_mark=3)
