"""The units' shared modules at their edges, written against mutation testing's survivors (docs/mutation.md,
"shared units: k8s, _base, bootargs, distro, nvsmi, rootonly"): the root-only wrapper, the nvidia-smi
parsers, boot loader arguments, distribution families, the shared steps and decoders, and the one-unit
runner's corners. In-process and quick; the units' whole runs on the simulated host are in
test_units_simhost.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from bcd_shared.errors import RetryableError
from bcd_shared.system import CommandResult, LocalSystem
from bcd_shared.units import (
    ApplyContext,
    ConfigUnit,
    Issue,
    Plan,
    RootOnlySystem,
    UnitCondition,
    UnitContext,
    UnitResult,
    bootargs,
    clean,
    converge_unit,
    distro,
    for_root,
    nvsmi,
    rootonly,
)

# -- rootonly


def test_for_root_wraps_only_as_root_and_never_twice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    system = LocalSystem(tmp_path)

    class Marked(LocalSystem):
        root_only = True  # already follows the rule (the helper's per-call System)

    marked = Marked(tmp_path)
    wrapped = RootOnlySystem(system)
    monkeypatch.setattr(rootonly.os, "geteuid", lambda: 0)
    assert rootonly.acting_as_root()
    assert isinstance(for_root(system), RootOnlySystem) and for_root(system).inner is system  # type: ignore[attr-defined]
    assert for_root(marked) is marked and for_root(wrapped) is wrapped
    for uid in (1, 1000):
        monkeypatch.setattr(rootonly.os, "geteuid", lambda uid=uid: uid)
        assert not rootonly.acting_as_root()
        assert for_root(system) is system and for_root(marked) is marked and for_root(wrapped) is wrapped


# -- _unit and units/__init__: the one-unit runner's corners


class _Step:
    def __init__(self, name: str, fail: Exception | None = None) -> None:
        self.name, self.fail = name, fail

    def describe(self) -> str:
        return f"step {self.name}"

    def apply(self, system: Any, actx: Any) -> None:
        system.append(self.name)
        if self.fail is not None:
            raise self.fail


def test_HST_LVL_a_failed_step_whose_replan_fails_keeps_the_plans_conditions() -> None:
    """After a step failed and changed the host, the conditions come from planning again; when that
    observation itself fails, from the plan that was being applied (never lost, never None)."""
    cond = (UnitCondition("FabricManagerDown", "NotRunning", "m"),)

    class Flaky(ConfigUnit[str, int]):
        name = "flaky"

        def __init__(self) -> None:
            self.observed = 0

        def decode(self, obj: dict[str, Any]) -> str:
            return "s"

        def observe(self, system: Any, settings: str | None, ctx: Any) -> int:
            self.observed += 1
            if self.observed > 1:
                raise RetryableError("Unreadable", "cannot read the host")
            return 0

        def plan(self, settings: str | None, observed: int) -> Plan:
            return Plan((_Step("ok"), _Step("bad", RetryableError("X", "step failed"))), conditions=cond)

    host: list[str] = []
    r = converge_unit(Flaky(), "s", host, UnitContext(), ApplyContext())  # type: ignore[arg-type]
    assert host == ["ok", "bad"]
    assert r == UnitResult("flaky", True, (Issue("retryable", "flaky: step failed"),), cond, ("step ok",))


def _no_programs(tmp: Path) -> LocalSystem:
    """A host tree that never runs the machine's programs (a simulated host: any program fails)."""
    return LocalSystem(tmp, tools={"false": lambda system, argv, stdin: CommandResult(tuple(argv), 1)})


