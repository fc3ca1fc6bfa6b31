"""access.apply called in process over a temporary root whose programs are scripted and recorded: the
files root renders from the spec (exact bytes, mode 0644, the order they are written in), what it removes,
when it reloads sshd and which unit, each refusal word for word, and root's intent state written before
any file (DLV-PRIV-07, DLV-ACC-05/06; docs/mutation.md). The real helper and a real sshd are in
test_signed_access.py and test_access_sshd_real.py."""

from __future__ import annotations

import os
import pwd
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from bcd_helper.ops import access as op
from bcd_helper.ops.access import AccessApply, access_apply, uid_of
from bcd_helper.ops.base import Failed, HelperContext, Refused
from bcd_helper.protocol import structure
from bcd_shared import access as acc
from bcd_shared import wire
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from intentkit import ControlPlane, Signer, access_body, intent, intent_state, unsigned
from opskit import NODE_UID, call, context, make_root, programs

NODE = "node-a"
ACTIVE = ("systemctl", "is-active", "--quiet")
HELPER = f'[helper]\nsocket = "/run/bcd/helper.sock"\nnode_uid = {NODE_UID}\n'


def ca_key(comment: str = "") -> str:
    line = Ed25519PrivateKey.generate().public_key().public_bytes(Encoding.OpenSSH, PublicFormat.OpenSSH)
    return f"{line.decode()} {comment}" if comment else line.decode()


KEY = ca_key()


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return make_root(tmp_path)


def sshd(
    active: str | None = None, reload_rc: int = 0
) -> Callable[[tuple[str, ...]], tuple[int, bytes, bytes]]:
    """systemctl as root sees it: `active` the one sshd unit running (None: none)."""

    def script(argv: tuple[str, ...]) -> tuple[int, bytes, bytes]:
        if argv[:3] == ACTIVE:
            return (0 if argv[3] == active else 3), b"", b""
        if argv[:2] == ("systemctl", "reload"):
            return reload_rc, b"", (b"Job for ssh.service failed.\n" if reload_rc else b"")
        return 0, b"", b""

    return script


def unsigned_ctx(root: Path, script: Any = None, extra: str = "unsigned_access = true\n") -> HelperContext:
    return context(root, HELPER + extra, script)


def signed_ctx(root: Path, cp: ControlPlane, script: Any = None, extra: str = "") -> HelperContext:
    cp.write_record(root, NODE, cp.bundle(1))
    return context(root, cp.config_lines() + HELPER + extra, script)


def req(intent_arg: dict[str, Any] | None) -> AccessApply:
    """The request as the server decodes it."""
    return structure({} if intent_arg is None else {"intent": intent_arg}, AccessApply)


def apply(ctx: HelperContext, intent_arg: dict[str, Any] | None) -> dict[str, Any]:
    return access_apply(call(ctx, bounded=False), req(intent_arg))


def refused(ctx: HelperContext, intent_arg: dict[str, Any] | None) -> tuple[str, str]:
    with pytest.raises(Refused) as info:
        apply(ctx, intent_arg)
    return info.value.reason, info.value.message


