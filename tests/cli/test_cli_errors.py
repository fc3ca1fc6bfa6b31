"""Every subcommand refuses bad input with one line on stderr and a documented exit code, never a traceback.

The table runs `bcd` in this process (bcd_agent.cli.main; `bcd helper ...` goes through the helper's own
CLI the same way `bcd-helper` does), so an exception that escapes fails the test with its traceback. A
few cases run as real processes: `bcd node` before `bcd join` (what systemd sees), a stdout its reader
closed (`bcd doctor --json | head`), and an unreadable data_dir (root without CAP_DAC_OVERRIDE).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from bcd_agent import cli
from bcd_agent import config as agent_config
from bcd_shared.subcommands import (
    EX_CHANGES,
    EX_CONFIG,
    EX_DATAERR,
    EX_NOINPUT,
    EX_NOPERM,
    EX_PIPE,
    EX_USAGE,
)
from clisupport import EXAMPLES, sim_root
from testsupport import REPO, require_tool

Setup = Callable[[Path], list[str]]


def _main(argv: list[str]) -> int:
    try:
        return cli.main(argv)
    except SystemExit as exc:  # argparse's --help / usage errors
        return int(exc.code or 0)


def _config(tmp: Path, text: str) -> str:
    path = tmp / "config.toml"
    path.write_text(text)
    return str(path)


def _joinless(tmp: Path) -> str:
    data = tmp / "data"
    data.mkdir(mode=0o700)
    return _config(tmp, f'data_dir = "{data}"\n')


def _file_data_dir(tmp: Path) -> str:
    (tmp / "data").write_text("not a directory")
    return _config(tmp, f'data_dir = "{tmp / "data"}"\n')


def _audit_dir(tmp: Path) -> str:
    (tmp / "var/log/bcd-helper").mkdir(parents=True)
    return str(tmp)


# (id, argv built from a scratch dir, exit code, a piece of the one line, as non-root)
CASES: list[tuple[str, Setup, int, str, bool]] = [
    ("unknown command", lambda t: ["frobnicate"], EX_USAGE, "invalid choice", False),
    ("bench unknown bench", lambda t: ["bench", "nope"], EX_USAGE, "invalid choice", False),
    ("bench journal --data-dir missing", lambda t: ["bench", "journal", "--data-dir", str(t / "none/x")],
     EX_USAGE, "none/x does not exist", False),
    ("node missing config", lambda t: ["node", "--config", str(t / "none.toml")], EX_CONFIG, "no such file",
     False),
    ("node before join", lambda t: ["node", "--config", _joinless(t)], EX_CONFIG, "run `bcd join", False),
    ("node data_dir is a file", lambda t: ["node", "--config", _file_data_dir(t)], EX_CONFIG,
     "is not a directory", False),
    ("node config refused", lambda t: ["node", "--config", _config(t, "log_level = 'debug'\n")], EX_CONFIG,
     "log_level", False),
    ("node negative delay", lambda t: ["node", "--test-effect-delay", "-1"], EX_USAGE, "negative", False),
    ("join without address", lambda t: ["join", "--token", "x"], EX_USAGE, "--address", False),
    # A token may begin with '-' (URL-safe base64): argparse takes it for an option; the line says how.
    ("join token beginning with -", lambda t: ["join", "--token", "-Ab3", "--address", "cp.example:443"],
     EX_USAGE, "--token: expected one argument; a value that begins with '-' is given as --token=VALUE",
     False),
    ("join address without a port", lambda t: ["join", "--token", "x", "--address", "nohost"], EX_USAGE,
     "expected HOST:PORT or unix:/PATH, got 'nohost'", False),
    ("join address port out of range", lambda t: ["join", "--token", "x", "--address", "cp.example:70000"],
     EX_USAGE, "outside 1-65535", False),
    ("join --ca-file missing", lambda t: ["join", "--config", _joinless(t), "--token", "x", "--address",
     "unix:/nope", "--ca-file", str(t / "ca.pem")], EX_NOINPUT, "ca.pem (from --ca-file) cannot be read",
     False),
    ("join --ca-file not PEM", lambda t: ["join", "--config", _joinless(t), "--token", "x", "--address",
     "unix:/nope", "--ca-file", _config(t, "")], EX_DATAERR, "holds no PEM certificate", False),
    ("join --reset without --yes", lambda t: ["join", "--config", _joinless(t), "--token", "x", "--address",
     "unix:/nope", "--reset"], EX_USAGE, "bcd join: --reset joins this node again", False),
    ("join missing config", lambda t: ["join", "--config", str(t / "none.toml"), "--token", "x",
     "--address", "unix:/nope"], EX_CONFIG, "no such file", False),
    ("join --yes alone", lambda t: ["join", "--config", _joinless(t), "--token", "x", "--address",
     "unix:/nope", "--yes"], EX_USAGE, "--reset", False),
    # A usage error is named before the config is read: 64, not the missing file's 78 (operations.md).
    ("join --yes alone without a config", lambda t: ["join", "--config", str(t / "none.toml"), "--token",
     "x", "--address", "unix:/nope", "--yes"], EX_USAGE, "--yes confirms --reset", False),
    ("devplane negative timeout", lambda t: ["devplane", "command", "k", "--dir", str(t), "--timeout", "-5"],
     EX_USAGE, "positive", False),
    ("devplane negative not-after", lambda t: ["devplane", "command", "k", "--dir", str(t), "--not-after",
     "-1"], EX_USAGE, "positive", False),
    ("devplane apply of a spec that is not JSON", lambda t: ["devplane", "apply", "--dir", str(t),
     _config(t, "x")], EX_DATAERR, "config.toml: is not JSON", False),
    ("devplane apply of a spec with an unknown field", lambda t: ["devplane", "apply", "--dir", str(t),
     _config(t, '{"devices": {"assignmentz": []}}')], EX_DATAERR,
     "config.toml: devices.assignmentz: unknown field of DevicesSection", False),
    ("devplane apply of a missing spec", lambda t: ["devplane", "apply", "--dir", str(t), str(t / "no.json")],
     EX_DATAERR, "no.json: cannot be read", False),
    ("devplane command with a payload that is not JSON", lambda t: ["devplane", "command", "k", "--dir",
     str(t), "--payload", "{bad"], EX_USAGE, "--payload: not JSON", False),
    ("devplane show with no devplane running", lambda t: ["devplane", "show", "--dir", str(t)], 1,
     "admin.sock: No such file or directory (is `bcd devplane serve", False),
    ("doctor unknown flag", lambda t: ["doctor", "--fix-everything"], EX_USAGE, "--fix-everything", False),
    ("plan missing spec", lambda t: ["plan", "--spec", str(t / "none.json"), "--root", str(t)], EX_DATAERR,
     "cannot be read", False),
    ("plan negative generation", lambda t: ["plan", "--spec", "x", "--generation", "-3"], EX_USAGE,
     "negative", False),
    ("plan zero generation", lambda t: ["plan", "--spec", "x", "--generation", "0"], EX_USAGE, "at least 1",
     False),
    ("status negative interval", lambda t: ["status", "--interval", "-1"], EX_USAGE, "positive", False),
    ("status zero interval", lambda t: ["status", "--interval", "0"], EX_USAGE, "positive", False),
    ("status config refused", lambda t: ["status", "--config", _config(t, "[nope]\n")], EX_CONFIG,
     "unknown table", False),
    ("status --check bad bound", lambda t: ["status", "--check", "--max-stale", "-2"], EX_USAGE, "negative",
     False),
    # A --config that names no file: before, status, journal and plan read the defaults silently.
    ("status --config missing", lambda t: ["status", "--config", str(t / "typo.toml")], EX_CONFIG,
     "typo.toml: no such file", False),
    ("journal --config missing", lambda t: ["journal", "--config", str(t / "typo.toml")], EX_CONFIG,
     "typo.toml: no such file", False),
    ("plan --config missing", lambda t: ["plan", "--spec", str(EXAMPLES / "gpu-node.json"), "--config",
     str(t / "typo.toml")], EX_CONFIG, "typo.toml: no such file", False),
    # Flags the chosen mode would have ignored silently (before: --watch --json printed text).
    ("status --watch --json", lambda t: ["status", "--watch", "--json"], EX_USAGE,
     "--watch and --json do not go together", False),
    ("status --check --json", lambda t: ["status", "--check", "--json"], EX_USAGE,
     "--check and --json do not go together", False),
    ("status --max-stale without --check", lambda t: ["status", "--max-stale", "5"], EX_USAGE,
     "--max-stale applies to --check only", False),
    ("status --interval without --watch", lambda t: ["status", "--interval", "5"], EX_USAGE,
     "--interval applies to --watch only", False),
    ("journal negative limit", lambda t: ["journal", "--limit", "-1"], EX_USAGE, "negative", False),
    ("journal not a number", lambda t: ["journal", "--limit", "ten"], EX_USAGE, "integer", False),
    ("journal no journal", lambda t: ["journal", "--data-dir", str(t)], EX_NOINPUT, "no journal here", False),
    ("journal config refused", lambda t: ["journal", "--config", _config(t, "data_dir = 3\n")], EX_CONFIG,
     "data_dir", False),
    ("release build of a file that is no wheel", lambda t: ["release", "build", "--out", str(t / "r"),
     _config(t, "")], EX_DATAERR, "config.toml: not a wheel (not a zip archive)", False),
    ("release confirm without a helper", lambda t: ["release", "confirm", "--socket", str(t / "h.sock")], 1,
     "h.sock)", False),
    ("release confirm asks the config's helper socket", lambda t: ["release", "confirm", "--config",
     _config(t, f'[helper]\nsocket = "{t}/cfg.sock"\n')], 1, "cfg.sock)", False),
    ("sim --timeout without --once", lambda t: ["sim", "--timeout", "5"], EX_USAGE,
     "--timeout applies to --once (or --json) only", False),
    ("sim negative timeout", lambda t: ["sim", "--timeout", "-1"], EX_USAGE, "positive", False),
    ("helper unknown command", lambda t: ["helper", "frobnicate"], EX_USAGE, "invalid choice", False),
    ("helper serve as non-root", lambda t: ["helper", "serve"], EX_NOPERM, "must run as root", True),
    ("helper serve missing config", lambda t: ["helper", "serve", "--root", str(t), "--config",
     "/etc/bcd/none.toml"], EX_CONFIG, "no such file", False),
    ("audit verify without config", lambda t: ["helper", "audit", "--root", str(t), "verify"], EX_CONFIG,
     "config.toml", False),
    ("audit verify as non-root", lambda t: ["helper", "audit", "verify"], EX_NOPERM, "must run as root",
     True),
    ("audit show as non-root", lambda t: ["helper", "audit", "show"], EX_NOPERM, "must run as root", True),
    ("audit show --since yesterday", lambda t: ["helper", "audit", "show", "--since", "yesterday"], EX_USAGE,
     "RFC 3339", False),
    ("audit verify --root after the subcommand, no log",
     lambda t: ["helper", "audit", "verify", "--root", str(t), "--dir", "/var/log/none"], EX_NOINPUT,
     "no audit log here", False),
    ("audit without a subcommand", lambda t: ["helper", "audit"], EX_USAGE, "required", False),
    ("audit init under /tmp", lambda t: ["helper", "audit", "--root", str(t), "--dir", "/tmp/audit", "init"],
     EX_NOPERM, "will not write as root", False),
    ("audit --dir relative", lambda t: ["helper", "audit", "--dir", "var/log", "show"], EX_USAGE,
     "not an absolute host path", False),
    # A mistyped --root: before, read as an empty host (nvidia-smi exited 9, "no such file" without DIR).
    ("status --root missing", lambda t: ["status", "--root", str(t / "nope")], EX_USAGE,
     "nope does not exist", False),
    ("plan --root missing", lambda t: ["plan", "--spec", "x", "--root", str(t / "nope")], EX_USAGE,
     "nope does not exist", False),
    ("doctor --root a file", lambda t: ["doctor", "--root", _config(t, "")], EX_USAGE, "is not a directory",
     False),
    ("node --root missing", lambda t: ["node", "--root", str(t / "nope")], EX_USAGE, "does not exist", False),
    ("join --root missing", lambda t: ["join", "--token", "x", "--address", "unix:/nope", "--root",
     str(t / "nope")], EX_USAGE, "does not exist", False),
    ("helper serve --root missing", lambda t: ["helper", "serve", "--root", str(t / "nope")], EX_USAGE,
     "does not exist", False),
    ("audit --root missing", lambda t: ["helper", "audit", "--root", str(t / "nope"), "show"], EX_USAGE,
     "does not exist", False),
    ("audit show --root missing", lambda t: ["helper", "audit", "show", "--root", str(t / "nope")], EX_USAGE,
     "does not exist", False),
]  # fmt: skip


@pytest.mark.parametrize(
    ("setup", "code", "words", "non_root"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_input_is_one_line_and_a_documented_code(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    setup: Setup,
    code: int,
    words: str,
    non_root: bool,
) -> None:
    monkeypatch.setenv("BCD_CONFIG", str(tmp_path / "absent.toml"))
    if non_root:
        monkeypatch.setattr(os, "geteuid", lambda: 1000)
    argv = setup(tmp_path)
    rc = _main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in err + out
    assert rc == code, (argv, err)
    assert len(err.strip().splitlines()) == 1, err
    assert words in err, err
    assert code in documented_codes()


def test_node_without_config_or_env_reads_the_default_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No --config and no $BCD_CONFIG: the default path, not a TypeError."""
    monkeypatch.delenv("BCD_CONFIG", raising=False)
    monkeypatch.setattr(agent_config, "DEFAULT_CONFIG_PATH", str(tmp_path / "etc-bcd-config.toml"))
    assert _main(["node"]) == EX_CONFIG
    err = capsys.readouterr().err
    assert (
        err == f"bcd node: {tmp_path / 'etc-bcd-config.toml'}: no such file (write one, or pass --config)\n"
    )