def test_clean_hands_the_context_to_the_unit(tmp_path: Path) -> None:
    """`clean` observes with the caller's UnitContext and applies with its ApplyContext: k8s-join's
    observation carries root's allowlist, and the clean-up's removal goes through the path guard."""
    system = _no_programs(tmp_path)
    assert clean("k8s-join", system, UnitContext(), ApplyContext()) == UnitResult("k8s-join")
    system.write_atomic("/etc/sysctl.d/90-bcd.conf", b"vm.swappiness = 10\n")
    guarded: list[str] = []
    r = clean("sysctl", system, UnitContext(), ApplyContext(guard=guarded.append))
    assert r.ok and guarded == ["/etc/sysctl.d/90-bcd.conf"]
    assert not system.exists("/etc/sysctl.d/90-bcd.conf")


def _refusing_guard(path: str) -> None:
    raise RetryableError("RootOnly", f"{path} refused")


def test_clean_refused_by_the_guard_removes_nothing(tmp_path: Path) -> None:
    system = _no_programs(tmp_path)
    system.write_atomic("/etc/sysctl.d/90-bcd.conf", b"vm.swappiness = 10\n")
    r = clean("sysctl", system, UnitContext(), ApplyContext(guard=_refusing_guard))
    assert r.issues == (Issue("retryable", "sysctl: /etc/sysctl.d/90-bcd.conf refused"),)
    assert system.exists("/etc/sysctl.d/90-bcd.conf")


# -- nvsmi


def _smi(tmp: Path, rc: int, out: bytes) -> tuple[LocalSystem, list[tuple[str, ...]]]:
    calls: list[tuple[str, ...]] = []

    def smi(system: Any, argv: Any, stdin: bytes | None) -> CommandResult:
        calls.append(tuple(argv))
        return CommandResult(tuple(argv), rc, out, b"")

    return LocalSystem(tmp, tools={"nvidia-smi": smi}), calls


def test_nvsmi_query_rows_past_blank_lines_and_bytes_that_are_not_utf8(tmp_path: Path) -> None:
    # --query-gpu rows as the reference CSV shows them (590.48.01), with a blank line between two GPUs,
    # a row of the wrong width and a product name byte that is not UTF-8.
    out = (
        b"0, GPU-a, Enabled, Enabled\n\n  \n"
        b"1, GPU-b\xff, Disabled, [N/A]\n2, GPU-c\n3, GPU-d, Enabled, Enabled\n"
    )
    system, calls = _smi(tmp_path, 0, out)
    assert nvsmi.query(system, nvsmi.MIG_QUERY) == [
        ["0", "GPU-a", "Enabled", "Enabled"],
        ["1", "GPU-b\ufffd", "Disabled", "[N/A]"],
        ["3", "GPU-d", "Enabled", "Enabled"],
    ]
    assert calls == [("nvidia-smi", f"--query-gpu={nvsmi.MIG_QUERY}", "--format=csv,noheader,nounits")]
    failed, _ = _smi(tmp_path, 9, out)
    assert nvsmi.query(failed, nvsmi.MIG_QUERY) is None
    assert nvsmi.number("700.00 W") == 700.0 and nvsmi.number("[N/A]") is None and nvsmi.number("") is None


# -- bootargs


def _loader(tmp: Path, fail: str = "") -> tuple[LocalSystem, list[tuple[str, ...]]]:
    calls: list[tuple[str, ...]] = []

    def tool(system: Any, argv: Any, stdin: bytes | None) -> CommandResult:
        calls.append(tuple(argv))
        rc = 1 if argv[0] == fail else 0
        return CommandResult(tuple(argv), rc, b"", b"error: boom\n" if rc else b"")

    return LocalSystem(tmp, tools={"update-grub": tool, "grubby": tool}), calls


DROPIN = "/etc/default/grub.d/90-bcd-cpu.cfg"
BOOTREC = "/var/lib/bcd-hostconfig/bootargs/cpu"
CPU_HEAD = "# Written by bcd (cpu unit): local edits are replaced on the next converge pass.\n"