def files(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under the simulated /etc/ssh: host path -> (bytes, mode)."""
    out = {}
    base = root / "etc/ssh"
    for dirpath, _dirs, names in os.walk(base):
        for name in names:
            p = Path(dirpath) / name
            out["/" + str(p.relative_to(root))] = (p.read_bytes(), p.stat().st_mode & 0o7777)
    return out


def principal(account: str) -> str:
    return f"{account}@{NODE}"


# --- no command-signing roots -------------------------------------------------------------------------


def test_without_roots_access_is_refused_unless_root_opts_in(root: Path) -> None:
    ctx = unsigned_ctx(root, sshd(), extra="")
    body = access_body(NODE, 1, ca_keys=(KEY,), principals=(principal("alice"),))
    assert refused(ctx, unsigned(body)) == (
        "access-unsigned",
        "access.apply: no command-signing roots to verify the access section against: root renders sshd "
        "files only from a signed spec ([helper] unsigned_access = true allows unsigned specs, for "
        "development only)",
    )
    assert files(root) == {} and programs(ctx).runs == []


def test_unsigned_access_still_needs_the_spec(root: Path) -> None:
    ctx = unsigned_ctx(root, sshd())
    assert refused(ctx, None) == (
        "intent-required",
        "access.apply: the spec is required: root renders the files from it",
    )
    assert files(root) == {} and programs(ctx).runs == []


def test_unsigned_access_renders_the_files_in_order_with_their_modes(root: Path) -> None:
    """Without roots and with `unsigned_access`: root renders from the unsigned body, CA keys, KRL and
    principals first, the drop-in that points sshd at them last; no sshd active, so nothing reloaded."""
    ctx = unsigned_ctx(root, sshd())
    principals = (principal("bob"), principal("alice"), "alice@node-b", "nobody", principal("alice") + "x")
    body = access_body(NODE, 7, ca_keys=(ca_key("ops CA"), KEY), principals=principals, serials=(9, 7))
    got = apply(ctx, unsigned(body))
    assert got == {
        "generation": 7,
        "signed": False,
        "written": [
            acc.SSHD_CA,
            acc.SSHD_KRL,
            acc.principals_path("alice"),
            acc.principals_path("bob"),
            acc.SSHD_DROPIN,
        ],
        "removed": [],
        "accounts": ["alice", "bob"],
        "skipped_principals": 3,
        "reloaded": "",
    }
    want = acc.render(list(access_sections(body).ssh_ca_keys), list(principals), [9, 7], NODE)
    assert files(root) == {path: (data, 0o644) for path, data in want.files.items()}
    assert files(root)[acc.principals_path("alice")] == (f"alice@{NODE}\n".encode(), 0o644)
    # sshd is asked about both units, each within 30 s; neither is active, so neither is reloaded.
    assert programs(ctx).runs == [(*ACTIVE, "ssh.service"), (*ACTIVE, "sshd.service")]
    assert programs(ctx).timeouts == [30, 30]
    assert intent_state(root) == {}  # nothing signed: no intent state
    ctx.audit.close()


def access_sections(body: bytes) -> Any:
    return wire.DesiredStateBody.parse(body).full.access


def test_an_unsigned_body_that_does_not_decode_is_refused(root: Path) -> None:
    ctx = unsigned_ctx(root, sshd())
    reason, message = refused(ctx, unsigned(b"\xff\xff\xff"))
    assert reason == "bad-intent" and message.startswith("access.apply: the spec does not decode: ")
    assert files(root) == {}


# --- signed --------------------------------------------------------------------------------------------


def test_DLV_PRIV_07_a_signed_spec_is_rendered_and_its_generation_kept_first(
    root: Path, cp: ControlPlane, worker: Signer
) -> None:
    ctx = signed_ctx(root, cp, sshd(active="sshd.service"))
    body = access_body(NODE, 3, ca_keys=(KEY,), principals=(principal("carol"),))
    got = apply(ctx, intent(worker, body))
    assert (got["generation"], got["signed"], got["accounts"], got["reloaded"]) == (
        3,
        True,
        ["carol"],
        "sshd.service",
    )
    assert intent_state(root)["generation"] == 3
    assert files(root)[acc.principals_path("carol")] == (f"carol@{NODE}\n".encode(), 0o644)
    # ssh.service is not active, sshd.service is: that one is reloaded, within 60 s.
    assert programs(ctx).runs == [
        (*ACTIVE, "ssh.service"),
        (*ACTIVE, "sshd.service"),
        ("systemctl", "reload", "sshd.service"),
    ]
    assert programs(ctx).timeouts == [30, 30, 60]
    # Another node's spec and an older generation are refused before anything is written.
    before = files(root)
    other = access_body("node-b", 4, ca_keys=(KEY,), principals=("dave@node-b",))
    assert refused(ctx, intent(worker, other))[0] == "wrong-node"
    assert refused(ctx, intent(worker, access_body(NODE, 2, ca_keys=(KEY,))))[0] == "stale-generation"
    assert refused(ctx, unsigned(body))[0] == "bad-intent"
    assert files(root) == before and intent_state(root)["generation"] == 3
    ctx.audit.close()


def test_a_spec_whose_access_section_breaks_a_rule_is_refused_whole(
    root: Path, cp: ControlPlane, worker: Signer
) -> None:
    ctx = signed_ctx(root, cp, sshd(active="ssh.service"))
    body = access_body(NODE, 2, ca_keys=(KEY,), principals=(principal("alice"), "bad principal"))
    assert refused(ctx, intent(worker, body)) == (
        "invalid-access",
        "access.apply: generation 2: access.principals[1]: a principal is 1-256 characters without "
        "whitespace",
    )
    assert files(root) == {} and programs(ctx).runs == []
    ctx.audit.close()


def patch_body(generation: int, section: wire.AccessSection | None) -> bytes:
    return bytes(
        wire.DesiredStateBody(
            node_id=NODE,
            generation=generation,
            spec_hash=f"p{generation}",
            patch=wire.NodeSpecPatch(access=section),
            base_generation=generation - 1,
        )
    )


def test_a_patch_must_set_the_access_section(root: Path, cp: ControlPlane, worker: Signer) -> None:
    ctx = signed_ctx(root, cp, sshd())
    assert refused(ctx, intent(worker, patch_body(4, None))) == (
        "bad-intent",
        "access.apply: the spec (generation 4) sets no access section",
    )
    assert files(root) == {}
    section = wire.AccessSection(ssh_ca_keys=[KEY], principals=[principal("erin")])
    got = apply(ctx, intent(worker, patch_body(5, section)))
    assert got["accounts"] == ["erin"] and got["generation"] == 5
    assert files(root)[acc.principals_path("erin")] == (f"erin@{NODE}\n".encode(), 0o644)
    ctx.audit.close()


def test_DLV_ACC_05_06_reload_on_dropin_change_only_and_empty_section_removes_all(
    root: Path, cp: ControlPlane, worker: Signer
) -> None:
    ctx = signed_ctx(root, cp, sshd(active="ssh.service"))
    first = access_body(NODE, 2, ca_keys=(KEY,), principals=(principal("alice"),))
    assert apply(ctx, intent(worker, first))["reloaded"] == "ssh.service"
    # A new principal and serial: the drop-in is the same, so sshd is not even asked.
    programs(ctx).runs.clear()
    second = access_body(NODE, 3, ca_keys=(KEY,), principals=(principal("bob"),), serials=(4,))
    got = apply(ctx, intent(worker, second))
    assert (got["written"], got["removed"], got["reloaded"]) == (
        [acc.SSHD_KRL, acc.principals_path("bob")],
        [acc.principals_path("alice")],
        "",
    )
    assert programs(ctx).runs == []
    # A file in the principals directory that is not an account name is not bcd's: it stays.
    stray = root / "etc/ssh/bcd/principals/Not.An.Account"
    stray.write_bytes(b"x\n")
    # An empty (absent) section removes the drop-in first, then the rest, and reloads.
    got = apply(ctx, intent(worker, access_body(NODE, 4, empty=True)))
    assert got == {
        "generation": 4,
        "signed": True,
        "written": [],
        "removed": [acc.SSHD_DROPIN, acc.principals_path("bob"), acc.SSHD_KRL, acc.SSHD_CA],
        "accounts": [],
        "skipped_principals": 0,
        "reloaded": "ssh.service",
    }
    assert files(root) == {"/etc/ssh/bcd/principals/Not.An.Account": (b"x\n", 0o644)}
    # The same again: nothing to do, nothing run.
    programs(ctx).runs.clear()
    got = apply(ctx, intent(worker, access_body(NODE, 4, empty=True)))
    assert (got["written"], got["removed"], got["reloaded"]) == ([], [], "")
    assert programs(ctx).runs == []
    ctx.audit.close()


def test_a_failed_reload_takes_the_dropin_away_so_the_next_request_reloads(
    root: Path, cp: ControlPlane, worker: Signer
) -> None:
    ctx = signed_ctx(root, cp, sshd(active="ssh.service", reload_rc=1))
    body = access_body(NODE, 2, ca_keys=(KEY,), principals=(principal("alice"),))
    with pytest.raises(Failed) as info:
        apply(ctx, intent(worker, body))
    assert (info.value.reason, info.value.message) == (
        "sshd-reload",
        "access.apply: systemctl reload ssh.service: systemctl exited 1: Job for ssh.service failed.",
    )
    assert acc.SSHD_DROPIN not in files(root)
    assert files(root)[acc.SSHD_CA] == ((KEY + "\n").encode(), 0o644)
    # sshd reloads fine now: the same spec writes the drop-in again and reloads.
    ctx.system.script = sshd(active="ssh.service")  # type: ignore[attr-defined]
    got = apply(ctx, intent(worker, body))
    assert (got["written"], got["reloaded"]) == ([acc.SSHD_DROPIN], "ssh.service")
    assert files(root)[acc.SSHD_DROPIN] == (acc.DROPIN_TEXT.encode(), 0o644)
    ctx.audit.close()


def test_a_failed_reload_of_an_empty_section_leaves_the_removals(
    root: Path, cp: ControlPlane, worker: Signer
) -> None:
    ctx = signed_ctx(root, cp, sshd(active="ssh.service"))
    apply(ctx, intent(worker, access_body(NODE, 2, ca_keys=(KEY,), principals=(principal("alice"),))))
    ctx.system.script = sshd(active="ssh.service", reload_rc=1)  # type: ignore[attr-defined]
    with pytest.raises(Failed):
        apply(ctx, intent(worker, access_body(NODE, 3, empty=True)))
    assert files(root) == {}
    ctx.audit.close()


# --- accounts of uid 0 ---------------------------------------------------------------------------------

PASSWD = (
    "root:x:0:0:root:/root:/bin/sh\n"
    "short:x\n"
    "toor:x:0:0::/root:/bin/sh\n"
    "odd:x:zero:0::/:/bin/sh\n"
    "three:x:0\n"
    "alice:x:1001:100:Alice \xe9:/home/alice:/bin/sh\n"
)


def test_an_account_of_uid_0_gets_no_principals_file_unless_root_says_so(
    root: Path, cp: ControlPlane, worker: Signer
) -> None:
    (root / "etc").mkdir()
    (root / "etc/passwd").write_bytes(PASSWD.encode("latin-1"))
    ctx = signed_ctx(root, cp, sshd())
    body = access_body(NODE, 2, ca_keys=(KEY,), principals=(principal("alice"), principal("toor")))
    assert refused(ctx, intent(worker, body)) == (
        "root-principal",
        "access.apply: account 'toor' has uid 0: no principals file for it unless root's config sets "
        "[helper] root_principals = true",
    )
    assert files(root) == {}
    # Accounts root does not know, or whose uid is not a number, are not uid 0.
    body = access_body(
        NODE, 2, ca_keys=(KEY,), principals=(principal("odd"), principal("short"), principal("x"))
    )
    assert apply(ctx, intent(worker, body))["accounts"] == ["odd", "short", "x"]
    ctx.audit.close()
    ctx = context(root, cp.config_lines() + HELPER + "root_principals = true\n", sshd())
    body = access_body(NODE, 3, ca_keys=(KEY,), principals=(principal("toor"),))
    assert apply(ctx, intent(worker, body))["accounts"] == ["toor"]
    assert files(root)[acc.principals_path("toor")] == (f"toor@{NODE}\n".encode(), 0o644)
    ctx.audit.close()


def test_uid_of_reads_the_simulated_passwd(root: Path) -> None:
    assert uid_of(root, "alice") is None  # no /etc/passwd at all
    (root / "etc").mkdir()
    # A comment field in Latin-1 (not UTF-8) does not stop the reading.
    (root / "etc/passwd").write_bytes(PASSWD.encode("latin-1"))
    assert [uid_of(root, a) for a in ("root", "toor", "alice", "odd", "short", "three", "bob")] == [
        0,
        0,
        1001,
        None,
        None,
        0,
        None,
    ]
    # A passwd past 4 MiB is not read (root-only refusal): no account is known.
    big = PASSWD.encode("latin-1") + b"#" * (op.MAX_FILE + 1 - len(PASSWD))
    (root / "etc/passwd").write_bytes(big)
    assert uid_of(root, "root") is None
    (root / "etc/passwd").write_bytes(big[:-1])
    assert uid_of(root, "root") == 0
    (root / "etc/passwd").unlink()
    (root / "etc/passwd").symlink_to("/etc/passwd")  # never followed: as if there were none
    assert uid_of(root, "root") is None


def test_uid_of_on_the_real_host_asks_the_passwd_database(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the real host root asks NSS (an LDAP or sssd account is in no /etc/passwd)."""
    assert uid_of(Path("/"), "root") == 0
    assert uid_of(Path("/"), "no-such-account-bcd") is None
    real = pwd.getpwnam

    def nss(name: str) -> pwd.struct_passwd:
        if name == "ldap-admin":
            return pwd.struct_passwd(("ldap-admin", "x", 0, 0, "", "/", "/bin/sh"))
        return real(name)

    monkeypatch.setattr(op.pwd, "getpwnam", nss)
    assert uid_of(Path("/"), "ldap-admin") == 0


# --- root-only paths -----------------------------------------------------------------------------------


def test_a_principals_directory_that_is_a_symlink_is_refused(
    root: Path, cp: ControlPlane, worker: Signer
) -> None:
    (root / "etc/ssh/bcd").mkdir(parents=True)
    (root / "etc/ssh/bcd/principals").symlink_to("/etc")
    ctx = signed_ctx(root, cp, sshd())
    reason, message = refused(ctx, intent(worker, access_body(NODE, 2, ca_keys=(KEY,))))
    assert reason == "root-only" and "/etc/ssh/bcd/principals" in message
    assert programs(ctx).runs == []
    ctx.audit.close()


def test_a_managed_file_that_is_a_symlink_is_refused(root: Path, cp: ControlPlane, worker: Signer) -> None:
    (root / "etc/ssh/sshd_config.d").mkdir(parents=True)
    (root / "etc/ssh/sshd_config.d/90-bcd.conf").symlink_to("/etc/shadow")
    ctx = signed_ctx(root, cp, sshd())
    reason, message = refused(ctx, intent(worker, access_body(NODE, 2, ca_keys=(KEY,))))
    assert reason == "root-only" and acc.SSHD_DROPIN in message
    assert (root / "etc/ssh/sshd_config.d/90-bcd.conf").is_symlink()
    ctx.audit.close()


def test_a_managed_file_past_4_mib_is_refused(root: Path, cp: ControlPlane, worker: Signer) -> None:
    (root / "etc/ssh/bcd").mkdir(parents=True)
    (root / "etc/ssh/bcd/user_ca.pub").write_bytes(b"#" * (op.MAX_FILE + 1))
    ctx = signed_ctx(root, cp, sshd())
    assert refused(ctx, intent(worker, access_body(NODE, 2, ca_keys=(KEY,)))) == (
        "root-only",
        f"{acc.SSHD_CA} is larger than {op.MAX_FILE} bytes",
    )
    (root / "etc/ssh/bcd/user_ca.pub").write_bytes(b"#" * op.MAX_FILE)
    assert apply(ctx, intent(worker, access_body(NODE, 2, ca_keys=(KEY,))))["written"][0] == acc.SSHD_CA
    ctx.audit.close()


def test_an_empty_section_on_a_fresh_host_makes_no_directory(
    root: Path, cp: ControlPlane, worker: Signer
) -> None:
    ctx = signed_ctx(root, cp, sshd())
    got = apply(ctx, intent(worker, access_body(NODE, 2, empty=True)))
    assert (got["written"], got["removed"]) == ([], [])
    assert not (root / "etc/ssh").exists()
    ctx.audit.close()


def test_a_directory_swapped_for_a_symlink_before_the_write_is_refused(
    root: Path, cp: ControlPlane, worker: Signer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another root process makes the principals directory a symlink between root's reading and its
    writing: the write is refused by the root-only rule and named."""
    real = op.write_root_only

    def racing(where: Path, path: str, data: bytes, mode: int = 0o644) -> None:
        if path == acc.principals_path("alice"):
            (root / "etc/ssh/bcd/principals").symlink_to("/etc")
        real(where, path, data, mode)

    monkeypatch.setattr(op, "write_root_only", racing)
    ctx = signed_ctx(root, cp, sshd())
    body = access_body(NODE, 2, ca_keys=(KEY,), principals=(principal("alice"),))
    reason, message = refused(ctx, intent(worker, body))
    assert reason == "root-only" and "/etc/ssh/bcd/principals" in message
    assert acc.SSHD_DROPIN not in files(root)
    ctx.audit.close()