def test_node_with_an_emptied_identity_names_only_what_is_wrong(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An identity.json that lost its keys: before, "unknown keys [], missing keys [...]"."""
    config = _joinless(tmp_path)
    (tmp_path / "data/identity.json").write_text("{}")
    assert _main(["node", "--config", config]) == EX_CONFIG
    err = capsys.readouterr().err
    assert "identity.json: missing keys ['address', " in err and "unknown keys" not in err, err
    assert len(err.splitlines()) == 1


def test_audit_verify_root_after_the_subcommand_is_used(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`audit verify --root DIR` and `audit --root DIR verify` read the same log, sealed at set-up."""
    root = _audit_dir(tmp_path)
    assert _main(["helper", "audit", "init", "--root", root, "--dir", "/var/log/bcd-helper"]) == 0
    key = capsys.readouterr().out.strip().rsplit(" ", 1)[-1]
    elsewhere = tmp_path / "elsewhere"  # a --root with no log: the one after the subcommand wins
    elsewhere.mkdir()
    outs = []
    for argv in (
        ["helper", "audit", "verify", "--root", root, "--dir", "/var/log/bcd-helper", "--key", key],
        ["helper", "audit", "--root", root, "--dir", "/var/log/bcd-helper", "verify", "--key", key],
        [
            "helper",
            "audit",
            "--root",
            str(elsewhere),
            "verify",
            "--root",
            root,
            "--dir",
            "/var/log/bcd-helper",
            "--key",
            key,
        ],
    ):
        code = _main(argv)
        out, err = capsys.readouterr()
        outs.append((code, out, err))
    assert len({o for o in outs}) == 1, outs  # the same answer, wherever --root stands
    assert "no audit log" not in outs[0][2] and "elsewhere" not in outs[0][2], outs[0]


def test_plan_exit_code_says_whether_it_would_change_anything(tmp_path: Path) -> None:
    """0: nothing to do; 2: steps or failures planned (terraform plan -detailed-exitcode)."""
    root = sim_root(tmp_path)
    empty = tmp_path / "empty.json"
    empty.write_text("{}")
    base = ["--root", str(root), "--data-dir", str(tmp_path / "data"), "--json"]
    assert _main(["plan", "--spec", str(empty), *base]) == 0
    assert _main(["plan", "--spec", str(EXAMPLES / "gpu-node.json"), *base]) == EX_CHANGES
    assert _main(["plan", "--spec", str(EXAMPLES / "assignment-fails.json"), *base]) == EX_CHANGES


def _bcd_process(*args: str, env: dict[str, str] | None = None, prefix: tuple[str, ...] = ()) -> list[str]:
    return [*prefix, sys.executable, "-m", "bcd_agent.cli", *args]


def test_node_before_join_exits_78_with_one_line(tmp_path: Path) -> None:
    """What systemd sees: EX_CONFIG, which the unit's RestartPreventExitStatus=78 does not restart."""
    res = subprocess.run(
        _bcd_process("node", "--config", _joinless(tmp_path)),
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert res.returncode == EX_CONFIG
    assert res.stderr == (
        f"bcd node: not joined: {tmp_path / 'data/identity.json'} does not exist: "
        "run `bcd join --token TOKEN --address HOST:PORT` first\n"
    )


@pytest.mark.parametrize("command", ["doctor", "journal"])
def test_a_closed_stdout_ends_quietly(tmp_path: Path, command: str) -> None:
    """`bcd doctor --json | head -c0`: the reader is gone before the output is written."""
    argv = ["doctor", "--config", str(tmp_path / "none.toml"), "--root", str(tmp_path), "--json"]
    if command == "journal":
        from bcd_agent.journal import Journal

        Journal.open(tmp_path / "data", boot_id="b").close()
        argv = ["journal", "--data-dir", str(tmp_path / "data"), "--json"]
    read, write = os.pipe()
    os.close(read)  # nobody will ever read: the first write fails with EPIPE
    try:
        res = subprocess.run(
            _bcd_process(*argv), stdout=write, stderr=subprocess.PIPE, text=True, timeout=60, check=False
        )
    finally:
        os.close(write)
    assert res.stderr == ""
    assert res.returncode == EX_PIPE


def test_journal_on_an_unreadable_data_dir(tmp_path: Path) -> None:
    """Root without CAP_DAC_OVERRIDE/CAP_DAC_READ_SEARCH stands for an operator outside the node's group."""
    if os.geteuid() != 0:
        pytest.skip("needs root to chown the directory away")
    setpriv = require_tool("setpriv")
    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    os.chown(data, 54321, 54321)
    os.chmod(tmp_path, 0o755)
    res = subprocess.run(
        _bcd_process("journal", "--data-dir", str(data),
                     prefix=(setpriv, "--bounding-set=-dac_override,-dac_read_search")),
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert res.returncode == EX_NOPERM, res.stderr
    assert res.stderr == f"bcd journal: {data / 'journal.db'}: Permission denied\n"


def documented_codes() -> set[int]:
    """The exit codes docs/operations.md's table lists."""
    text = (REPO / "docs/operations.md").read_text()
    section = text.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    return {int(m) for m in re.findall(r"^\| (\d+) \|", section, re.MULTILINE)}


def test_reference_reads_are_guarded() -> None:
    """A test reading ../shared/reference passes the path through require_shared (or skips itself), so
    a clone without ../shared skips with one line instead of failing with FileNotFoundError."""
    bad = []
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if node.func.attr not in ("read_text", "read_bytes", "open"):
                continue
            names = {n.id for n in ast.walk(node.func.value) if isinstance(n, ast.Name)}
            if names & {"REFERENCE", "SHARED"}:
                bad.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert bad == []


@pytest.mark.skipif(os.geteuid() != 0, reason="runs bcd node as another account (uid 65534)")
def test_node_as_the_wrong_account_names_the_data_dirs_owner_and_its_own_uid() -> None:
    """`bcd node` started by hand as an account that cannot use data_dir (root's 0700 directory): one line
    naming the owner, this uid and how the unit runs it; exit 77. Before: "<data_dir>/identity.json:
    Permission denied", naming neither account."""
    import shutil
    import tempfile

    require_tool("setpriv")
    top = Path(tempfile.mkdtemp(prefix="bcd-wrong-account-"))
    try:
        top.chmod(0o755)  # the config readable by uid 65534; data_dir root's own
        data = top / "data"
        data.mkdir(mode=0o700)
        (top / "config.toml").write_text(f'data_dir = "{data}"\n')
        (top / "config.toml").chmod(0o644)
        argv = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]
        probe = [*argv, sys.executable, "-c", "import bcd_agent.cli"]
        if subprocess.run(probe, capture_output=True, timeout=60, cwd="/").returncode != 0:
            # A clone under a 0700 directory (root's home, mktemp -d): the account cannot import bcd at all;
            # test_preflight_as_the_wrong_account_in_a_forked_child below checks the same message there.
            pytest.skip("uid 65534 cannot import bcd_agent from this checkout")
        res = subprocess.run(
            [*argv, sys.executable, "-m", "bcd_agent.cli", "node", "--config", str(top / "config.toml")],
            capture_output=True,
            text=True,
            timeout=60,
            cwd="/",
        )
    finally:
        shutil.rmtree(top)
    assert res.returncode == EX_NOPERM, res.stderr
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr
    assert f"data_dir {data} (from {top}/config.toml) is owned by uid 0 (mode 0700)" in res.stderr
    assert "this process (uid 65534) cannot use it" in res.stderr and "systemctl start bcd-node" in res.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="drops to another account (uid 65534)")
def test_preflight_as_the_wrong_account_in_a_forked_child() -> None:
    """The same refusal as above wherever the checkout lies: the node's preflight run in a forked child that
    drops to uid 65534 (every module imported before the fork), on root's 0700 data_dir: EX_NOPERM and
    the message naming the owner, the mode, this uid and the unit."""
    import shutil
    import tempfile

    from bcd_agent.config import load_config
    from bcd_agent.session import identity  # noqa: F401 (imported by _preflight: before the fork)

    top = Path(tempfile.mkdtemp(prefix="bcd-wrong-account-"))  # under /tmp: the account can walk to it
    top.chmod(0o755)
    data = top / "data"
    data.mkdir(mode=0o700)
    cfg = top / "config.toml"
    cfg.write_text(f'data_dir = "{data}"\n')
    try:
        config = load_config(cfg)
        out, status = _preflight_as(65534, config)
    finally:
        shutil.rmtree(top)
    assert status == 0
    code, message = out.split("\n", 1)
    assert int(code) == EX_NOPERM, message
    assert message == (
        f"data_dir {data} (from {cfg}) is owned by uid 0 (mode 0700) and this process (uid 65534) cannot "
        "use it: run bcd node as the data_dir's owner (on a host: systemctl start bcd-node, which runs it as "
        "the bcd account)"
    )


def _preflight_as(uid: int, config: agent_config.Config) -> tuple[str, int]:
    """The node's preflight in a forked child of `uid`: '<exit code>\\n<message>', and the child's status."""
    from bcd_agent.node import _preflight
    from bcd_shared.subcommands import CliError

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            try:
                _preflight(config)
                os.write(write, b"0\npassed")
            except CliError as exc:
                os.write(write, f"{exc.code}\n{exc}".encode())
            except BaseException as exc:  # shown by the parent's assertion
                os.write(write, f"-1\n{exc!r}".encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        out = f.read().decode()
    return out, os.waitpid(pid, 0)[1]


def test_bcd_helper_without_the_helper_names_the_packaged_program(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bcd-node package's venv has no bcd_helper: `bcd helper audit show` there is one line naming
    `bcd-helper audit show` (the bcd-helper package's program) and 64, not a bare 2."""
    monkeypatch.setitem(sys.modules, "bcd_helper.cli", None)  # import fails as in the node's venv
    rc = _main(["helper", "audit", "show", "--dir", "/x"])
    err = capsys.readouterr().err
    assert rc == EX_USAGE
    assert err == (
        "bcd: `bcd helper` needs bcd-helper in this Python environment; on a host installed from the "
        "packages, run `bcd-helper audit show ...`\n"
    )