def test_boot_args_through_update_grub(tmp_path: Path) -> None:
    system, calls = _loader(tmp_path)
    guarded: list[str] = []
    both = bootargs.BootloaderView(True, True)  # update-grub wins
    step = bootargs.SetBootArgs("cpu", DROPIN, BOOTREC, "isolcpus=1", "isolcpus=2-3", "isolcpus=2-3", both)
    assert step.describe() == "set kernel arguments 'isolcpus=2-3' for cpu on the boot loader"
    step.apply(system, ApplyContext(guard=guarded.append))
    assert calls == [("update-grub",)] and guarded == [DROPIN, BOOTREC, BOOTREC]
    assert system.read_text(DROPIN) == CPU_HEAD + 'GRUB_CMDLINE_LINUX="$GRUB_CMDLINE_LINUX isolcpus=2-3"\n'
    assert system.read_text(BOOTREC) == CPU_HEAD + "isolcpus=2-3\n"
    assert (tmp_path / BOOTREC[1:]).stat().st_mode & 0o777 == 0o644
    # "" removes the drop-in and the record
    bootargs.SetBootArgs("cpu", DROPIN, BOOTREC, "isolcpus=2-3", "", "", both).apply(system, ApplyContext())
    assert not system.exists(DROPIN) and not system.exists(BOOTREC) and calls[-1] == ("update-grub",)
    failing, _ = _loader(tmp_path, fail="update-grub")
    with pytest.raises(RetryableError) as exc:
        step.apply(failing, ApplyContext())
    assert (exc.value.reason, exc.value.message) == (
        "ToolFailed",
        "update-grub failed: update-grub exited 1: error: boom",
    )
    assert not failing.exists(BOOTREC)  # recorded only once the boot loader took it


def test_HST_CPU_14_boot_args_through_grubby_and_neither(tmp_path: Path) -> None:
    system, calls = _loader(tmp_path)
    guarded: list[str] = []
    grubby = bootargs.BootloaderView(False, True)
    step = bootargs.SetBootArgs("cpu", DROPIN, BOOTREC, "isolcpus=1", "isolcpus=2", "isolcpus=2", grubby)
    step.apply(system, ApplyContext(guard=guarded.append))
    assert calls == [
        ("grubby", "--update-kernel=ALL", "--remove-args=isolcpus=1"),
        ("grubby", "--update-kernel=ALL", "--args=isolcpus=2"),
    ]
    assert guarded == [BOOTREC, BOOTREC] and not system.exists(DROPIN)
    assert system.read_text(BOOTREC) == CPU_HEAD + "isolcpus=2\n"
    calls.clear()
    bootargs.SetBootArgs("cpu", DROPIN, BOOTREC, "", "isolcpus=3", "isolcpus=3", grubby).apply(
        system, ApplyContext()
    )
    assert calls == [("grubby", "--update-kernel=ALL", "--args=isolcpus=3")]
    calls.clear()
    bootargs.SetBootArgs("cpu", DROPIN, BOOTREC, "isolcpus=3", "", "", grubby).apply(system, ApplyContext())
    assert calls == [("grubby", "--update-kernel=ALL", "--remove-args=isolcpus=3")]
    assert not system.exists(BOOTREC)
    failing, fcalls = _loader(tmp_path, fail="grubby")
    for prev in ("isolcpus=1", ""):
        with pytest.raises(RetryableError) as exc:
            bootargs.SetBootArgs("cpu", DROPIN, BOOTREC, prev, "isolcpus=2", "isolcpus=2", grubby).apply(
                failing, ApplyContext()
            )
        assert exc.value.message == "grubby failed: grubby exited 1: error: boom"
    assert len(fcalls) == 2 and not failing.exists(BOOTREC)
    neither = bootargs.SetBootArgs(
        "cpu", DROPIN, BOOTREC, "", "isolcpus=2", "isolcpus=2", bootargs.BootloaderView(False, False)
    )
    with pytest.raises(RetryableError) as exc:
        neither.apply(system, ApplyContext())
    assert (exc.value.reason, exc.value.message) == (
        "NoBootloader",
        "cpu: neither update-grub nor grubby is installed to set kernel arguments",
    )


def test_boot_loader_observed_and_paths_named(tmp_path: Path) -> None:
    system = LocalSystem(tmp_path)
    assert bootargs.observe_bootloader(system) == bootargs.BootloaderView(False, False)
    system.write_atomic("/usr/sbin/update-grub", b"")
    assert bootargs.observe_bootloader(system) == bootargs.BootloaderView(True, False)
    system.write_atomic("/bin/grubby", b"")
    assert bootargs.observe_bootloader(system) == bootargs.BootloaderView(True, True)
    assert bootargs.dropin_path("iommu") == "/etc/default/grub.d/90-bcd-iommu.cfg"
    assert bootargs.record_path("iommu") == "/var/lib/bcd-hostconfig/bootargs/iommu"


# -- distro


def test_HST_DRV_os_release_parsed_as_shell_words() -> None:
    text = (
        "# a comment\n"
        '  NAME="Ubuntu 24.04 LTS"  \n'
        "\n"
        "ID=ubuntu\n"
        "ID_LIKE=debian\n"
        "VERSION_ID='24.04'\n"
        "EMPTY=\n"
        'BROKEN="unclosed\n'
        "no equals sign\n"
        "  # indented comment=x\n"
        "URL=https://a=b\n"
        " KEY = v\n"
    )
    assert distro.parse_os_release(text) == {
        "NAME": "Ubuntu 24.04 LTS",
        "ID": "ubuntu",
        "ID_LIKE": "debian",
        "VERSION_ID": "24.04",
        "EMPTY": "",
        "URL": "https://a=b",
        "KEY": "v",
    }


@pytest.mark.parametrize(
    ("fields", "family"),
    [
        ({"ID": "ubuntu", "ID_LIKE": "debian"}, "ubuntu"),
        ({"ID": "Ubuntu"}, "ubuntu"),
        ({"ID": "debian"}, "debian"),
        ({"ID": "pop", "ID_LIKE": "ubuntu debian"}, "debian"),
        ({"ID": "mint", "ID_LIKE": "Ubuntu"}, "debian"),
        ({"ID": "raspbian", "ID_LIKE": "debian"}, "debian"),
        ({"ID": "rhel"}, "rhel"),
        ({"ID": "rocky"}, "rhel"),
        ({"ID": "almalinux"}, "rhel"),
        ({"ID": "fedora"}, "rhel"),
        ({"ID": "centos"}, "rhel"),
        ({"ID": "ol", "ID_LIKE": "fedora"}, "rhel"),
        ({"ID": "x", "ID_LIKE": "rhel centos fedora"}, "rhel"),
        ({"ID": "x", "ID_LIKE": "centos"}, "rhel"),
        ({"ID": "ol", "ID_LIKE": "rhel"}, "rhel"),
        ({"ID": "sles"}, "suse"),
        ({"ID": "sled"}, "suse"),
        ({"ID": "suse"}, "suse"),
        ({"ID": "opensuse-leap", "ID_LIKE": "opensuse"}, "suse"),
        ({"ID": "opensuse-tumbleweed"}, "suse"),
        ({"ID": "x", "ID_LIKE": "suse opensuse"}, "suse"),
        ({"ID": "arch"}, "unknown"),
        ({"ID": "x", "ID_LIKE": "debianish rhel7 susex"}, "unknown"),
        ({}, "unknown"),
        ({"ID_LIKE": ""}, "unknown"),
    ],
)
def test_HST_DRV_family_from_id_then_id_like(fields: dict[str, str], family: str) -> None:
    assert distro.family_of(fields) == family


def test_HST_DRV_detect_reads_etc_then_usr_lib(tmp_path: Path) -> None:
    system = LocalSystem(tmp_path)
    assert distro.detect(system) == distro.Distro("", "", "unknown")
    system.write_atomic("/usr/lib/os-release", b'ID=rocky\nVERSION_ID="9.4"\n')
    assert distro.detect(system) == distro.Distro("rocky", "9.4", "rhel")
    system.write_atomic("/etc/os-release", b"ID=debian\nVERSION_ID=12\n")
    assert distro.detect(system) == distro.Distro("debian", "12", "debian")
    assert (
        distro.Distro("debian", "12", "debian").debian_like and distro.Distro("u", "", "ubuntu").debian_like
    )
    assert not distro.Distro("rocky", "9", "rhel").debian_like


def test_HST_DRV_15_16_17_install_commands_per_family() -> None:
    pkgs = ("a", "b")
    apt = (
        ("apt-get", "update"),
        (
            "env",
            "DEBIAN_FRONTEND=noninteractive",
            "apt-get",
            "install",
            "-y",
            "--no-install-recommends",
            "-o",
            "Dpkg::Options::=--force-confold",
            "a",
            "b",
        ),
    )
    assert distro.install_commands(distro.Distro("ubuntu", "24.04", "ubuntu"), pkgs) == apt
    assert distro.install_commands(distro.Distro("debian", "12", "debian"), pkgs) == apt
    assert distro.install_commands(distro.Distro("rocky", "9", "rhel"), pkgs) == (
        ("dnf", "-y", "install", "a", "b"),
    )
    assert distro.install_commands(distro.Distro("sles", "15", "suse"), pkgs) == (
        ("zypper", "--non-interactive", "install", "a", "b"),
    )
    assert distro.install_commands(distro.Distro("arch", "", "unknown"), pkgs) == ()


# -- _base


def test_HST_DEC_settings_bytes_that_are_not_utf8_refused_as_settings() -> None:
    """`decode_settings` promises a TerminalError on any fault: bytes that are not UTF-8 are refused
    with the rule named, not a UnicodeDecodeError."""
    from bcd_shared.errors import TerminalError
    from bcd_shared.units import REGISTRY
    from bcd_shared.units._base import load_object

    for raw in (b'{"a": "\xff"}', b"\xef\xbb", b'{"vm.swappiness": 1}\xc3'):
        with pytest.raises(TerminalError) as exc:
            load_object(raw)
        assert exc.value.reason == "InvalidSettings"
        assert exc.value.message.startswith("settings are not UTF-8: "), exc.value.message
    with pytest.raises(TerminalError, match=r"^settings are not UTF-8: "):
        REGISTRY["sysctl"].decode_settings(b'{"vm.swappiness": "\xff"}')
    assert load_object('{"a": "\u00e9"}'.encode()) == {"a": "\u00e9"}
    with pytest.raises(TerminalError) as exc:
        load_object(b'{"a": "\xff"}')
    assert exc.value.message == "settings are not UTF-8: invalid start byte at 7"


def test_HST_LVL_plans_issues_and_reboot_messages() -> None:
    from bcd_shared.units import RebootRequired

    step = _Step("a")
    assert Plan().converged and not Plan((step,)).converged
    assert not Plan((), (Issue("retryable", "x"),)).converged
    issues = (Issue("retryable", "r"), Issue("terminal", "t1"), Issue("reboot", "b"), Issue("terminal", "t2"))
    assert Plan((), issues).terminal == (Issue("terminal", "t1"), Issue("terminal", "t2"))
    assert Plan((), issues[:1]).terminal == ()
    r = RebootRequired("set")
    assert (r.reason, r.message, r.terminal) == ("RebootRequired", "set: reboot the node", False)
    assert RebootRequired("then reboot the node").message == "then reboot the node"


def test_HST_LVL_shared_steps_guarded_and_described(tmp_path: Path) -> None:
    from bcd_shared.units._base import RemoveFile, Run, WriteFile

    calls: list[tuple[tuple[str, ...], bytes | None]] = []

    def tool(system: Any, argv: Any, stdin: bytes | None) -> CommandResult:
        calls.append((tuple(argv), stdin))
        return CommandResult(tuple(argv), 1 if "bad" in argv else 0, b"", b"Not Found\n")

    system = LocalSystem(tmp_path, tools={"t": tool})
    guarded: list[str] = []
    actx = ApplyContext(guard=guarded.append)
    w = WriteFile("/etc/x/y", b"abc", 0o600)
    assert w.describe() == "write /etc/x/y" and "data=<3 bytes>" in repr(w)
    w.apply(system, actx)
    assert system.read_bytes("/etc/x/y") == b"abc" and (tmp_path / "etc/x/y").stat().st_mode & 0o777 == 0o600
    WriteFile("/etc/x/z", b"").apply(system, ApplyContext())
    assert (tmp_path / "etc/x/z").stat().st_mode & 0o777 == 0o644
    rm = RemoveFile("/etc/x/y")
    assert rm.describe() == "remove /etc/x/y"
    rm.apply(system, actx)
    assert not system.exists("/etc/x/y") and guarded == ["/etc/x/y", "/etc/x/y"]
    with pytest.raises(RetryableError, match=r"^/etc/x/z refused$"):
        RemoveFile("/etc/x/z").apply(system, ApplyContext(guard=_refusing_guard))
    with pytest.raises(RetryableError, match=r"^/etc/x/n refused$"):
        WriteFile("/etc/x/n", b"").apply(system, ApplyContext(guard=_refusing_guard))
    assert system.exists("/etc/x/z") and not system.exists("/etc/x/n")
    run = Run(("t", "a b"), input=b"in")
    assert run.describe() == "run t a b"
    run.apply(system, actx)
    assert calls == [(("t", "a b"), b"in")] and guarded == ["/etc/x/y", "/etc/x/y"]
    Run(("t", "bad"), ok_stderr=("Not Found",)).apply(system, actx)
    with pytest.raises(RetryableError) as exc:
        Run(("t", "bad"), message="m").apply(system, actx)
    assert (exc.value.reason, exc.value.message) == ("ToolFailed", "m: t exited 1: Not Found")
    from bcd_shared.errors import TerminalError

    with pytest.raises(TerminalError):
        Run(("t", "bad"), failure="terminal").apply(system, actx)


def test_HST_LVL_host_readers(tmp_path: Path) -> None:
    from bcd_shared.units._base import (
        BIN_DIRS,
        has_program,
        read_json_record,
        read_stripped,
        read_text_record,
        service_active,
        systemd_running,
    )

    asked: list[tuple[str, ...]] = []

    def systemctl(system: Any, argv: Any, stdin: bytes | None) -> CommandResult:
        asked.append(tuple(argv))
        return CommandResult(tuple(argv), 0 if argv[-1] == "up.service" else 3)

    system = LocalSystem(tmp_path, tools={"systemctl": systemctl})
    assert not has_program(system, "x")
    for d in BIN_DIRS:
        system.write_atomic(f"{d}/p{len(d)}", b"")
        assert has_program(system, f"p{len(d)}"), d
    assert BIN_DIRS == ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")
    assert not systemd_running(system)
    system.host_path("/run/systemd/system").mkdir(parents=True)
    assert systemd_running(system)
    assert service_active(system, "up.service") and not service_active(system, "down.service")
    assert asked == [
        ("systemctl", "is-active", "--quiet", "up.service"),
        ("systemctl", "is-active", "--quiet", "down.service"),
    ]
    assert read_stripped(system, "/nope") is None
    system.write_atomic("/r/s", b"  v \n")
    assert read_stripped(system, "/r/s") == "v"
    system.write_atomic("/r/j", b'"a string"')
    assert read_json_record(system, "/r/j") is None
    system.write_atomic("/r/t", b"#h\n a \n\n\t\n #not a comment\nb\n")
    assert read_text_record(system, "/r/t") == "a #not a comment b"
    system.write_atomic("/r/e", b"# only\n")
    assert read_text_record(system, "/r/e") == ""


def test_HST_LVL_write_kernel_writes_the_value_and_a_newline_through_tee(tmp_path: Path) -> None:
    from bcd_shared.units._base import WriteKernel

    got: list[tuple[tuple[str, ...], bytes | None]] = []

    def tee(system: Any, argv: Any, stdin: bytes | None) -> CommandResult:
        got.append((tuple(argv), stdin))
        if "fail" in argv[1]:
            return CommandResult(tuple(argv), 1, b"", b"tee: Permission denied\n")
        Path(argv[1]).write_bytes(stdin or b"")
        return CommandResult(tuple(argv), 0)

    system = LocalSystem(tmp_path, tools={"tee": tee})
    system.write_atomic("/proc/sys/vm/x", b"0\n")
    WriteKernel("/proc/sys/vm/x", "madvise", verify=True).apply(system, ApplyContext())
    assert got == [(("tee", str(tmp_path / "proc/sys/vm/x")), b"madvise\n")]
    assert system.read_bytes("/proc/sys/vm/x") == b"madvise\n"
    with pytest.raises(RetryableError) as exc:
        WriteKernel("/proc/sys/vm/fail", "1").apply(system, ApplyContext())
    assert (exc.value.reason, exc.value.message) == (
        "KernelWrite",
        "cannot set /proc/sys/vm/fail to 1: tee exited 1: tee: Permission denied",
    )


def test_HST_LVL_check_defaults_and_output_that_is_not_utf8() -> None:
    from bcd_shared.units._base import check

    with pytest.raises(RetryableError) as exc:
        check(CommandResult(("tool",), 2, b"", b"bad \xff thing\n"))
    assert (type(exc.value), exc.value.reason, exc.value.message) == (
        RetryableError,
        "ToolFailed",
        "tool exited 2: bad \ufffd thing",
    )
    check(CommandResult(("tool",), 1, b"\xfe", b"x: Not Found\n"), ok=("Not Found",))


def test_HST_K8S_58_59_converge_validates_with_the_callers_context(tmp_path: Path) -> None:
    """converge_unit validates the settings with the caller's UnitContext: root's allowlist decides."""
    import json

    from bcd_shared.units import REGISTRY, ClusterPin

    unit = REGISTRY["k8s-join"]
    pin = "ab" * 32
    s = unit.decode_settings(
        json.dumps({"server": "https://10.0.0.1:6443", "caCertSha256": pin, "tokenRef": "secret://k"})
    )
    system = LocalSystem(tmp_path, tools={"true": lambda sy, a, i: CommandResult(tuple(a), 0)})
    r = converge_unit(unit, s, system, UnitContext(), ApplyContext())
    assert r == UnitResult(
        "k8s-join",
        False,
        (
            Issue(
                "terminal",
                "k8s-join: joining a Kubernetes cluster needs [kubernetes] allowed_clusters in bcd's config",
            ),
        ),
    )
    other = UnitContext(allowed_clusters=(ClusterPin("https://10.0.0.2:6443", pin),))
    r = converge_unit(unit, s, system, other, ApplyContext())
    assert r.issues == (
        Issue(
            "terminal",
            f"k8s-join: https://10.0.0.1:6443 with CA pin sha256:{pin} "
            "is not in [kubernetes] allowed_clusters",
        ),
    )
    allowed = UnitContext(allowed_clusters=(ClusterPin("https://10.0.0.1:6443", pin),))
    r = converge_unit(unit, s, system, allowed, ApplyContext())
    assert r.issues == (
        Issue(
            "terminal",
            "k8s-join: kubeadm, kubelet, kubectl missing and no kubernetesVersion says which to install",
        ),
    )
