"""The host units' rules at their edges, written against mutation testing's survivors (docs/mutation.md).

Refusals are checked word for word (field and rule), limits at the limit and one past it, regexes with
a bad input of each forbidden class, and planners pure: a plan over a constructed observation, its
exact steps. The units' whole runs on the simulated host are in test_units_simhost.py.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Mapping
from typing import Any

import pytest
from bcd_shared.errors import TerminalError
from bcd_shared.units import REGISTRY
from bcd_shared.units._base import Issue, RemoveFile, Run, WriteFile
from bcd_shared.units.kmod import KernelModulesObserved, ModuleView
from bcd_shared.units.sysctl import SysctlObserved, outside_allowlist, render_value


def refusal(unit: str, settings: Any) -> str:
    text = settings if isinstance(settings, str) else json.dumps(settings)
    with pytest.raises(TerminalError) as exc:
        REGISTRY[unit].decode_settings(text)
    assert exc.value.reason == "InvalidSettings"
    return exc.value.message


def decoded(unit: str, settings: Any) -> Any:
    return REGISTRY[unit].decode_settings(json.dumps(settings))


HEAD = "# Written by bcd ({unit} unit): local edits are replaced on the next converge pass.\n"


# -- sysctl


@pytest.mark.parametrize(
    "key",
    [
        "vm",  # one component
        "vm.",  # an empty second component
        ".vm.swappiness",
        "vm..swappiness",
        "Vm.swappiness",  # upper case
        "vm.swap piness",  # a space
        "vm.swap/piness",  # a slash
        "vm-x.swappiness",  # a dash in the first component
        "vm.swappiness\n",
    ],
)
def test_sysctl_name_refused_naming_the_rule(key: str) -> None:
    assert refusal("sysctl", {key: 1}) == f"{key}: not a sysctl name (^[a-z0-9_]+(?:\\.[a-z0-9_-]+)+$)"


def test_sysctl_names_accepted_at_the_rules_edges() -> None:
    settings = decoded("sysctl", {"a.b": 1, "net.ipv4.conf.eth-0.rp_filter": 1, "x_1.y-2.z_3": "v"})
    assert settings.values == (("a.b", "1"), ("net.ipv4.conf.eth-0.rp_filter", "1"), ("x_1.y-2.z_3", "v"))


@pytest.mark.parametrize(
    ("key", "why"),
    [
        ("kernel.core_pattern", "it names or controls a program the kernel runs as root"),
        ("kernel.usermodehelper.inheritable", "it names or controls a program the kernel runs as root"),
        ("fs.binfmt_misc.register", "it registers interpreters the kernel runs"),
        ("fs.protected_regular", "it would lower the host's defenses"),
        ("kernel.unprivileged_bpf_disabled", "it would lower the host's defenses"),
        ("kernel.modules_disabled", "it cannot be undone without a reboot"),
        ("user.max_net_namespaces", "it changes who may create namespaces"),
        ("vm.mmap_rnd_bits", "it would lower the host's defenses"),
        ("vm.mmap_rnd_compat_bits", "it would lower the host's defenses"),
    ],
)
def test_HST_SYS_12_denylisted_key_refused_whatever_the_value_with_its_reason(key: str, why: str) -> None:
    """Q-HST-SYS-01's wording, for values that would be harmless on a hardened key (0, 1, "1", true)."""
    for value in (0, 1, "1", True, 2.5):
        assert refusal("sysctl", {key: value}) == f"{key} is refused: {why}"


_PROGRAM = "it names or controls a program the kernel runs as root"
_DEFENSE = "it would lower the host's defenses"
_USERNS = "it changes who may create namespaces"
DENIED_BY_ID = [
    ("HST-SYS-14", ("kernel.core_pattern",), _PROGRAM),
    ("HST-SYS-15", ("kernel.modprobe",), _PROGRAM),
    ("HST-SYS-16", ("kernel.usermodehelper.bset", "kernel.usermodehelper.inheritable"), _PROGRAM),
    ("HST-SYS-17", ("kernel.poweroff_cmd",), _PROGRAM),
    ("HST-SYS-18", ("kernel.hotplug",), _PROGRAM),
    (
        "HST-SYS-19",
        ("fs.binfmt_misc.status", "fs.binfmt_misc.register"),
        "it registers interpreters the kernel runs",
    ),
    ("HST-SYS-20", ("fs.suid_dumpable",), _DEFENSE),
    ("HST-SYS-21", ("fs.protected_symlinks", "fs.protected_hardlinks", "fs.protected_fifos"), _DEFENSE),
    ("HST-SYS-22", ("kernel.randomize_va_space",), _DEFENSE),
    ("HST-SYS-23", ("kernel.kptr_restrict",), _DEFENSE),
    ("HST-SYS-24", ("kernel.dmesg_restrict",), _DEFENSE),
    ("HST-SYS-25", ("kernel.yama.ptrace_scope", "kernel.yama.protected_sticky_symlinks"), _DEFENSE),
    ("HST-SYS-26", ("kernel.kexec_load_disabled",), _DEFENSE),
    ("HST-SYS-27", ("kernel.unprivileged_bpf_disabled",), _DEFENSE),
    ("HST-SYS-28", ("kernel.perf_event_paranoid",), _DEFENSE),
    ("HST-SYS-29", ("kernel.sysrq",), _DEFENSE),
    ("HST-SYS-30", ("vm.mmap_min_addr",), _DEFENSE),
    ("HST-SYS-31", ("vm.unprivileged_userfaultfd",), _DEFENSE),
    ("HST-SYS-32", ("net.core.bpf_jit_harden",), _DEFENSE),
    ("HST-SYS-33", ("kernel.modules_disabled",), "it cannot be undone without a reboot"),
    (
        "HST-SYS-34",
        ("user.max_user_namespaces", "user.max_net_namespaces", "user.max_inotify_watches"),
        _USERNS,
    ),
    ("HST-SYS-35", ("kernel.unprivileged_userns_clone",), _USERNS),
    ("HST-SYS-36", ("kernel.apparmor_restrict_unprivileged_userns",), _USERNS),
]


@pytest.mark.parametrize(("rid", "keys", "why"), DENIED_BY_ID, ids=[r[0] for r in DENIED_BY_ID])
def test_HST_SYS_14_to_36_each_denied_key_is_refused_whatever_the_value(
    rid: str, keys: tuple[str, ...], why: str
) -> None:
    """HST-SYS-14..36, one row each: every value, the hardened ones (0, 1, 2, -1) included, is refused
    with the key's own reason, so a key kept only to its safer values (as the hardened keys are) fails
    here; a wildcard rule is tried on two or three keys under it. (The decode table's row for each id
    tries one value and reads only `is refused`, which a hardened key's refusal also says.)"""
    for key in keys:
        for value in (0, 1, 2, -1, "0", "1", True, False, "|/bin/true"):
            assert refusal("sysctl", {key: value}) == f"{key} is refused: {why}", (rid, key, value)


def test_sysctl_denylist_patterns_match_whole_names_only() -> None:
    # `kernel.yama.*` takes `kernel.yama.x`, not `kernel.yamax`; exact names do not take a longer one.
    settings = decoded("sysctl", {"kernel.yamax": 1, "kernel.sysrq_x": 1, "fs.suid_dumpable2": 1})
    assert [k for k, _ in settings.values] == ["fs.suid_dumpable2", "kernel.sysrq_x", "kernel.yamax"]


@pytest.mark.parametrize(
    ("key", "good", "bad", "desc"),
    [
        ("dev.tty.legacy_tiocsti", [0, False, "0"], [1, -1, True], "0 only"),
        ("kernel.io_uring_disabled", [1, 2, "2"], [0, 3, -1], "1 or 2"),
        ("kernel.io_uring_group", [-1, "-1"], [0, 4242, -2], "-1 only"),  # red team round 8
        (
            "net.ipv4.ip_unprivileged_port_start",
            [1024, 65535, 1 << 31],
            [1023, 0, (1 << 31) + 1],
            "1024 or above",
        ),
        ("kernel.apparmor_restrict_unprivileged_unconfined", [1], [0, 2], "1 only"),
        ("kernel.unprivileged_userns_apparmor_policy", [1, True], [0, 2], "1 only"),
        ("net.ipv4.conf.all.route_localnet", [0], [1], "0 only"),
        ("net.ipv4.conf.eth0.accept_source_route", [0], [1, -1], "0 only"),
        ("net.ipv6.conf.default.accept_source_route", [0, -1], [1, -2], "0 or -1"),
        ("kernel.oops_limit", [1, 10000], [0, 10001], "1 to 10000"),
        ("kernel.warn_limit", [1, 10000], [0, 10001], "1 to 10000"),
    ],
)
def test_HST_SYS_37_hardened_values_at_each_bound(
    key: str, good: list[Any], bad: list[Any], desc: str
) -> None:
    for value in good:
        assert decoded("sysctl", {key: value}).values == ((key, render_value(key, value)),)
    for value in bad:
        shown = render_value(key, value)
        assert refusal("sysctl", {key: value}) == (
            f"{key} = {shown} is refused: it would lower the host's defenses ({desc})"
        )


def test_sysctl_hardened_key_with_a_value_that_is_no_integer_is_refused() -> None:
    for value in ("off", 0.5, "0 1"):
        shown = render_value("dev.tty.ldisc_autoload", value)
        assert refusal("sysctl", {"dev.tty.ldisc_autoload": value}) == (
            f"dev.tty.ldisc_autoload = {shown} is refused: it would lower the host's defenses (0 only)"
        )


def test_HST_SYS_05_06_values_rendered_exactly() -> None:
    assert render_value("k", True) == "1" and render_value("k", False) == "0"
    assert render_value("k", 10) == "10" and render_value("k", -3) == "-3"
    assert render_value("k", 4.0) == "4" and render_value("k", 0.5) == "0.5"
    assert render_value("k", " 4096\t87380  6291456 ") == "4096 87380 6291456"
    assert render_value("k", "a" * 4096) == "a" * 4096


def test_HST_SYS_03_string_values_at_their_limits() -> None:
    assert refusal("sysctl", {"kernel.x": "a" * 4097}) == "kernel.x: at most 4096 characters, not 4097"
    assert refusal("sysctl", {"kernel.x": "a\rb"}) == "kernel.x: the value must be a single line"
    assert refusal("sysctl", {"kernel.x": "a\nb"}) == "kernel.x: the value must be a single line"
    assert refusal("sysctl", {"kernel.x": None}) == (
        "kernel.x: the value must be a number, a boolean or a string, not NoneType"
    )
    assert refusal("sysctl", {"kernel.x": {"a": 1}}) == (
        "kernel.x: the value must be a number, a boolean or a string, not dict"
    )


def test_sysctl_allowlist_takes_whole_leading_components() -> None:
    assert not outside_allowlist("net.core.somaxconn", ())
    assert not outside_allowlist("net.core.somaxconn", ("net.core",))
    assert not outside_allowlist("net.core.somaxconn", ("net.core.",))
    assert not outside_allowlist("vm.swappiness", ("net.core", "vm.swappiness"))
    assert outside_allowlist("net.corex.a", ("net.core",))
    assert outside_allowlist("vm.swappiness", ("net.core",))
    assert outside_allowlist("net.core", ("net.core.somaxconn",))


def _sysctl_plan(
    settings: dict[str, Any] | None, dropin: bytes | None, live: Mapping[str, str | None]
) -> Any:
    unit = REGISTRY["sysctl"]
    s = None if settings is None else unit.decode_settings(json.dumps(settings))
    return unit.plan(s, SysctlObserved(dropin, tuple(live.items())))


def test_HST_SYS_07_08_10_plan_writes_the_dropin_sets_what_differs_and_waits_for_missing_keys() -> None:
    want = (HEAD.format(unit="sysctl") + "net.core.somaxconn = 4096\nvm.swappiness = 10\nvm.x = 1\n").encode()
    settings = {"vm.swappiness": 10, "net.core.somaxconn": 4096, "vm.x": True}
    p = _sysctl_plan(settings, None, {"net.core.somaxconn": "4096", "vm.swappiness": "60", "vm.x": None})
    assert p.steps == (
        WriteFile("/etc/sysctl.d/90-bcd.conf", want),
        Run(("sysctl", "-w", "vm.swappiness=10"), message="cannot set vm.swappiness"),
    )
    assert p.issues == (
        Issue("retryable", "this kernel has no vm.x (is the module that provides it loaded?)"),
    )
    live = {"net.core.somaxconn": "4096", "vm.swappiness": "10", "vm.x": "1"}
    assert _sysctl_plan(settings, want, live).converged


def test_HST_SYS_09_plan_removes_the_dropin_for_empty_settings_and_clean_up() -> None:
    assert _sysctl_plan({}, b"x", {}).steps == (RemoveFile("/etc/sysctl.d/90-bcd.conf"),)
    assert _sysctl_plan(None, b"x", {}).steps == (RemoveFile("/etc/sysctl.d/90-bcd.conf"),)
    assert _sysctl_plan(None, None, {}).converged and _sysctl_plan({}, None, {}).converged


# -- kernel-modules


@pytest.mark.parametrize(
    "name",
    ["", "a" * 65, "Kvm", "kvm.ko", "kvm intel", "kvm/x", "kvm\n"],
)
def test_HST_MOD_03_load_names_refused(name: str) -> None:
    shown = repr(name[:80])
    assert refusal("kernel-modules", {"load": [name]}) == (
        f"load[0]: {shown} does not match ^[a-z0-9_-]{{1,64}}$"
    )


def test_HST_MOD_02_03_load_at_its_limits() -> None:
    assert decoded("kernel-modules", {"load": ["a" * 64, "b-c_9"]}).load == ("a" * 64, "b-c_9")
    names = [f"m{i}" for i in range(64)]
    assert decoded("kernel-modules", {"load": names}).load == tuple(names)
    assert refusal("kernel-modules", {"load": [*names, "m64"]}) == "load: at most 64 entries, not 65"
    assert refusal("kernel-modules", {"load": "kvm"}) == "load: must be a list of strings"
    assert refusal("kernel-modules", {"load": [1]}) == "load[0]: must be a string"


def test_HST_MOD_04_options_at_their_limits() -> None:
    opts = {f"m{i}": "a=1" for i in range(64)}
    assert len(decoded("kernel-modules", {"options": opts}).options) == 64
    assert refusal("kernel-modules", {"options": {**opts, "m64": "a=1"}}) == (
        "options: at most 64 entries, not 65"
    )
    assert refusal("kernel-modules", {"options": ["a=1"]}) == "options: must be an object of strings"
    assert refusal("kernel-modules", {"options": {"kvm": 1}}) == "options.kvm: must be a string"
    assert refusal("kernel-modules", {"options": {"Kvm": "a=1"}}) == (
        "options: module name 'Kvm' does not match ^[a-z0-9_-]{1,64}$"
    )


@pytest.mark.parametrize("bad", ["a=$x", "a=1;b=2", "a=`x`", "a=1\tb=2", 'a="x"', "a=é", "a=1\n"])
def test_HST_MOD_05_option_value_characters_refused(bad: str) -> None:
    assert refusal("kernel-modules", {"options": {"kvm": bad}}) == (
        "options.kvm: only letters, digits and _.,:=/ - are allowed"
    )


def test_HST_MOD_05_06_option_values_at_their_limits() -> None:
    ok = "a=" + "1" * 254
    assert decoded("kernel-modules", {"options": {"kvm": ok}}).options == (("kvm", (("a", "1" * 254),), ok),)
    assert refusal("kernel-modules", {"options": {"kvm": ok + "1"}}) == (
        "options.kvm: at most 256 characters, not 257"
    )
    assert (
        refusal("kernel-modules", {"options": {"kvm": "nested"}}) == "options.kvm: 'nested' is not key=value"
    )
    assert refusal("kernel-modules", {"options": {"kvm": "  "}}) == "options.kvm: empty options"
    assert refusal("kernel-modules", {"options": {"kvm": ""}}) == "options.kvm: empty options"
    every = "a_B9=x.y,z:w/v-u ids=10de:2330"
    assert decoded("kernel-modules", {"options": {"kvm": every}}).options[0][1] == (
        ("a_B9", "x.y,z:w/v-u"),
        ("ids", "10de:2330"),
    )


@pytest.mark.parametrize(
    ("key", "shown"), [("", "''"), ("k" * 65, repr("k" * 65)), ("a.b", "'a.b'"), ("a-b", "'a-b'")]
)
def test_HST_MOD_07_option_key_refused_naming_the_rule(key: str, shown: str) -> None:
    assert refusal("kernel-modules", {"options": {"kvm": f"{key}=1"}}) == (
        f"options.kvm: option key {shown} does not match ^[A-Za-z0-9_]{{1,64}}$"
    )


def test_HST_MOD_07_option_key_at_64_characters_accepted() -> None:
    key = "K" * 63 + "9"
    assert decoded("kernel-modules", {"options": {"kvm": f"{key}=1"}}).options[0][1] == ((key, "1"),)


@pytest.mark.parametrize(
    ("module", "key"),
    [
        ("vfio", "enable_unsafe_noiommu_mode"),
        ("vfio_iommu_type1", "allow_unsafe_interrupts"),
        ("vfio-iommu-type1", "allow_unsafe_interrupts"),
    ],
)
def test_HST_MOD_17_18_refused_options_named_whatever_the_value(module: str, key: str) -> None:
    for value in ("1", "0", "Y"):
        assert refusal("kernel-modules", {"options": {module: f"a=1 {key}={value}"}}) == (
            f"options.{module}: {key} is refused: it lets a passed-through device reach host memory"
        )
    # the same key under any other module name too (red team round 8: iommufd's own
    # allow_unsafe_interrupts, and options written for an alias of vfio, which modprobe applies)
    for other in ("kvm", "iommufd", "char-major-10-196"):
        assert refusal("kernel-modules", {"options": {other: f"{key}=1"}}) == (
            f"options.{other}: {key} is refused: it lets a passed-through device reach host memory"
        )


def test_nvidia_profiling_restriction_only_at_its_default_and_no_registry_keys() -> None:
    """docs/host.md "Refused module options beyond the seeds": the driver reads the restriction with
    kstrtouint in base 0, so every spelling but exactly `1` is refused (several are 0 there); the
    registry keys are refused whatever they hold; under any module name, as the vfio keys."""
    key = "NVreg_RestrictProfilingToAdminUsers"
    for module in ("nvidia", "nvidia-current", "kvm"):
        for value in ("0", "00", "0x0", "01", "2", "Y", ""):  # (`+0` fails the value rule before)
            assert refusal("kernel-modules", {"options": {module: f"a=1 {key}={value}"}}) == (
                f"options.{module}: {key}={value} is refused: only {key}=1 (GPU performance counters to "
                "administrators only; any other value opens them to every tenant)"
            ), (module, value)
        for registry in ("NVreg_RegistryDwords", "NVreg_RegistryDwordsPerDevice"):
            assert refusal("kernel-modules", {"options": {module: f"{registry}=RMUseSwI2c=1"}}) == (
                f"options.{module}: {registry} is refused: it sets any of the GPU driver's registry entries, "
                "the profiling restriction among them"
            )
    long = "0" * 40  # the value is shown cut to 32 characters
    assert refusal("kernel-modules", {"options": {"nvidia": f"{key}={long}"}}).startswith(
        f"options.nvidia: {key}={'0' * 32} is refused: only {key}=1 "
    )
    unit = REGISTRY["kernel-modules"]
    settings = unit.decode_settings(json.dumps({"options": {"nvidia": f"{key}=1 NVreg_EnableGpuFirmware=0"}}))
    assert settings.options[0][1] == ((key, "1"), ("NVreg_EnableGpuFirmware", "0"))


def test_kmod_unknown_field_named() -> None:
    assert refusal("kernel-modules", {"load": [], "option": {}}) == "option: unknown field"


def _kmod_plan(
    settings: dict[str, Any] | None, load: bytes | None, opts: bytes | None, mods: dict[str, ModuleView]
) -> Any:
    unit = REGISTRY["kernel-modules"]
    s = None if settings is None else unit.decode_settings(json.dumps(settings))
    return unit.plan(s, KernelModulesObserved(load, opts, tuple(mods.items())))


def test_HST_MOD_08_09_files_rendered_exactly() -> None:
    head = HEAD.format(unit="kernel-modules")
    settings = {
        "load": ["vhost_net", "tun", "tun"],
        "options": {"vfio-pci": "ids=10de:2330 x=1", "kvm": "a=Y"},
    }
    loaded = ModuleView(True, 0, ())
    p = _kmod_plan(settings, None, None, {"tun": loaded, "vhost_net": loaded})
    assert p.steps == (
        WriteFile("/etc/modules-load.d/bcd.conf", (head + "tun\nvhost_net\n").encode()),
        WriteFile(
            "/etc/modprobe.d/bcd.conf",
            (head + "options kvm a=Y\noptions vfio_pci ids=10de:2330 x=1\n").encode(),
        ),
    )


def test_HST_MOD_10_RMV_files_removed_when_empty_and_on_clean_up() -> None:
    steps = (RemoveFile("/etc/modules-load.d/bcd.conf"), RemoveFile("/etc/modprobe.d/bcd.conf"))
    assert _kmod_plan(None, b"x", b"y", {}).steps == steps
    assert _kmod_plan({"load": []}, b"x", b"y", {}).steps == steps
    assert _kmod_plan({}, None, None, {}).converged


def test_HST_MOD_12_13_14_15_load_reload_and_in_use() -> None:
    head = HEAD.format(unit="kernel-modules").encode()
    settings = {"load": ["kvm_intel", "tun", "vfio-pci"], "options": {"kvm_intel": "nested=1 ept=Y"}}
    load = head + b"kvm_intel\ntun\nvfio-pci\n"
    opts = head + b"options kvm_intel nested=1 ept=Y\n"

    def plan(kvm: ModuleView, tun: ModuleView | None = None) -> Any:
        mods = {"kvm_intel": kvm, "vfio-pci": ModuleView(True, 0, ())}
        if tun is not None:
            mods["tun"] = tun
        return _kmod_plan(settings, load, opts, mods)

    same = (("nested", "Y"), ("ept", "1"))  # Y/N and 1/0 compare equal
    assert plan(ModuleView(True, 0, same), ModuleView(True, 0, ())).converged
    assert plan(ModuleView(True, 0, same)).steps == (
        Run(("modprobe", "--", "tun"), message="cannot load tun"),
    )
    assert plan(ModuleView(True, 0, same), ModuleView(False, 0, ())).steps == (
        Run(("modprobe", "--", "tun"), message="cannot load tun"),
    )
    reload = (
        Run(("modprobe", "-r", "--", "kvm_intel"), message="cannot unload kvm_intel"),
        Run(("modprobe", "--", "kvm_intel"), message="cannot load kvm_intel"),
    )
    tun = ModuleView(True, 0, ())
    assert plan(ModuleView(True, 0, (("nested", "N"), ("ept", "1"))), tun).steps == reload
    assert plan(ModuleView(True, 0, (("nested", "1"), ("ept", "n"))), tun).steps == reload
    assert plan(ModuleView(True, 0, (("nested", "1"),)), tun).steps == reload  # a parameter not shown differs
    in_use = plan(ModuleView(True, 1, (("nested", "0"), ("ept", "0"))), tun)
    assert in_use.converged  # HST-MOD-16: no step, no issue
    assert plan(ModuleView(False, 0, ()), tun).steps == (
        Run(("modprobe", "--", "kvm_intel"), message="cannot load kvm_intel"),
    )


# -- mig-layout


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        ("all-", "layout: '' is not a MIG profile (<n>g.<m>gb)"),
        ("all-1g.10gb+me", "layout: '1g.10gb+me' is not a MIG profile (<n>g.<m>gb)"),
        ("all-Disabled", "layout: 'Disabled' is not a MIG profile (<n>g.<m>gb)"),
        ("mixed:", "layout: '' is not [<n>x]<n>g.<m>gb"),
        ("mixed:x1g.10gb", "layout: 'x1g.10gb' is not [<n>x]<n>g.<m>gb"),
        ("mixed:2X1g.10gb", "layout: '2X1g.10gb' is not [<n>x]<n>g.<m>gb"),
        ("mixed:1g.10gb++1g.10gb", "layout: '' is not [<n>x]<n>g.<m>gb"),
        ("mixed:9x1g.10gb", "layout: the count 9 of 1g.10gb is outside 1 to 8"),
        ("mixed:0x1g.10gb", "layout: the count 0 of 1g.10gb is outside 1 to 8"),
        ("mixed:5x1g.10gb+4x1g.10gb", "layout: 9 instances; a layout holds 1 to 8"),
        ("Mixed:1g.10gb", "layout: 'Mixed:1g.10gb' is not all-disabled, all-<profile> or mixed:<profiles>"),
        ("all-disabled ", "layout: 'disabled ' is not a MIG profile (<n>g.<m>gb)"),
        ("disabled", "layout: 'disabled' is not all-disabled, all-<profile> or mixed:<profiles>"),
    ],
)
def test_HST_MIG_06_07_08_09_10_layout_refusals_word_for_word(layout: str, message: str) -> None:
    assert refusal("mig-layout", {"layout": layout}) == message


def test_HST_MIG_05_layouts_at_their_limits() -> None:
    from bcd_shared.units.mig import Layout

    assert decoded("mig-layout", {"layout": "mixed:8x1g.10gb"}).parsed == Layout("mixed", (("1g.10gb", 8),))
    assert decoded("mig-layout", {"layout": "mixed:1x7g.80gb"}).parsed == Layout("mixed", (("7g.80gb", 1),))
    assert decoded("mig-layout", {"layout": "mixed:3g.40gb+2x2g.20gb+1g.10gb"}).parsed == Layout(
        "mixed", (("3g.40gb", 1), ("2g.20gb", 2), ("1g.10gb", 1))
    )
    assert decoded("mig-layout", {"layout": "mixed:4x1g.10gb+4x1g.10gb"}).parsed.profiles == (
        ("1g.10gb", 4),
        ("1g.10gb", 4),
    )
    assert decoded("mig-layout", {"layout": "all-10g.100gb"}).parsed == Layout("all", (("10g.100gb", 0),))
    assert decoded("mig-layout", {"layout": "all-disabled"}).parsed == Layout("disabled")
    empty = decoded("mig-layout", {"from": "pool", "layout": ""})
    assert (empty.layout, empty.parsed, empty.source) == ("", None, "pool")
    at_limit = "all-1g." + "1" * 247 + "gb"  # 256 characters
    assert decoded("mig-layout", {"layout": at_limit}).parsed == Layout("all", ((at_limit[4:], 0),))
    assert refusal("mig-layout", {"layout": "all-1g.1" + "1" * 247 + "gb"}) == (
        "layout: at most 256 characters, not 257"
    )
    assert refusal("mig-layout", {"layout": "all-1g.10gb", "form": "pool"}) == "form: unknown field"


def test_HST_MIG_largest_first_orders_by_slices_then_memory() -> None:
    from bcd_shared.units.mig import largest_first, size_key

    assert largest_first(["1g.10gb", "1g.20gb", "7g.80gb", "2g.20gb", "1g.10gb"]) == (
        "7g.80gb",
        "2g.20gb",
        "1g.20gb",
        "1g.10gb",
        "1g.10gb",
    )
    assert size_key("12g.160gb") == (12, 160) and size_key("x") == (0, 0)


def _mig(index: str, current: str, instances: tuple[str, ...] = (), uuid: str = "") -> Any:
    from bcd_shared.units.mig import MigGpu
    from bcd_shared.units.nvsmi import MigProfile

    profiles = (
        MigProfile("1g.10gb", 19, 7),
        MigProfile("2g.20gb", 14, 3),
        MigProfile("3g.40gb", 9, 2),
        MigProfile("7g.80gb", 0, 1),
    )
    return MigGpu(
        index, uuid or f"GPU-{index}", current, current, profiles if current == "Enabled" else (), instances
    )


def _mig_plan(layout: str, gpus: Any, busy: frozenset[str] = frozenset()) -> Any:
    from bcd_shared.units.mig import MigObserved

    unit = REGISTRY["mig-layout"]
    return unit.plan(unit.decode_settings(json.dumps({"layout": layout})), MigObserved(gpus, busy))


def test_HST_MIG_plan_mode_then_instances_largest_first() -> None:
    from bcd_shared.units.mig import Repartition, SetMigMode

    layout = "mixed:2x1g.10gb+3g.40gb"
    assert _mig_plan(layout, (_mig("0", "Disabled"), _mig("1", "Enabled"))).steps == (
        SetMigMode("0", True),
        Repartition("1", ("3g.40gb", "1g.10gb", "1g.10gb")),
    )
    at = ("1g.10gb", "1g.10gb", "3g.40gb")  # as parse_lgi sorts them
    assert _mig_plan(layout, (_mig("0", "Enabled", at),)).converged
    assert _mig_plan(layout, (_mig("0", "Enabled", ("1g.10gb", "3g.40gb")),)).steps == (
        Repartition("0", ("3g.40gb", "1g.10gb", "1g.10gb")),
    )
    # all-<profile>: as many as fit on an empty GPU (the profile's total)
    assert _mig_plan("all-2g.20gb", (_mig("0", "Enabled"),)).steps == (
        Repartition("0", ("2g.20gb", "2g.20gb", "2g.20gb")),
    )
    assert _mig_plan("all-2g.20gb", (_mig("0", "Enabled", ("2g.20gb",) * 3),)).converged
    assert Repartition("2", ("3g.40gb", "1g.10gb")).describe() == "partition GPU 2 as 3g.40gb+1g.10gb"
    assert Repartition("2", ()).describe() == "partition GPU 2 as nothing"
    assert SetMigMode("3", True).describe() == "turn MIG mode on on GPU 3"
    assert SetMigMode("3", False).describe() == "turn MIG mode off on GPU 3"


def test_HST_MIG_plan_all_disabled_destroys_instances_before_mode() -> None:
    from bcd_shared.units.mig import Repartition, SetMigMode

    assert _mig_plan("all-disabled", (_mig("0", "Enabled", ("7g.80gb",)), _mig("1", "Enabled"))).steps == (
        Repartition("0", ()),
        SetMigMode("0", False),
        SetMigMode("1", False),
    )
    assert _mig_plan("all-disabled", (_mig("0", "Disabled"),)).converged


def test_HST_MIG_plan_unknown_profile_is_terminal_and_plans_nothing() -> None:
    p = _mig_plan("mixed:4g.40gb", (_mig("0", "Disabled"), _mig("1", "Enabled")))
    assert p.steps == ()
    assert p.issues == (Issue("terminal", "mig-layout: GPU 1 has no MIG profile 4g.40gb"),)


def test_HST_MIG_plan_busy_gpus_left_alone_others_repartitioned() -> None:
    from bcd_shared.units.mig import Repartition

    gpus = (_mig("0", "Enabled", uuid="GPU-a"), _mig("1", "Enabled", uuid="GPU-b"), _mig("2", "Enabled"))
    p = _mig_plan("all-7g.80gb", gpus, frozenset({"GPU-a", "GPU-b"}))
    assert p.steps == (Repartition("2", ("7g.80gb",)),)
    assert p.issues == (
        Issue(
            "retryable",
            "mig-layout: GPU-a, GPU-b hold allocations; they are repartitioned once those end",
        ),
    )
    # a busy GPU already at the layout is converged; a busy GPU whose profile is unknown stays busy
    at = (_mig("0", "Enabled", ("7g.80gb",), uuid="GPU-a"),)
    assert _mig_plan("all-7g.80gb", at, frozenset({"GPU-a"})).converged
    p = _mig_plan("mixed:4g.40gb", (_mig("0", "Enabled", uuid="GPU-a"),), frozenset({"GPU-a"}))
    assert p.steps == () and p.issues[0].kind == "retryable"


def test_HST_MIG_plan_without_an_answer_and_without_a_layout() -> None:
    from bcd_shared.units.mig import MigObserved

    assert _mig_plan("all-1g.10gb", None).issues == (
        Issue("retryable", "mig-layout: nvidia-smi does not answer yet (is the driver loaded?)"),
    )
    unit = REGISTRY["mig-layout"]
    none = unit.decode_settings('{"from": "profile", "layout": ""}')
    assert unit.plan(none, MigObserved(None, frozenset())).converged
    assert unit.plan(None, MigObserved(None, frozenset())).converged


# -- nvidia-driver, fabric-manager


@pytest.mark.parametrize("branch", ["58", "5800", "5a0", " 580", "580\n", "٥٨٠", ""])
def test_HST_DRV_01_branch_refused_naming_the_rule(branch: str) -> None:
    assert refusal("nvidia-driver", {"branch": branch}) == f"branch: {branch!r} does not match ^[0-9]{{3}}$"


def test_HST_DRV_01_02_driver_settings_decoded() -> None:
    from bcd_shared.units.nvidia import DriverSettings

    assert decoded("nvidia-driver", {"branch": "580"}) == DriverSettings("580", None)
    assert decoded("nvidia-driver", {"branch": "570", "open": False}) == DriverSettings("570", False)
    assert refusal("nvidia-driver", {}) == "branch: required"
    assert refusal("nvidia-driver", {"branch": "580", "opn": True}) == "opn: unknown field"
    assert refusal("fabric-manager", {"x": 1}) == "x: unknown field"


def test_HST_DRV_driver_versions_parsed_from_real_formats() -> None:
    from bcd_shared.units.nvidia import DriverVersion, parse_modinfo, parse_proc_version

    proc = (
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.82.07  Release Build  "
        "(dvs-builder@U16-I3-B03-4-3)  Wed Sep 10 2025\nGCC version:  gcc version 12.2.0\n"
    )
    assert parse_proc_version(proc) == DriverVersion("580.82.07", "580", True)
    prop = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.124.06  Thu Apr 3 2025\n"
    assert parse_proc_version(prop) == DriverVersion("570.124.06", "570", False)
    assert parse_proc_version("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54  x\n") == DriverVersion(
        "550.54", "550", False
    )
    assert parse_proc_version(None) is None and parse_proc_version("") is None
    assert parse_proc_version("NVRM version: none here\n580.1.2\n") is None  # the first line only
    modinfo = "filename: /lib/modules/nvidia.ko\nversion:        580.82.07\nlicense:        Dual MIT/GPL\n"
    assert parse_modinfo(modinfo) == DriverVersion("580.82.07", "580", True)
    assert parse_modinfo("version: 570.124.06\nlicense: NVIDIA\nversion: 999.1\n") == DriverVersion(
        "570.124.06", "570", False
    )
    assert parse_modinfo("version: 580\n") is None and parse_modinfo("license: NVIDIA\n") is None
    assert parse_modinfo("version: 580.82.07x\n") is None


def _driver_plan(
    settings: dict[str, Any],
    family: str,
    installed: Any,
    loaded: Any,
    pers: tuple[bool, bool] = (False, False),
) -> Any:
    from bcd_shared.units.distro import Distro
    from bcd_shared.units.nvidia import DriverObserved

    unit = REGISTRY["nvidia-driver"]
    distro = Distro(
        {"ubuntu": "ubuntu", "debian": "debian", "rhel": "rocky", "suse": "sles"}.get(family, "arch"),
        "1",
        family,  # type: ignore[arg-type]
    )
    return unit.plan(
        unit.decode_settings(json.dumps(settings)), DriverObserved(distro, installed, loaded, *pers)
    )


APT_INSTALL = ("env", "DEBIAN_FRONTEND=noninteractive", "apt-get", "install", "-y", "--no-install-recommends",
               "-o", "Dpkg::Options::=--force-confold")  # fmt: skip
APT_UPDATE = ("apt-get", "update")
ZYPPER = ("zypper", "--non-interactive", "install")
UTILS = "nvidia-utils-580-server"


@pytest.mark.parametrize(
    ("family", "open_", "commands"),
    [
        ("ubuntu", True, [APT_UPDATE, (*APT_INSTALL, "nvidia-headless-580-server-open", UTILS)]),
        ("ubuntu", False, [APT_UPDATE, (*APT_INSTALL, "nvidia-headless-580-server", UTILS)]),
        ("debian", True, [APT_UPDATE, (*APT_INSTALL, "nvidia-open-580")]),
        ("debian", False, [APT_UPDATE, (*APT_INSTALL, "cuda-drivers-580")]),
        ("rhel", True, [("dnf", "-y", "install", "@nvidia-driver:580-open")]),
        ("rhel", False, [("dnf", "-y", "install", "@nvidia-driver:580-dkms")]),
        ("suse", True, [(*ZYPPER, "nvidia-open-driver-G06-signed-kmp-default", "nvidia-compute-utils-G06")]),
        ("suse", False, [(*ZYPPER, "nvidia-driver-G06-kmp-default", "nvidia-compute-utils-G06")]),
    ],
)  # fmt: skip
def test_HST_DRV_10_to_13_15_to_17_install_then_load(
    family: str, open_: bool, commands: list[tuple[str, ...]]
) -> None:
    from bcd_shared.units.nvidia import DriverVersion, LoadDriver

    p = _driver_plan({"branch": "580", "open": open_}, family, None, DriverVersion("570.1", "570", False))
    pkgs = " ".join(commands[-1][-2:] if family in ("ubuntu", "suse") else commands[-1][-1:])
    assert p.steps == (
        *(Run(argv, message=f"installing {pkgs}") for argv in commands),
        LoadDriver("580", open_, "570.1", family),
    )
    assert p.issues == ()


def test_HST_DRV_plan_loaded_installed_flavors_and_persistenced() -> None:
    from bcd_shared.units.nvidia import DriverVersion, LoadDriver

    open580 = DriverVersion("580.82.07", "580", True)
    prop580 = DriverVersion("580.82.07", "580", False)
    assert _driver_plan({"branch": "580"}, "ubuntu", open580, open580).converged
    assert _driver_plan({"branch": "580", "open": True}, "ubuntu", open580, open580).converged
    # installed but not loaded: load it, no install
    assert _driver_plan({"branch": "580"}, "ubuntu", prop580, None).steps == (
        LoadDriver("580", None, None, "ubuntu"),
    )
    # the loaded flavor differs: install the asked flavor, swap the loaded one
    p = _driver_plan({"branch": "580", "open": False}, "rhel", open580, open580)
    assert p.steps == (
        Run(
            ("dnf", "-y", "install", "@nvidia-driver:580-dkms"), message="installing @nvidia-driver:580-dkms"
        ),
        LoadDriver("580", False, "580.82.07", "rhel"),
    )
    start = Run(("systemctl", "enable", "--now", "nvidia-persistenced.service"))
    assert _driver_plan({"branch": "580"}, "ubuntu", open580, open580, (True, False)).steps == (start,)
    assert _driver_plan({"branch": "580"}, "ubuntu", open580, open580, (True, True)).converged
    assert _driver_plan({"branch": "580"}, "ubuntu", open580, open580, (False, False)).converged
    unknown = _driver_plan({"branch": "580"}, "unknown", None, None)
    assert unknown.steps == () and unknown.issues == (
        Issue("terminal", "bcd has no driver packages for arch"),
    )
    assert REGISTRY["nvidia-driver"].plan(None, None).converged
    assert LoadDriver("580", None, None).describe() == "load NVIDIA driver branch 580"


def _fm_plan(switches: int, family: str, loaded: Any, installed: bool, active: bool) -> Any:
    from bcd_shared.units.distro import Distro
    from bcd_shared.units.nvidia import FmObserved

    unit = REGISTRY["fabric-manager"]
    distro = Distro("x", "1", family)  # type: ignore[arg-type]
    return unit.plan(unit.decode_settings("{}"), FmObserved(switches, distro, loaded, installed, active))


def test_HST_FM_plan_install_enable_and_conditions() -> None:
    from bcd_shared.units._base import UnitCondition
    from bcd_shared.units.nvidia import DriverVersion

    down = (
        UnitCondition(
            "FabricManagerDown", "NotRunning", "nvidia-fabricmanager is not running on an NVSwitch host"
        ),
    )
    v = DriverVersion("580.82.07", "580", True)
    enable = Run(("systemctl", "enable", "--now", "nvidia-fabricmanager.service"))
    assert _fm_plan(0, "ubuntu", None, False, False).converged  # no NVSwitch: nothing to do
    running = _fm_plan(4, "ubuntu", v, True, True)
    assert running.converged and running.conditions == ()
    p = _fm_plan(4, "ubuntu", None, False, False)
    assert (p.steps, p.issues, p.conditions) == (
        (),
        (Issue("retryable", "fabric-manager: no NVIDIA driver is loaded yet"),),
        down,
    )
    p = _fm_plan(4, "debian", v, False, False)
    assert p.steps == (
        Run(("apt-get", "update"), message="installing nvidia-fabricmanager-580"),
        Run((*APT_INSTALL, "nvidia-fabricmanager-580"), message="installing nvidia-fabricmanager-580"),
        enable,
    )
    assert p.conditions == down and p.issues == ()
    p = _fm_plan(4, "rhel", v, False, False)
    assert p.steps == (
        Run(("dnf", "-y", "install", "nvidia-fabric-manager"), message="installing nvidia-fabric-manager"),
        enable,
    )
    assert _fm_plan(4, "suse", v, True, False).steps == (enable,)
    p = _fm_plan(4, "unknown", v, False, False)
    assert (p.steps, p.issues, p.conditions) == (
        (),
        (Issue("terminal", "bcd has no Fabric Manager package for x"),),
        down,
    )


# -- cpu


def _boot() -> Any:
    from bcd_shared.units.bootargs import BootloaderView

    return BootloaderView(True, False)


@pytest.mark.parametrize(
    ("isolate", "message"),
    [
        ("a", "isolate: 'a' is not a CPU or a range of CPUs"),
        ("4-", "isolate: '4-' is not a CPU or a range of CPUs"),
        ("-4", "isolate: '-4' is not a CPU or a range of CPUs"),
        ("4:2", "isolate: '4:2' is not a CPU or a range of CPUs"),
        ("1-8:2", "isolate: '1-8:2' is not a CPU or a range of CPUs"),  # no strides
        ("4,,5", "isolate: '' is not a CPU or a range of CPUs"),
        ("4 ,5", "isolate: '4 ' is not a CPU or a range of CPUs"),
        ("123456", "isolate: '123456' is not a CPU or a range of CPUs"),  # six digits
        ("5-4", "isolate: '5-4' runs backwards"),
        ("8192", "isolate: CPU 8192 is above 8191"),
        ("1-8192", "isolate: CPU 8192 is above 8191"),
        ("0", "isolate must not include CPU 0 (it keeps the host's housekeeping)"),
        ("2,0-1", "isolate must not include CPU 0 (it keeps the host's housekeeping)"),
    ],
)
def test_HST_CPU_02_04_05_isolate_refusals_word_for_word(isolate: str, message: str) -> None:
    assert refusal("cpu", {"isolate": isolate}) == message


def test_HST_CPU_01_02_03_isolate_and_governor_at_their_limits() -> None:
    from bcd_shared.units.cpu import CpuSettings, format_cpulist, isolation_args

    assert decoded("cpu", {"isolate": "8191"}).isolate == frozenset({8191})
    assert decoded("cpu", {"isolate": "1-1,3"}).isolate == frozenset({1, 3})
    assert decoded("cpu", {"isolate": " 4-5 "}).isolate == frozenset({4, 5})
    assert decoded("cpu", {"isolate": ""}) == CpuSettings(None, frozenset())
    at_limit = ",".join(["1"] * 128)[:255] + "1"  # 256 characters
    assert len(at_limit) == 256 and decoded("cpu", {"isolate": at_limit}).isolate == frozenset({1, 11})
    assert refusal("cpu", {"isolate": at_limit + "1"}) == "isolate: at most 256 characters, not 257"
    for g in ("performance", "schedutil", "ondemand", "powersave"):
        assert decoded("cpu", {"governor": g}).governor == g
    assert refusal("cpu", {"governor": "Performance"}) == (
        "governor: 'Performance' is not one of performance, schedutil, ondemand, powersave"
    )
    assert refusal("cpu", {"governor": "performance", "isolated": "1"}) == "isolated: unknown field"
    assert format_cpulist(frozenset({1, 2, 3, 5, 7, 8})) == "1-3,5,7-8"
    assert format_cpulist(frozenset({9})) == "9" and format_cpulist(frozenset()) == ""
    assert isolation_args(frozenset({4, 5, 6, 9})) == (
        "isolcpus=managed_irq,domain,4-6,9 nohz_full=4-6,9 rcu_nocbs=4-6,9"
    )
    assert isolation_args(frozenset()) == ""


def _cpu_plan(settings: dict[str, Any] | None, cpus: Any, isolated: str, recorded: str | None) -> Any:
    from bcd_shared.units.cpu import CpuObserved, parse_cpulist

    unit = REGISTRY["cpu"]
    s = None if settings is None else unit.decode_settings(json.dumps(settings))
    observed = CpuObserved(tuple(cpus), parse_cpulist(isolated), isolated, recorded, _boot())
    return unit.plan(s, observed)


def test_HST_CPU_plan_governor_per_cpu_and_refusal_naming_the_cpu() -> None:
    from bcd_shared.units._base import WriteKernel
    from bcd_shared.units.cpu import CpuView

    both = ("performance", "powersave")
    cpus = [
        CpuView("cpu0", "powersave", both),
        CpuView("cpu1", "performance", both),
        CpuView("cpu2", "x", both),
    ]
    p = _cpu_plan({"governor": "performance"}, cpus, "", None)
    assert p.steps == (
        WriteKernel("/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor", "performance"),
        WriteKernel("/sys/devices/system/cpu/cpu2/cpufreq/scaling_governor", "performance"),
    )
    assert p.issues == ()
    lacking = [CpuView("cpu0", "powersave", both), CpuView("cpu1", "powersave", ("powersave",))]
    p = _cpu_plan({"governor": "schedutil"}, lacking, "", None)
    assert p.steps == () and p.issues == (
        Issue(
            "terminal", "cpu: governor schedutil is not offered by cpu0 (it offers: performance powersave)"
        ),
    )
    p = _cpu_plan(
        {"governor": "performance"}, [CpuView("cpu0", "x", ()), CpuView("cpu3", "x", both)], "", None
    )
    assert p.issues == (
        Issue("terminal", "cpu: governor performance is not offered by cpu0 (it offers: none)"),
    )
    assert _cpu_plan({"governor": "performance"}, [], "", None).converged  # no cpufreq: converged


def test_HST_CPU_plan_isolation_boot_args_and_reboot_wait() -> None:
    from bcd_shared.units.bootargs import SetBootArgs

    args = "isolcpus=managed_irq,domain,4-5 nohz_full=4-5 rcu_nocbs=4-5"
    record = "/var/lib/bcd-hostconfig/bootargs/cpu"
    dropin = "/etc/default/grub.d/90-bcd-cpu.cfg"
    p = _cpu_plan({"isolate": "4,5"}, [], "", None)
    assert p.steps == (SetBootArgs("cpu", dropin, record, "", args, args, _boot()),)
    assert p.issues == (
        Issue("reboot", 'cpu: CPUs 4-5 are isolated from the next boot (now: ""): reboot the node'),
    )
    p = _cpu_plan({"isolate": "4-5"}, [], "4", args)
    assert p.steps == () and p.issues == (
        Issue("reboot", 'cpu: CPUs 4-5 are isolated from the next boot (now: "4"): reboot the node'),
    )
    assert _cpu_plan({"isolate": "4-5"}, [], "4-5", args).converged
    assert _cpu_plan({"isolate": "4-5"}, [], "4-6", args).issues[0].kind == "reboot"  # HST-CPU-17: exactly
    # no isolation asked (or the unit left the spec): the earlier arguments are removed, no wait
    for settings in ({}, None, {"isolate": ""}):
        p = _cpu_plan(settings, [], "4-5", args)
        assert p.steps == (SetBootArgs("cpu", dropin, record, args, "", "", _boot()),) and p.issues == ()
    assert _cpu_plan(None, [], "", None).converged


# -- iommu


def _iommu_plan(
    settings: dict[str, Any] | None, vendor: str | None, iommus: tuple[str, ...], recorded: str | None
) -> Any:
    from bcd_shared.units.iommu import IommuObserved

    unit = REGISTRY["iommu"]
    s = None if settings is None else unit.decode_settings(json.dumps(settings))
    return unit.plan(s, IommuObserved(vendor, iommus, recorded, _boot()))


@pytest.mark.parametrize(
    ("vendor", "passthrough", "args"),
    [
        ("GenuineIntel", True, "intel_iommu=on iommu=pt"),
        ("GenuineIntel", False, "intel_iommu=on"),
        ("AuthenticAMD", True, "amd_iommu=on iommu=pt"),
        ("HygonGenuine", False, "amd_iommu=on"),
        (None, True, "iommu=pt"),
        (None, False, ""),
    ],
)
def test_HST_IOMMU_plan_arguments_per_vendor(vendor: str | None, passthrough: bool, args: str) -> None:
    from bcd_shared.units.bootargs import SetBootArgs

    rec, drop = "/var/lib/bcd-hostconfig/bootargs/iommu", "/etc/default/grub.d/90-bcd-iommu.cfg"
    p = _iommu_plan({"passthrough": passthrough}, vendor, (), None)
    assert p.steps == ((SetBootArgs("iommu", drop, rec, "", args, args, _boot()),) if args else ())
    assert p.issues == (
        Issue(
            "reboot",
            f"iommu: the IOMMU is on from the next boot ({args}): reboot the node; "
            "check the firmware enables VT-d or AMD-Vi",
        ),
    )
    assert _iommu_plan({"passthrough": passthrough}, vendor, ("dmar0",), args or None).converged


def test_HST_IOMMU_settings_vendor_and_clean_up() -> None:
    from bcd_shared.units.bootargs import SetBootArgs
    from bcd_shared.units.iommu import IommuSettings, vendor_of

    assert decoded("iommu", {}) == IommuSettings(True)
    assert decoded("iommu", {"passthrough": False}) == IommuSettings(False)
    assert refusal("iommu", {"passthrough": 1}) == "passthrough: must be true or false"
    assert refusal("iommu", {"pt": True}) == "pt: unknown field"
    p = _iommu_plan({}, "CentaurHauls", (), None)
    assert p.steps == () and p.issues == (
        Issue("terminal", "iommu: CPU vendor CentaurHauls is not one bcd knows"),
    )
    rec, drop = "/var/lib/bcd-hostconfig/bootargs/iommu", "/etc/default/grub.d/90-bcd-iommu.cfg"
    prev = "intel_iommu=on iommu=pt"
    assert _iommu_plan(None, "GenuineIntel", ("dmar0",), prev).steps == (
        SetBootArgs("iommu", drop, rec, prev, "", "", _boot()),
    )
    assert _iommu_plan(None, "GenuineIntel", (), None).converged
    # a changed setting replaces what was recorded
    assert _iommu_plan({"passthrough": False}, "GenuineIntel", ("dmar0",), prev).steps == (
        SetBootArgs("iommu", drop, rec, prev, "intel_iommu=on", "intel_iommu=on", _boot()),
    )
    cpuinfo = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nvendor_id : GenuineIntel\n"
    assert vendor_of(cpuinfo) == "AuthenticAMD"
    assert vendor_of("processor : 0\nvendor_idx : x\nvendor_id\n") is None


# -- hugepages

POOL = "/sys/kernel/mm/hugepages/hugepages-{}/nr_hugepages"
NODE_POOL = "/sys/devices/system/node/node{}/hugepages/hugepages-{}/nr_hugepages"


def test_HST_HP_01_02_03_settings_at_their_limits() -> None:
    """perNuma's type is refused here too; what it means is asserted by the plan test of the 2 MiB pools
    global and per NUMA node."""
    from bcd_shared.units.hugepages import HugepagesSettings

    assert decoded("hugepages", {"pages2m": 16777216, "pages1g": 0}) == HugepagesSettings(16777216, 0)
    assert decoded("hugepages", {"pages2m": 0, "pages1g": 16777216}) == HugepagesSettings(0, 16777216)
    assert refusal("hugepages", {"pages2m": 16777217}) == "pages2m: 16777217 is outside 0 to 16777216"
    assert refusal("hugepages", {"pages1g": -1}) == "pages1g: -1 is outside 0 to 16777216"
    assert refusal("hugepages", {"pages1g": 2.5}) == "pages1g: must be a whole number"
    for thp in ("always", "madvise", "never"):
        assert decoded("hugepages", {"transparent": thp}) == HugepagesSettings(None, None, thp, False)
    assert decoded(
        "hugepages", {"pages2m": 4.0, "perNuma": True, "transparent": "never"}
    ) == HugepagesSettings(4, None, "never", True)
    assert decoded("hugepages", {}) == HugepagesSettings(None, None, None, False)
    assert refusal("hugepages", {"pages1g": 16777217}) == "pages1g: 16777217 is outside 0 to 16777216"
    assert refusal("hugepages", {"pages2m": -1}) == "pages2m: -1 is outside 0 to 16777216"
    assert refusal("hugepages", {"pages2m": 1.5}) == "pages2m: must be a whole number"
    assert refusal("hugepages", {"pages2m": True}) == "pages2m: must be a whole number"
    assert refusal("hugepages", {"pages2m": "4"}) == "pages2m: must be a whole number"
    assert refusal("hugepages", {"transparent": "Always"}) == (
        "transparent: 'Always' is not one of always, madvise, never"
    )
    assert refusal("hugepages", {"perNuma": "true"}) == "perNuma: must be true or false"


def _hp_observed(**kw: Any) -> Any:
    from bcd_shared.units.hugepages import HugepagesObserved

    base: dict[str, Any] = {
        "has_1g": True,
        "thp": "madvise",
        "numa_nodes": (0, 1),
        "counts": (),
        "boot_record": None,
        "bootloader": _boot(),
        "systemd": True,
        "mount_unit": None,
        "mounted": False,
        "mount_enabled": False,
    }
    return HugepagesObserved(**{**base, **kw})


def _hp_plan(settings: dict[str, Any] | None, **kw: Any) -> Any:
    unit = REGISTRY["hugepages"]
    s = None if settings is None else unit.decode_settings(json.dumps(settings))
    return unit.plan(s, _hp_observed(**kw))


def test_HST_HP_19_20_21_kernel_lacks_are_terminal_together() -> None:
    p = _hp_plan(
        {"pages1g": 1, "transparent": "never", "perNuma": True}, has_1g=False, thp=None, numa_nodes=()
    )
    assert p.steps == () and p.issues == (
        Issue("terminal", "this kernel has no 1 GiB huge pages (no hugepages-1048576kB)"),
        Issue("terminal", "this kernel has no transparent huge pages"),
        Issue("terminal", "perNuma: this kernel shows no NUMA nodes"),
    )
    # pages1g 0 needs no 1 GiB support; an unset transparent needs no THP
    assert _hp_plan({"pages1g": 0, "pages2m": 0}, has_1g=False, thp=None, counts=(
        (POOL.format("2048kB"), 0), (POOL.format("1048576kB"), 0))).converged  # fmt: skip
    assert _hp_plan(None, has_1g=False).converged  # HST-RMV-04: nothing is undone


def test_HST_HP_04_plan_thp_and_2m_pools_global_and_per_numa() -> None:
    """perNuma is a boolean, and with it the count is each NUMA node's (only node 1 is short here),
    without it the host total's."""
    from bcd_shared.units._base import WriteKernel
    from bcd_shared.units.hugepages import Set2MPages

    assert refusal("hugepages", {"perNuma": 1}) == "perNuma: must be true or false"

    thp = "/sys/kernel/mm/transparent_hugepage/enabled"
    p = _hp_plan({"transparent": "never", "pages2m": 64}, counts=((POOL.format("2048kB"), 32),))
    assert p.steps == (WriteKernel(thp, "never"), Set2MPages(POOL.format("2048kB"), 64))
    assert _hp_plan(
        {"transparent": "madvise", "pages2m": 64}, counts=((POOL.format("2048kB"), 64),)
    ).converged
    counts = (
        (NODE_POOL.format(0, "2048kB"), 64),
        (NODE_POOL.format(1, "2048kB"), 0),
        (POOL.format("2048kB"), 64),
    )
    assert _hp_plan({"pages2m": 64, "perNuma": True}, counts=counts).steps == (
        Set2MPages(NODE_POOL.format(1, "2048kB"), 64),
    )
    assert Set2MPages("/p", 3).describe() == "set /p to 3"


def test_HST_HP_plan_1g_mount_pages_and_boot_reservation() -> None:
    """Covers HST-HP-24: the mount unit is written, then `daemon-reload`, then `enable` (an enable
    alone when only that is missing), as the plan's exact steps."""
    from bcd_shared.units.bootargs import SetBootArgs
    from bcd_shared.units.hugepages import Set1GPages, mount_unit_text

    unit_path = "/etc/systemd/system/dev-hugepages1G.mount"
    record, dropin = "/var/lib/bcd-hostconfig/hugepages-1g-boot", "/etc/default/grub.d/90-bcd-hugepages.cfg"
    g1 = POOL.format("1048576kB")
    p = _hp_plan({"pages1g": 4}, counts=((g1, 1),))
    assert p.steps == (
        WriteFile(unit_path, mount_unit_text()),
        Run(("systemctl", "daemon-reload")),
        Run(("systemctl", "enable", "dev-hugepages1G.mount")),
        Run(("systemctl", "start", "dev-hugepages1G.mount")),
        Set1GPages(((g1, 4),), 4, "", _boot()),
    )
    done = {"mount_unit": mount_unit_text(), "mounted": True, "mount_enabled": True}
    assert _hp_plan({"pages1g": 4}, counts=((g1, 4),), **done).converged
    assert _hp_plan({"pages1g": 4}, counts=((g1, 4),), **{**done, "mount_enabled": False}).steps == (
        Run(("systemctl", "enable", "dev-hugepages1G.mount")),
    )
    # without systemd: mkdir and mount
    assert _hp_plan({"pages1g": 4}, counts=((g1, 4),), systemd=False).steps == (
        Run(("mkdir", "-p", "/dev/hugepages1G")),
        Run(("mount", "-t", "hugetlbfs", "-o", "pagesize=1G", "hugetlbfs", "/dev/hugepages1G")),
    )
    assert _hp_plan({"pages1g": 4}, counts=((g1, 4),), systemd=False, mounted=True).converged
    # per NUMA node: the boot reservation is the total over nodes
    counts = ((NODE_POOL.format(0, "1048576kB"), 2), (NODE_POOL.format(1, "1048576kB"), 0))
    assert _hp_plan({"pages1g": 2, "perNuma": True}, counts=counts, **done).steps == (
        Set1GPages(((NODE_POOL.format(1, "1048576kB"), 2),), 4, "", _boot()),
    )
    # HST-HP-17/18: the reservation follows the count once the pages are there; 0 removes it
    prev = "hugepagesz=1G hugepages=8"
    assert _hp_plan({"pages1g": 4}, counts=((g1, 4),), boot_record=prev, **done).steps == (
        SetBootArgs(
            "hugepages",
            dropin,
            record,
            prev,
            "hugepagesz=1G hugepages=4",
            "hugepagesz=1G hugepages=4",
            _boot(),
        ),
    )
    assert _hp_plan({"pages1g": 0}, counts=((g1, 0),), boot_record=prev).steps == (
        SetBootArgs("hugepages", dropin, record, prev, "", "", _boot()),
    )
    assert _hp_plan(
        {"pages1g": 4}, counts=((g1, 4),), boot_record="hugepagesz=1G hugepages=4", **done
    ).converged
    assert _hp_plan({"pages1g": 0}, counts=((g1, 0),)).converged  # no mount for 0 pages
    assert Set1GPages(((g1, 4), ("/q", 2)), 6, "", _boot()).describe() == f"set 1 GiB pages ({g1}=4, /q=2)"


def test_HST_HP_mount_unit_rendered_exactly() -> None:
    from bcd_shared.units.hugepages import boot_args, mount_unit_text, pool_path

    assert mount_unit_text().decode() == (
        HEAD.format(unit="hugepages") + "[Unit]\n"
        "Description=Huge pages of 1 GiB for VMMs (bcd hugepages unit)\n"
        "DefaultDependencies=no\nBefore=sysinit.target\n"
        "ConditionPathExists=/sys/kernel/mm/hugepages/hugepages-1048576kB\n\n"
        "[Mount]\nWhat=hugetlbfs\nWhere=/dev/hugepages1G\nType=hugetlbfs\nOptions=pagesize=1G\n\n"
        "[Install]\nWantedBy=sysinit.target\n"
    )
    assert boot_args(0) == "" and boot_args(3) == "hugepagesz=1G hugepages=3"
    assert pool_path("1g", None) == POOL.format("1048576kB")
    assert pool_path("2m", 3) == NODE_POOL.format(3, "2048kB")


# -- gpu-settings


def _gpus_plan(settings: dict[str, Any] | None, gpus: Any) -> Any:
    from bcd_shared.units.gpusettings import GpuSettingsObserved

    unit = REGISTRY["gpu-settings"]
    s = None if settings is None else unit.decode_settings(json.dumps(settings))
    return unit.plan(s, GpuSettingsObserved(gpus))


def _gpu(index: str, limit: float | None, ecc: tuple[str, str] = ("Enabled", "Enabled")) -> Any:
    from bcd_shared.units.gpusettings import GpuPower

    return GpuPower(index, limit, 100.0 if limit is not None else None, 700.0, *ecc)


def test_HST_GPUS_settings_at_their_limits() -> None:
    from bcd_shared.units.gpusettings import GpuSettingsSettings

    assert decoded("gpu-settings", {"powerLimitWatts": 1, "ecc": False}) == GpuSettingsSettings(1, False)
    assert decoded("gpu-settings", {"powerLimitWatts": 10000}) == GpuSettingsSettings(10000, None)
    assert refusal("gpu-settings", {"powerLimitWatts": 0}) == "powerLimitWatts: 0 is outside 1 to 10000"
    assert (
        refusal("gpu-settings", {"powerLimitWatts": 10001}) == "powerLimitWatts: 10001 is outside 1 to 10000"
    )
    assert refusal("gpu-settings", {"ecc": "on"}) == "ecc: must be true or false"
    assert refusal("gpu-settings", {"power": 1}) == "power: unknown field"


def test_HST_GPUS_plan_power_limits_within_each_gpus_range() -> None:
    def pl(i: str, w: int) -> Run:
        return Run(("nvidia-smi", "-i", i, "-pl", str(w)), message=f"setting GPU {i}'s power limit")

    # a limit within 1 W of the setting counts as set (nvidia-smi shows fractions of a watt)
    gpus = (_gpu("0", 700.0), _gpu("1", 450.5), _gpu("2", None), _gpu("3", 699.0), _gpu("4", 699.5))
    assert _gpus_plan({"powerLimitWatts": 700}, gpus).steps == (pl("1", 700), pl("3", 700))
    assert _gpus_plan({"powerLimitWatts": 100}, (_gpu("0", 100.0),)).converged  # at the minimum
    p = _gpus_plan({"powerLimitWatts": 701}, gpus)
    assert p.steps == () and p.issues == (Issue("terminal", "GPU 0 takes 100 to 700 W, not 701"),)
    p = _gpus_plan({"powerLimitWatts": 99}, gpus)
    assert p.issues == (Issue("terminal", "GPU 0 takes 100 to 700 W, not 99"),)
    assert _gpus_plan({"powerLimitWatts": 300}, (_gpu("0", None),)).converged  # HST-GPUS-09
    assert _gpus_plan({"powerLimitWatts": 300}, None).issues == (
        Issue("retryable", "gpu-settings: nvidia-smi does not answer yet (is the driver loaded?)"),
    )
    assert _gpus_plan({}, None).converged and _gpus_plan(None, None).converged


def test_HST_GPUS_plan_ecc_pending_and_reboot_wait() -> None:
    def e(i: str, v: str) -> Run:
        return Run(("nvidia-smi", "-i", i, "-e", v))

    gpus = (
        _gpu("0", None, ("Enabled", "Enabled")),
        _gpu("1", None, ("Enabled", "Disabled")),  # already pending
        _gpu("2", None, ("Disabled", "Enabled")),
        _gpu("3", None, ("[N/A]", "[N/A]")),  # HST-GPUS-11: no ECC
    )
    p = _gpus_plan({"ecc": False}, gpus)
    assert p.steps == (e("0", "0"), e("2", "0"))
    assert p.issues == (
        Issue(
            "reboot", "gpu-settings: the ECC mode of GPU(s) 0,1 changes at their next reset: reboot the node"
        ),
    )
    p = _gpus_plan({"ecc": True}, gpus)
    assert p.steps == (e("1", "1"),)
    assert p.issues == (
        Issue(
            "reboot", "gpu-settings: the ECC mode of GPU(s) 2 changes at their next reset: reboot the node"
        ),
    )
    assert _gpus_plan({"ecc": True}, (gpus[0], gpus[3])).converged


# -- gpu-sharing


def _share_plan(settings: dict[str, Any] | None, mps: bool, unit_file: bytes | None, active: bool) -> Any:
    from bcd_shared.units.sharing import SharingObserved

    unit = REGISTRY["gpu-sharing"]
    s = None if settings is None else unit.decode_settings(json.dumps(settings))
    return unit.plan(s, SharingObserved(mps, unit_file, active))


def test_HST_SHARE_settings_and_service_text() -> None:
    from bcd_shared.units.sharing import SharingSettings, service_text, thread_percentage

    assert decoded("gpu-sharing", {"mode": "mps"}) == SharingSettings("mps", 10)
    assert decoded("gpu-sharing", {"mode": "timeslice", "replicas": 48}) == SharingSettings("timeslice", 48)
    assert decoded("gpu-sharing", {"mode": "mps", "replicas": 1}) == SharingSettings("mps", 1)
    assert refusal("gpu-sharing", {}) == "mode: required (mps or timeslice)"
    assert refusal("gpu-sharing", {"mode": "mps", "replicas": 49}) == "replicas: 49 is outside 1 to 48"
    assert refusal("gpu-sharing", {"mode": "MPS"}) == "mode: 'MPS' is not one of mps, timeslice"
    assert [thread_percentage(n) for n in (1, 3, 48)] == [100, 33, 2]
    assert service_text(3).decode() == (
        HEAD.format(unit="gpu-sharing") + "[Unit]\n"
        "Description=NVIDIA MPS control daemon (bcd gpu-sharing unit)\n"
        "After=nvidia-persistenced.service\n\n[Service]\nType=forking\n"
        "Environment=CUDA_MPS_PIPE_DIRECTORY=/run/nvidia-mps\n"
        "Environment=CUDA_MPS_LOG_DIRECTORY=/var/log/nvidia-mps\n"
        "ExecStartPre=/usr/bin/nvidia-smi -c EXCLUSIVE_PROCESS\n"
        "ExecStart=/usr/bin/nvidia-cuda-mps-control -d\n"
        "ExecStartPost=/bin/sh -c "
        "'echo set_default_active_thread_percentage 33 | /usr/bin/nvidia-cuda-mps-control'\n"
        "ExecStop=/bin/sh -c 'echo quit | /usr/bin/nvidia-cuda-mps-control'\n"
        "ExecStopPost=/usr/bin/nvidia-smi -c DEFAULT\nRestart=on-failure\nRestartSec=5\n\n"
        "[Install]\nWantedBy=multi-user.target\n"
    )


def test_HST_SHARE_plan_mps_service_and_removal() -> None:
    """Covers HST-SHARE-05, HST-SHARE-06 and HST-SHARE-13 on the plan: the exact steps of a changed unit
    and of an inactive one; MPSDown (reason NotRunning) in a pass that starts the service, restarts it
    for a new unit, or waits for the control daemon, and none once it runs unchanged."""
    from bcd_shared.units._base import UnitCondition
    from bcd_shared.units.sharing import service_text

    down = (UnitCondition("MPSDown", "NotRunning", "bcd-mps.service is not active: MPS clients fail"),)
    path = "/etc/systemd/system/bcd-mps.service"
    p = _share_plan({"mode": "mps", "replicas": 4}, True, b"old", True)
    assert p.steps == (
        WriteFile(path, service_text(4)),
        Run(("systemctl", "daemon-reload")),
        Run(("systemctl", "enable", "bcd-mps.service")),
        Run(("systemctl", "restart", "bcd-mps.service")),
    )
    assert p.conditions == down and p.issues == ()
    p = _share_plan({"mode": "mps", "replicas": 4}, True, service_text(4), False)
    assert p.steps == (Run(("systemctl", "start", "bcd-mps.service")),) and p.conditions == down
    p = _share_plan({"mode": "mps", "replicas": 4}, True, service_text(4), True)
    assert p.converged and p.conditions == ()
    p = _share_plan({"mode": "mps"}, False, None, False)
    assert p.steps == () and p.conditions == down
    assert p.issues == (
        Issue("retryable", "gpu-sharing: nvidia-cuda-mps-control is not installed yet (driver utilities)"),
    )
    removal = (
        Run(("systemctl", "disable", "--now", "bcd-mps.service")),
        RemoveFile(path),
        Run(("systemctl", "daemon-reload")),
    )
    assert _share_plan({"mode": "timeslice"}, False, b"x", True).steps == removal
    assert _share_plan(None, False, b"x", False).steps == removal
    assert _share_plan({"mode": "timeslice"}, False, None, False).converged


# -- container-toolkit


def _ctk_plan(settings: dict[str, Any] | None, **kw: Any) -> Any:
    from bcd_shared.units.distro import Distro
    from bcd_shared.units.toolkit import ToolkitObserved

    base: dict[str, Any] = {
        "distro": Distro("ubuntu", "24.04", "ubuntu"),
        "ctk": True,
        "unconfigured": (),
        "ctk_config": CTK_DONE,
        "stamp_now": "s1",
        "stamp_recorded": "s1",
        "cdi_json": True,
        "cdi_yaml": False,
    }
    unit = REGISTRY["container-toolkit"]
    s = None if settings is None else unit.decode_settings(json.dumps(settings))
    return unit.plan(s, ToolkitObserved(**{**base, **kw}))


CTK_DONE = (
    "[nvidia-container-runtime]\n"
    "  accept-nvidia-visible-devices-envvar-when-unprivileged = false\n"
    "accept-nvidia-visible-devices-as-volume-mounts=false\n"
)


def test_HST_CTK_settings_and_key_is_false() -> None:
    from bcd_shared.units.toolkit import ToolkitSettings, key_is_false, stamp_of

    assert decoded("container-toolkit", {}) == ToolkitSettings(True)
    assert decoded("container-toolkit", {"cdi": False}) == ToolkitSettings(False)
    assert refusal("container-toolkit", {"cdi": "no"}) == "cdi: must be true or false"
    key = "accept-nvidia-visible-devices-as-volume-mounts"
    assert key_is_false(f"x = 1\n  {key} = false  \n", key)
    assert not key_is_false(f"#{key} = false\n", key)
    assert not key_is_false(f"{key} = true\n", key)
    assert not key_is_false(f"{key} = falsey\n", key)
    assert not key_is_false(f"x{key} = false\n", key)
    assert stamp_of("580.1", "GPU 0: H100\n") == hashlib.sha256(b"580.1\nGPU 0: H100\n").hexdigest()


def test_HST_CTK_plan_install_configure_and_cdi() -> None:
    from bcd_shared.units.distro import Distro
    from bcd_shared.units.toolkit import GenerateCdi

    p = _ctk_plan({}, ctk=False, distro=Distro("rocky", "9", "rhel"))
    assert p.steps == (
        Run(
            ("dnf", "-y", "install", "nvidia-container-toolkit"),
            message="installing nvidia-container-toolkit",
        ),
    )
    p = _ctk_plan({}, ctk=False, distro=Distro("arch", "", "unknown"))
    assert p.steps == () and p.issues == (Issue("terminal", "bcd has no container toolkit package for arch"),)
    assert _ctk_plan({}).converged
    assert _ctk_plan(None, ctk=False).converged  # HST-RMV-03
    p = _ctk_plan(
        {}, unconfigured=("containerd", "docker"), ctk_config="", stamp_recorded=None, cdi_yaml=True
    )
    configure = ("nvidia-ctk", "runtime", "configure")
    unset = ("nvidia-ctk", "config", "--in-place", "--set")
    assert p.steps == (
        Run((*configure, "--runtime=containerd", "--cdi.enabled"), message="configuring containerd"),
        Run(("systemctl", "restart", "containerd.service")),
        Run((*configure, "--runtime=docker", "--cdi.enabled"), message="configuring docker"),
        Run(("systemctl", "restart", "docker.service")),
        Run((*unset, "accept-nvidia-visible-devices-envvar-when-unprivileged=false")),
        Run((*unset, "accept-nvidia-visible-devices-as-volume-mounts=false")),
        GenerateCdi("s1"),
        RemoveFile("/etc/cdi/nvidia.yaml"),
    )
    assert _ctk_plan({}, cdi_json=False).steps == (GenerateCdi("s1"),)
    p = _ctk_plan({}, stamp_now=None)
    assert p.steps == () and p.issues == (
        Issue("retryable", "container-toolkit: no NVIDIA driver is loaded yet to describe in CDI"),
    )
    # without CDI: the runtimes are configured without it, and nothing of CDI is planned
    p = _ctk_plan({"cdi": False}, unconfigured=("docker",), ctk_config="", stamp_now=None, cdi_yaml=True)
    assert p.steps == (
        Run(("nvidia-ctk", "runtime", "configure", "--runtime=docker"), message="configuring docker"),
        Run(("systemctl", "restart", "docker.service")),
    )
    assert p.issues == ()
    assert GenerateCdi("x").describe() == "generate /etc/cdi/nvidia.json"


# -- _base: strict decoding, steps, records


def test_HST_DEC_load_object_refusals_word_for_word() -> None:
    from bcd_shared.units._base import load_object

    assert load_object(b'  {"a": 1}\n ') == {"a": 1}
    assert load_object('\t{"a": [1, {"b": null}]}') == {"a": [1, {"b": None}]}
    with pytest.raises(TerminalError) as exc:
        load_object("")
    assert exc.value.message == "settings are not JSON: Expecting value at 0"
    with pytest.raises(TerminalError) as exc:
        load_object('  {"a": 1} x' + "y" * 60)
    assert exc.value.message == "trailing data after the settings object: " + repr("x" + "y" * 39)
    with pytest.raises(TerminalError) as exc:
        load_object('{"a": 1}  []')
    assert exc.value.message == "trailing data after the settings object: '[]'"
    for text in ("[]", "1", '"x"', "null"):
        with pytest.raises(TerminalError) as exc:
            load_object(text)
        assert exc.value.message == "settings must be a JSON object"
    for constant in ("NaN", "Infinity", "-Infinity"):
        with pytest.raises(TerminalError) as exc:
            load_object(f'{{"a": {constant}}}')
        assert exc.value.message == f"{constant} is not a JSON number bcd accepts"
    with pytest.raises(TerminalError) as exc:
        load_object('{"a": {"b": 1, "b": 2}}')
    assert (exc.value.reason, exc.value.message) == ("InvalidSettings", "b: appears twice")


def test_HST_DEC_fields_read_each_type_and_name_the_field() -> None:
    from bcd_shared.units._base import Fields

    f = Fields(
        {"s": "ab", "c": "x", "b": False, "i": 3.0, "l": ["a"], "m": {"z": "1", "a": "2"}, "r": [1]},
        prefix="p.",
    )
    assert f.string("s", pattern=r"^[a-b]+$", max_len=2) == "ab"
    assert f.choice("c", ("x", "y")) == "x"
    assert f.boolean("b") is False
    assert f.integer("i", 3, 3) == 3
    assert f.string_list("l", max_items=1, pattern="^a$", max_len=1) == ("a",)
    assert f.string_map("m", max_items=2) == (("a", "2"), ("z", "1"))
    assert f.raw("r") == [1]
    assert f.has("s") and not f.has("nope")
    assert f.string("nope") is None and f.boolean("nope") is None and f.integer("nope", 0, 1) is None
    assert f.string_list("nope", max_items=1) is None and f.string_map("nope", max_items=1) is None
    assert f.choice("nope", ("x",)) is None
    f.done()

    def fault(obj: dict[str, Any], read: Any) -> str:
        with pytest.raises(TerminalError) as exc:
            read(Fields(obj, prefix="p."))
        return exc.value.message

    assert fault({"s": 1}, lambda f: f.string("s")) == "p.s: must be a string"
    assert fault({"s": "abc"}, lambda f: f.string("s", max_len=2)) == "p.s: at most 2 characters, not 3"
    assert fault({"s": "a-"}, lambda f: f.string("s", pattern="^a+$")) == "p.s: 'a-' does not match ^a+$"
    assert (
        fault({"s": "b" * 100}, lambda f: f.string("s", pattern="^a$"))
        == f"p.s: {'b' * 80!r} does not match ^a$"
    )
    assert fault({"c": "z"}, lambda f: f.choice("c", ("x", "y"))) == "p.c: 'z' is not one of x, y"
    assert fault({"b": 0}, lambda f: f.boolean("b")) == "p.b: must be true or false"
    for bad in (True, 1.5, "1", [1]):
        assert fault({"i": bad}, lambda f: f.integer("i", 0, 9)) == "p.i: must be a whole number"
    assert fault({"i": 10}, lambda f: f.integer("i", 0, 9)) == "p.i: 10 is outside 0 to 9"
    assert fault({"i": -1}, lambda f: f.integer("i", 0, 9)) == "p.i: -1 is outside 0 to 9"
    assert fault({"l": "a"}, lambda f: f.string_list("l", max_items=1)) == "p.l: must be a list of strings"
    assert (
        fault({"l": ["a", "b"]}, lambda f: f.string_list("l", max_items=1)) == "p.l: at most 1 entries, not 2"
    )
    assert fault({"l": ["a", 2]}, lambda f: f.string_list("l", max_items=2)) == "p.l[1]: must be a string"
    assert fault({"l": ["a", "bb"]}, lambda f: f.string_list("l", max_items=2, max_len=1)) == (
        "p.l[1]: at most 1 characters, not 2"
    )
    assert fault({"m": []}, lambda f: f.string_map("m", max_items=1)) == "p.m: must be an object of strings"
    assert fault({"m": {"a": "1", "b": "2"}}, lambda f: f.string_map("m", max_items=1)) == (
        "p.m: at most 1 entries, not 2"
    )
    assert fault({"m": {"a": 1}}, lambda f: f.string_map("m", max_items=1)) == "p.m.a: must be a string"
    assert fault({"z": 1, "y": 2, "x": 3}, lambda f: (f.raw("x"), f.done())) == "p.y: unknown field"


def _result(rc: int, stdout: bytes = b"", stderr: bytes = b"") -> Any:
    from bcd_shared.system import CommandResult

    return CommandResult(("tool", "a"), rc, stdout, stderr)


def test_HST_LVL_tool_failures_checked_by_kind() -> None:
    from bcd_shared.errors import RetryableError
    from bcd_shared.units._base import RebootRequired, check

    check(_result(0, stderr=b"boom"), "terminal", "m")  # success whatever it says
    check(_result(1, stderr=b"x: Not Found\n"), "terminal", "m", ("Not Found",))
    check(_result(1, stdout=b"already gone"), "terminal", "m", ("gone",))  # stdout counts too
    with pytest.raises(TerminalError) as t:
        check(_result(2, stderr=b"bad thing\nmore"), "terminal", "setting it", ("Not Found",))
    assert (t.value.reason, t.value.message) == ("ToolFailed", "setting it: tool exited 2: bad thing")
    with pytest.raises(RetryableError) as r:
        check(_result(3), "retryable", "")
    assert type(r.value) is RetryableError
    assert (r.value.reason, r.value.message) == ("ToolFailed", "tool exited 3")
    with pytest.raises(RebootRequired) as b:
        check(_result(4, stderr=b"busy"), "reboot", "GPU busy")
    assert (b.value.reason, b.value.message) == ("RebootRequired", "GPU busy: reboot the node")
    with pytest.raises(RebootRequired) as b:
        check(_result(4), "reboot", "")
    assert b.value.message == "tool exited 4: reboot the node"
    assert RebootRequired("please reboot the node now").message == "please reboot the node now"


def test_issue_kinds_become_their_errors() -> None:
    from bcd_shared.errors import RetryableError
    from bcd_shared.units._base import RebootRequired

    t = Issue("terminal", "m").to_error()
    assert type(t) is TerminalError and (t.reason, t.message) == ("UnitRefused", "m")
    r = Issue("retryable", "m").to_error()
    assert type(r) is RetryableError and (r.reason, r.message) == ("UnitNotReady", "m")
    b = Issue("reboot", "m").to_error()
    assert type(b) is RebootRequired and (b.reason, b.message) == ("RebootRequired", "m: reboot the node")


def test_HST_LVL_07_records_and_headers(tmp_path: Any) -> None:
    from bcd_shared.system import LocalSystem
    from bcd_shared.units._base import header, json_record, read_json_record, read_text_record, text_record

    assert header("cpu") == HEAD.format(unit="cpu")
    assert (
        header("x", "//")
        == "// Written by bcd (x unit): local edits are replaced on the next converge pass.\n"
    )
    assert json_record("u", {"b": 1, "a": [2]}) == (
        b'{\n  "_comment": "Written by bcd (u unit): local edits are replaced on the next converge pass.",\n'
        b'  "b": 1,\n  "a": [\n    2\n  ]\n}\n'
    )
    assert text_record("u", "v 1") == (HEAD.format(unit="u") + "v 1\n").encode()
    system = LocalSystem(tmp_path)
    system.write_atomic("/r/a", json_record("u", {"k": 1}))
    system.write_atomic("/r/b", b"[1]")
    system.write_atomic("/r/c", b"{bad")
    system.write_atomic("/r/d", b"# c\n\n  one  \n# two\ntwo\n")
    assert read_json_record(system, "/r/a") == {"_comment": HEAD.format(unit="u")[2:-1], "k": 1}
    assert read_json_record(system, "/r/b") is None and read_json_record(system, "/r/c") is None
    assert read_json_record(system, "/r/none") is None
    assert read_text_record(system, "/r/d") == "one two"
    assert read_text_record(system, "/r/none") is None


# -- _unit: the one-unit runner


class _Step:
    """A step that records itself in the stand-in unit's host state, or raises what it is told to."""

    def __init__(self, name: str, fail: Exception | None = None) -> None:
        self.name, self.fail = name, fail

    def describe(self) -> str:
        return f"step {self.name}"

    def apply(self, system: Any, actx: Any) -> None:
        system.done.append(self.name)
        if self.fail is not None:
            raise self.fail


class _Host:
    def __init__(self) -> None:
        self.done: list[str] = []


def _unit(plans: list[Any], rounds: int = 3) -> Any:
    """A stand-in unit whose plans come from a script, one per observe-plan round (the last repeats)."""
    from bcd_shared.units import ConfigUnit

    class Scripted(ConfigUnit[str, int]):
        name = "scripted"
        max_rounds = rounds
        validated: list[str] = []

        def decode(self, obj: dict[str, Any]) -> str:
            return "s"

        def validate(self, settings: str, ctx: Any) -> None:
            self.validated.append(settings)
            if settings == "refuse":
                raise TerminalError("InvalidSettings", "not allowed here")

        def observe(self, system: Any, settings: str | None, ctx: Any) -> int:
            return len(system.done)

        def plan(self, settings: str | None, observed: int) -> Any:
            return plans[min(self.calls(), len(plans) - 1)]

        def calls(self) -> int:
            self.n = getattr(self, "n", -1) + 1
            return self.n

    return Scripted()


def _converge(unit: Any, settings: str | None = "s") -> tuple[Any, _Host]:
    from bcd_shared.units import ApplyContext, UnitContext, converge_unit

    host = _Host()
    return converge_unit(unit, settings, host, UnitContext(), ApplyContext()), host  # type: ignore[arg-type]


def test_HST_LVL_converge_applies_then_plans_again() -> None:
    from bcd_shared.units import Plan, UnitResult

    r, host = _converge(_unit([Plan((_Step("a"), _Step("b"))), Plan()]))
    assert r == UnitResult("scripted", True, (), (), ("step a", "step b")) and r.ok
    assert host.done == ["a", "b"]
    r, host = _converge(_unit([Plan()]))
    assert r == UnitResult("scripted", False) and host.done == []


def test_HST_LVL_terminal_issue_applies_nothing_and_is_prefixed() -> None:
    from bcd_shared.units import Plan, UnitResult

    plan = Plan((_Step("a"),), (Issue("terminal", "bad"), Issue("retryable", "scripted: later")))
    r, host = _converge(_unit([plan]))
    assert host.done == [] and not r.ok
    assert r == UnitResult(
        "scripted", False, (Issue("terminal", "scripted: bad"), Issue("retryable", "scripted: later"))
    )


def test_HST_LVL_rounds_are_bounded_and_unfinished_steps_reported() -> None:
    from bcd_shared.units import Plan

    again = Plan((_Step("x"),))
    r, host = _converge(_unit([again], rounds=2))
    assert host.done == ["x", "x"] and r.changed
    assert r.issues == (Issue("retryable", "scripted: not converged yet: step x"),)
    r, host = _converge(_unit([again], rounds=1))
    assert host.done == ["x"] and r.steps_done == ("step x",)


def test_HST_LVL_stop_after_ends_the_action_for_this_pass() -> None:
    from bcd_shared.units import Plan, UnitCondition

    cond = (UnitCondition("T", "R", "m"),)
    first = Plan((_Step("install"),), stop_after=True)
    r, host = _converge(_unit([first, Plan((_Step("join"),), conditions=cond)]))
    assert host.done == ["install"]
    assert r.issues == (Issue("retryable", "scripted: installed packages; the next pass plans the rest"),)
    assert r.conditions == cond and r.changed and r.steps_done == ("step install",)
    r, _ = _converge(_unit([first, Plan((), (Issue("reboot", "wait"),))]))
    assert r.issues == (Issue("reboot", "scripted: wait"),)


def test_HST_LVL_step_errors_become_issues_by_kind() -> None:
    from bcd_shared.errors import RetryableError
    from bcd_shared.units import Plan, RebootRequired, UnitCondition

    cond = (UnitCondition("Down", "NotRunning", "m"),)
    cond2 = (UnitCondition("Down2", "NotRunning", "m2"),)
    cases = [
        (TerminalError("X", "scripted: broken"), Issue("terminal", "scripted: broken")),
        (RetryableError("X", "try later"), Issue("retryable", "scripted: try later")),
        (RebootRequired("needs it"), Issue("reboot", "scripted: needs it: reboot the node")),
        (RetryableError("Other", "then reboot the node"), Issue("reboot", "scripted: then reboot the node")),
        (TerminalError("RebootRequired", "x"), Issue("terminal", "scripted: x")),
    ]
    for exc, issue in cases:
        plans = [
            Plan((_Step("ok"), _Step("bad", exc), _Step("never")), conditions=cond),
            Plan(conditions=cond2),
        ]
        r, host = _converge(_unit(plans))
        assert host.done == ["ok", "bad"]
        assert (r.issues, r.changed, r.steps_done) == ((issue,), True, ("step ok",))
        assert r.conditions == cond2  # re-planned over the host the failed step left
    # a failure on the first step: nothing changed, the plan's own conditions
    r, host = _converge(_unit([Plan((_Step("bad", RetryableError("X", "no")),), conditions=cond)]))
    assert (r.changed, r.steps_done, r.conditions) == (False, (), cond)


def test_HST_LVL_validate_runs_before_anything_and_not_for_clean_up() -> None:
    from bcd_shared.units import Plan, UnitResult

    unit = _unit([Plan((_Step("a"),))])
    r, host = _converge(unit, "refuse")
    assert r == UnitResult("scripted", False, (Issue("terminal", "scripted: not allowed here"),))
    assert host.done == []
    unit = _unit([Plan((_Step("rm"),)), Plan()])
    r, host = _converge(unit, None)
    assert unit.validated == [] and host.done == ["rm"] and r.ok


# -- __init__ and strictjson


def test_HST_HLP_04_unit_name_rule_at_its_edges() -> None:
    from bcd_shared.units import valid_unit_name

    assert valid_unit_name("a") and valid_unit_name("k8s-join") and valid_unit_name("x" * 64)
    for bad in ("", "x" * 65, "Sysctl", "k8s_join", "a.b", "a b", "a/b", "a\n", "é"):
        assert not valid_unit_name(bad), bad


def test_clean_plans_the_clean_up_of_a_unit_that_left_the_spec(tmp_path: Any) -> None:
    from bcd_shared.system import LocalSystem
    from bcd_shared.units import ApplyContext, UnitContext, UnitResult, clean

    system = LocalSystem(tmp_path)
    system.write_atomic("/etc/sysctl.d/90-bcd.conf", b"vm.swappiness = 10\n")
    r = clean("sysctl", system, UnitContext(), ApplyContext())
    assert r == UnitResult("sysctl", True, (), (), ("remove /etc/sysctl.d/90-bcd.conf",))
    assert not system.exists("/etc/sysctl.d/90-bcd.conf")
    assert clean("hugepages", system, UnitContext(), ApplyContext()) == UnitResult("hugepages")


def test_strictjson_unique_keys_refuses_a_repeated_key_with_the_callers_error() -> None:
    from bcd_shared.strictjson import unique_keys

    hook = unique_keys(lambda k: ValueError(f"twice: {k}"))
    assert json.loads('{"a": 1, "b": {"a": 2}}', object_pairs_hook=hook) == {"a": 1, "b": {"a": 2}}
    assert hook([]) == {}
    with pytest.raises(ValueError, match=r"^twice: b$"):
        json.loads('{"a": 1, "b": 2, "b": 2}', object_pairs_hook=hook)
    with pytest.raises(ValueError, match=r"^twice: x$"):
        hook([("x", 1), ("y", 2), ("x", 1)])


# -- observers over a host tree (files only; no program runs)


def _tree(tmp: Any, files: dict[str, str]) -> Any:
    from bcd_shared.system import LocalSystem

    system = LocalSystem(tmp)
    for path, text in files.items():
        if path.endswith("/"):
            system.host_path(path).mkdir(parents=True, exist_ok=True)
        else:
            system.write_atomic(path, text.encode())
    return system


def test_observe_sysctl_and_kernel_modules(tmp_path: Any) -> None:
    from bcd_shared.units import UnitContext
    from bcd_shared.units.kmod import KernelModulesObserved, ModuleView
    from bcd_shared.units.sysctl import SysctlObserved

    system = _tree(
        tmp_path,
        {
            "/proc/sys/net/ipv4/tcp_rmem": "4096\t131072\t6291456\n",
            "/etc/sysctl.d/90-bcd.conf": "x\n",
            "/sys/module/vfio_pci/refcnt": "2\n",
            "/sys/module/vfio_pci/parameters/ids": "10de:2330\n",
            "/sys/module/kvm/refcnt": "busy\n",
            "/sys/module/tun/": "",
            "/etc/modprobe.d/bcd.conf": "o\n",
        },
    )
    s = decoded("sysctl", {"net.ipv4.tcp_rmem": "4096 131072 6291456", "vm.nope": 1})
    assert REGISTRY["sysctl"].observe(system, s, UnitContext()) == SysctlObserved(
        b"x\n", (("net.ipv4.tcp_rmem", "4096 131072 6291456"), ("vm.nope", None))
    )
    assert REGISTRY["sysctl"].observe(system, None, UnitContext()) == SysctlObserved(b"x\n", ())
    s = decoded(
        "kernel-modules",
        {"load": ["vfio-pci", "tun", "nbd"], "options": {"vfio-pci": "ids=10de:2330 x=1", "kvm": "a=1"}},
    )
    assert REGISTRY["kernel-modules"].observe(system, s, UnitContext()) == KernelModulesObserved(
        None,
        b"o\n",
        (
            ("kvm", ModuleView(True, 0, (("a", ""),))),
            ("nbd", ModuleView(False, 0, ())),
            ("tun", ModuleView(True, 0, ())),
            ("vfio-pci", ModuleView(True, 2, (("ids", "10de:2330"), ("x", "")))),
        ),
    )
    assert REGISTRY["kernel-modules"].observe(system, None, UnitContext()) == KernelModulesObserved(
        None, b"o\n", ()
    )


def test_observe_cpu_and_iommu(tmp_path: Any) -> None:
    from bcd_shared.units import UnitContext
    from bcd_shared.units.bootargs import BootloaderView
    from bcd_shared.units.cpu import CpuObserved, CpuView
    from bcd_shared.units.iommu import IommuObserved

    base = "/sys/devices/system/cpu"
    system = _tree(
        tmp_path,
        {
            f"{base}/cpu10/cpufreq/scaling_governor": "powersave\n",
            f"{base}/cpu10/cpufreq/scaling_available_governors": "performance powersave\n",
            f"{base}/cpu2/cpufreq/scaling_governor": "performance\n",
            f"{base}/cpu3/": "",  # no cpufreq
            f"{base}/cpufreq/": "",
            f"{base}/cpuidle/": "",
            f"{base}/isolated": "4-5\n",
            "/var/lib/bcd-hostconfig/bootargs/cpu": "# h\nisolcpus=x\n",
            "/var/lib/bcd-hostconfig/bootargs/iommu": "# h\niommu=pt\n",
            "/usr/sbin/grubby": "",
            "/proc/cpuinfo": "processor : 0\nvendor_id : GenuineIntel\n",
            "/sys/class/iommu/dmar0/": "",
        },
    )
    boot = BootloaderView(False, True)
    s = decoded("cpu", {"governor": "performance"})
    assert REGISTRY["cpu"].observe(system, s, UnitContext()) == CpuObserved(
        (CpuView("cpu2", "performance", ()), CpuView("cpu10", "powersave", ("performance", "powersave"))),
        frozenset({4, 5}),
        "4-5",
        "isolcpus=x",
        boot,
    )
    # without a governor, cpufreq is not read
    assert REGISTRY["cpu"].observe(system, decoded("cpu", {}), UnitContext()).cpus == ()
    system.write_atomic(f"{base}/isolated", b"garbage\n")
    o = REGISTRY["cpu"].observe(system, None, UnitContext())
    assert (o.cpus, o.isolated, o.isolated_text) == ((), frozenset(), "garbage")
    assert REGISTRY["iommu"].observe(system, decoded("iommu", {}), UnitContext()) == IommuObserved(
        "GenuineIntel", ("dmar0",), "iommu=pt", boot
    )


def test_observe_hugepages_pools_thp_and_the_mount(tmp_path: Any) -> None:
    from bcd_shared.system import CommandResult, LocalSystem
    from bcd_shared.units import UnitContext
    from bcd_shared.units.bootargs import BootloaderView
    from bcd_shared.units.hugepages import HugepagesObserved

    asked: list[tuple[str, ...]] = []

    def systemctl(system: Any, argv: Any, stdin: bytes | None) -> CommandResult:
        asked.append(tuple(argv))
        return CommandResult(tuple(argv), 0 if argv[1] == "is-enabled" else 3)

    files = {
        POOL.format("2048kB"): "16\n",
        POOL.format("1048576kB"): "x\n",
        NODE_POOL.format(0, "2048kB"): "8\n",
        NODE_POOL.format(1, "1048576kB"): "1\n",
        "/sys/devices/system/node/has_cpu": "0-1\n",
        "/sys/devices/system/node/nodeX/": "",
        "/sys/kernel/mm/transparent_hugepage/enabled": "always [madvise] never\n",
        "/var/lib/bcd-hostconfig/hugepages-1g-boot": "# h\nhugepagesz=1G hugepages=2\n",
        "/proc/mounts": (
            "sysfs /sys sysfs rw 0 0\nhugetlbfs /dev/hugepages1G hugetlbfs rw,pagesize=1024M 0 0\n\n"
        ),
        "/run/systemd/system/": "",
        "/usr/sbin/update-grub": "",
    }
    _tree(tmp_path, files)
    system = LocalSystem(tmp_path, tools={"systemctl": systemctl})
    o = REGISTRY["hugepages"].observe(system, None, UnitContext())
    assert o == HugepagesObserved(
        has_1g=True,
        thp="madvise",
        numa_nodes=(0, 1),
        counts=(
            (POOL.format("2048kB"), 16),
            (POOL.format("1048576kB"), None),
            (NODE_POOL.format(0, "2048kB"), 8),
            (NODE_POOL.format(1, "2048kB"), None),
            (NODE_POOL.format(0, "1048576kB"), None),
            (NODE_POOL.format(1, "1048576kB"), 1),
        ),
        boot_record="hugepagesz=1G hugepages=2",
        bootloader=BootloaderView(True, False),
        systemd=True,
        mount_unit=None,
        mounted=True,  # from /proc/mounts although the unit is not active
        mount_enabled=True,
    )
    assert asked == [
        ("systemctl", "is-enabled", "dev-hugepages1G.mount"),
        ("systemctl", "is-active", "--quiet", "dev-hugepages1G.mount"),
    ]
    system.write_atomic("/proc/mounts", b"hugetlbfs /dev/hugepages hugetlbfs rw 0 0\n")
    system.write_atomic("/sys/kernel/mm/transparent_hugepage/enabled", b"always madvise never\n")
    o = REGISTRY["hugepages"].observe(system, None, UnitContext())
    assert (o.mounted, o.thp) == (False, "")
    system.remove("/sys/kernel/mm/transparent_hugepage/enabled")
    system.host_path("/run/systemd/system").rmdir()
    asked.clear()
    o = REGISTRY["hugepages"].observe(system, None, UnitContext())
    assert (o.thp, o.systemd, o.mount_enabled, o.mounted, asked) == (None, False, False, False, [])


# -- steps applied on a host whose programs are scripted


class Scripted:
    """A host tree whose programs answer from a table (program -> function) and are recorded."""

    def __init__(self, tmp: Any, answers: dict[str, Any]) -> None:
        from bcd_shared.system import CommandResult, LocalSystem

        self.calls: list[tuple[str, ...]] = []

        def tool(name: str) -> Any:
            def run(system: Any, argv: Any, stdin: bytes | None) -> CommandResult:
                self.calls.append(tuple(argv))
                rc, out, err = answers[name](tuple(argv), stdin)
                return CommandResult(tuple(argv), rc, out, err)

            return run

        self.system = LocalSystem(tmp, tools={name: tool(name) for name in answers})


def _tee(argv: tuple[str, ...], stdin: bytes | None, keep: Any = None) -> tuple[int, bytes, bytes]:
    from pathlib import Path

    value = (stdin or b"").decode()
    Path(argv[1]).write_text(keep(value) if keep else value)
    return 0, b"", b""


def test_write_kernel_verifies_what_the_kernel_kept(tmp_path: Any) -> None:
    from bcd_shared.errors import RetryableError
    from bcd_shared.units import ApplyContext
    from bcd_shared.units._base import WriteKernel

    path = "/sys/kernel/mm/transparent_hugepage/enabled"
    host = Scripted(tmp_path, {"tee": lambda a, i: _tee(a, i, lambda v: "[never]\n")})
    host.system.write_atomic(path, b"")
    WriteKernel(path, "madvise").apply(host.system, ApplyContext())  # not verified: no error
    assert host.calls == [("tee", str(tmp_path / path.lstrip("/")))]
    with pytest.raises(RetryableError) as exc:
        WriteKernel(path, "madvise", verify=True).apply(host.system, ApplyContext())
    assert (exc.value.reason, exc.value.message) == (
        "KernelWrite",
        f"{path} is [never] after writing madvise",
    )
    host = Scripted(tmp_path, {"tee": lambda a, i: _tee(a, i, lambda v: "")})
    with pytest.raises(RetryableError) as exc:
        WriteKernel(path, "1", verify=True).apply(host.system, ApplyContext())
    assert exc.value.message == f"{path} is empty after writing 1"
    host = Scripted(tmp_path, {"tee": lambda a, i: (1, b"", b"tee: Permission denied\n")})
    with pytest.raises(RetryableError) as exc:
        WriteKernel(path, "1").apply(host.system, ApplyContext())
    assert exc.value.message == f"cannot set {path} to 1: tee exited 1: tee: Permission denied"
    assert WriteKernel(path, "1").describe() == f"set {path} to 1"


def test_HST_HP_2m_and_1g_shortfalls(tmp_path: Any) -> None:
    from bcd_shared.errors import RetryableError
    from bcd_shared.units import ApplyContext, RebootRequired
    from bcd_shared.units.bootargs import BootloaderView
    from bcd_shared.units.hugepages import Set1GPages, Set2MPages

    g1, g1b = NODE_POOL.format(0, "1048576kB"), NODE_POOL.format(1, "1048576kB")
    answers = {
        "tee": lambda a, i: _tee(a, i, lambda v: "3\n" if "1048576kB" in a[1] or "2048kB" in a[1] else v),
        "update-grub": lambda a, i: (0, b"", b""),
    }
    host = Scripted(tmp_path, answers)
    for path in (g1, g1b, POOL.format("2048kB")):
        host.system.write_atomic(path, b"0\n")
    with pytest.raises(RetryableError) as exc:
        Set2MPages(POOL.format("2048kB"), 8).apply(host.system, ApplyContext())
    assert (exc.value.reason, exc.value.message) == (
        "HugepagesShort",
        f"hugepages: {POOL.format('2048kB')} holds 3 pages, not 8 (memory fragmented or short)",
    )
    Set2MPages(POOL.format("2048kB"), 3).apply(host.system, ApplyContext())  # got what it asked
    with pytest.raises(RebootRequired) as boot:
        Set1GPages(((g1, 4), (g1b, 5)), 10, "", BootloaderView(True, False)).apply(
            host.system, ApplyContext()
        )
    assert boot.value.message == (
        "hugepages: 9 pages of 1 GiB could not be allocated now (6 allocated); "
        "the boot loader reserves them from the next boot: reboot the node"
    )
    assert host.system.read_text("/etc/default/grub.d/90-bcd-hugepages.cfg") == (
        HEAD.format(unit="hugepages")
        + 'GRUB_CMDLINE_LINUX="$GRUB_CMDLINE_LINUX hugepagesz=1G hugepages=10"\n'
    )
    assert host.system.read_text("/var/lib/bcd-hostconfig/hugepages-1g-boot") == (
        HEAD.format(unit="hugepages") + "hugepagesz=1G hugepages=10\n"
    )
    assert host.calls[-1] == ("update-grub",)
    # the same reservation already recorded: the boot loader is not asked again
    host.calls.clear()
    with pytest.raises(RebootRequired):
        Set1GPages(((g1, 4),), 10, "hugepagesz=1G hugepages=10", BootloaderView(True, False)).apply(
            host.system, ApplyContext()
        )
    assert [c[0] for c in host.calls] == ["tee"]
    Set1GPages(((g1, 3),), 3, "", BootloaderView(False, False)).apply(
        host.system, ApplyContext()
    )  # all there


MODINFO_580_OPEN = b"filename: /lib/modules/nvidia.ko\nversion: 580.82.07\nlicense: Dual MIT/GPL\n"
PROC_580_OPEN = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.82.07  Release Build\n"


def _driver_host(tmp: Any, modinfo: bytes | None, loaded_after: str | None, unload_rc: int = 0) -> Scripted:
    from pathlib import Path

    root = Path(tmp)

    def modprobe(argv: tuple[str, ...], stdin: bytes | None) -> tuple[int, bytes, bytes]:
        if argv[1] == "-r":
            if unload_rc == 0:
                shutil.rmtree(root / "sys/module" / argv[-1])
            return unload_rc, b"", b"modprobe: FATAL: Module nvidia is in use.\n" if unload_rc else b""
        (root / "sys/module" / argv[-1]).mkdir(parents=True, exist_ok=True)
        if argv[-1] == "nvidia" and loaded_after is not None:
            (root / "proc/driver/nvidia").mkdir(parents=True, exist_ok=True)
            (root / "proc/driver/nvidia/version").write_text(loaded_after)
        return 0, b"", b""

    return Scripted(
        tmp,
        {
            "modinfo": lambda a, i: (0, modinfo, b"") if modinfo is not None else (1, b"", b"not found"),
            "modprobe": modprobe,
            "systemctl": lambda a, i: (5, b"", b"Unit not loaded.\n"),
        },
    )


def test_HST_DRV_load_refuses_a_module_of_another_branch_before_unloading(tmp_path: Any) -> None:
    from bcd_shared.units import ApplyContext
    from bcd_shared.units.nvidia import LoadDriver

    host = _driver_host(tmp_path, MODINFO_580_OPEN, PROC_580_OPEN)
    host.system.write_atomic("/sys/module/nvidia/refcnt", b"0\n")
    cases = [
        (
            LoadDriver("570", None, "580.1", "ubuntu"),
            "the driver packages installed 580.82.07 (open), not branch 570",
        ),
        (
            LoadDriver("580", False, "570.1", "rhel"),
            "the driver packages installed 580.82.07 (open), not branch 580 (proprietary)",
        ),
        (
            LoadDriver("570", True, None, "suse"),
            "the driver packages installed 580.82.07 (open), not branch 570 (open); the SUSE packages carry "
            "no branch: pin the driver version in the repository, or ask for branch 580",
        ),
    ]
    for step, message in cases:
        host.calls.clear()
        with pytest.raises(TerminalError) as exc:
            step.apply(host.system, ApplyContext())
        assert (exc.value.reason, exc.value.message) == ("DriverBranch", message)
        assert host.calls == [("modinfo", "nvidia")]  # nothing stopped or unloaded


def test_HST_DRV_load_swaps_the_loaded_driver_and_checks_the_result(tmp_path: Any) -> None:
    from bcd_shared.units import ApplyContext, RebootRequired
    from bcd_shared.units.nvidia import LoadDriver

    host = _driver_host(tmp_path, MODINFO_580_OPEN, PROC_580_OPEN)
    for mod in ("nvidia", "nvidia_uvm", "nvidia_modeset"):
        host.system.write_atomic(f"/sys/module/{mod}/refcnt", b"0\n")
    LoadDriver("580", True, "570.124.06", "ubuntu").apply(host.system, ApplyContext())
    assert host.calls == [
        ("modinfo", "nvidia"),
        ("systemctl", "stop", "nvidia-fabricmanager.service"),
        ("systemctl", "stop", "nvidia-persistenced.service"),
        ("systemctl", "stop", "nvidia-dcgm.service"),
        ("modprobe", "-r", "--", "nvidia_uvm"),
        ("modprobe", "-r", "--", "nvidia_modeset"),
        ("modprobe", "-r", "--", "nvidia"),
        ("modprobe", "--", "nvidia"),
        ("modprobe", "--", "nvidia_uvm"),
    ]
    # nothing loaded before: no services stopped, nothing unloaded
    host = _driver_host(tmp_path / "b", None, PROC_580_OPEN)
    LoadDriver("580", None, None).apply(host.system, ApplyContext())
    assert host.calls == [
        ("modinfo", "nvidia"),
        ("modprobe", "--", "nvidia"),
        ("modprobe", "--", "nvidia_uvm"),
    ]
    # the old driver is in use
    host = _driver_host(tmp_path / "c", MODINFO_580_OPEN, PROC_580_OPEN, unload_rc=1)
    host.system.write_atomic("/sys/module/nvidia/refcnt", b"3\n")
    with pytest.raises(RebootRequired) as boot:
        LoadDriver("580", None, "570.124.06").apply(host.system, ApplyContext())
    assert boot.value.message == "driver 570.124.06 is in use; reboot the node to load branch 580"
    # loaded, but the kernel still shows another driver
    host = _driver_host(tmp_path / "d", None, "NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.1.2  x\n")
    with pytest.raises(RebootRequired) as boot:
        LoadDriver("580", None, None).apply(host.system, ApplyContext())
    assert boot.value.message == "the loaded driver is 570.1.2, not branch 580: reboot the node"
    host = _driver_host(tmp_path / "e", None, None)
    with pytest.raises(RebootRequired) as boot:
        LoadDriver("580", None, None).apply(host.system, ApplyContext())
    assert boot.value.message == "the loaded driver is none, not branch 580: reboot the node"


# The `mig -lgip` / `mig -lgi` tables as the A30 transcript in ../shared/reference/nvidia-smi/mig shows them
# (a30_535.183.01_mig-session_transcript.txt), GPU 1 added as a second A30.
LGIP = """\
+-----------------------------------------------------------------------------+
| GPU instance profiles:                                                      |
| GPU   Name             ID    Instances   Memory     P2P    SM    DEC   ENC  |
|                              Free/Total   GiB              CE    JPEG  OFA  |
|=============================================================================|
|   0  MIG 1g.6gb        14     4/4        5.81       No     14     1     0   |
|                                                             1     0     0   |
+-----------------------------------------------------------------------------+
|   0  MIG 2g.12gb        5     2/2        11.69      No     28     2     0   |
|                                                             2     0     0   |
+-----------------------------------------------------------------------------+
|   1  MIG 4g.24gb        0     1/1        23.44      No     56     4     0   |
|                                                             4     1     1   |
+-----------------------------------------------------------------------------+
"""
LGI = """\
+-------------------------------------------------------+
| GPU instances:                                        |
| GPU   Name             Profile  Instance   Placement  |
|                          ID       ID       Start:Size |
|=======================================================|
|   0  MIG 2g.12gb          5        2          2:2     |
+-------------------------------------------------------+
|   0  MIG 1g.6gb          14        3          0:1     |
+-------------------------------------------------------+
"""


def test_observe_mig_rows_profiles_instances_and_busy_gpus(tmp_path: Any) -> None:
    from bcd_shared.units import UnitContext
    from bcd_shared.units.mig import MigGpu, MigObserved
    from bcd_shared.units.nvsmi import MigProfile

    rows = b"0, GPU-a, Enabled, Enabled\n1, GPU-b, Disabled, Enabled\n2, GPU-c, [N/A], [N/A]\n"

    def smi(argv: tuple[str, ...], stdin: bytes | None) -> tuple[int, bytes, bytes]:
        if argv[1].startswith("--query-gpu="):
            return 0, rows, b""
        return 0, {"-lgip": LGIP, "-lgi": LGI}[argv[2]].encode(), b""

    host = Scripted(tmp_path, {"nvidia-smi": smi})
    s = decoded("mig-layout", {"layout": "all-1g.6gb"})
    ctx = UnitContext(busy_gpus=frozenset({"GPU-a/gi2/ci0", "GPU-z/s1"}))
    a30_profiles = (MigProfile("1g.6gb", 14, 4), MigProfile("2g.12gb", 5, 2))
    assert REGISTRY["mig-layout"].observe(host.system, s, ctx) == MigObserved(
        (
            MigGpu("0", "GPU-a", "Enabled", "Enabled", a30_profiles, ("1g.6gb", "2g.12gb")),
            MigGpu("1", "GPU-b", "Disabled", "Enabled", (MigProfile("4g.24gb", 0, 1),), ()),
        ),
        frozenset({"GPU-a", "GPU-z"}),
    )  # fmt: skip
    assert host.calls == [
        (
            "nvidia-smi",
            "--query-gpu=index,uuid,mig.mode.current,mig.mode.pending",
            "--format=csv,noheader,nounits",
        ),
        ("nvidia-smi", "mig", "-lgip"),
        ("nvidia-smi", "mig", "-lgi"),
    ]
    # MIG off everywhere: the tables are not asked for
    rows = b"0, GPU-a, Disabled, Disabled\n"
    host.calls.clear()
    o = REGISTRY["mig-layout"].observe(host.system, s, UnitContext())
    assert o == MigObserved((MigGpu("0", "GPU-a", "Disabled", "Disabled", (), ()),), frozenset())
    assert len(host.calls) == 1
    # no layout: nothing is asked
    host.calls.clear()
    assert REGISTRY["mig-layout"].observe(host.system, None, UnitContext()) == MigObserved((), frozenset())
    assert host.calls == []
    dead = Scripted(tmp_path, {"nvidia-smi": lambda a, i: (9, b"", b"NVIDIA-SMI has failed")})
    assert REGISTRY["mig-layout"].observe(dead.system, s, UnitContext()) == MigObserved(None, frozenset())


def test_HST_MIG_steps_mode_with_reset_and_repartition(tmp_path: Any) -> None:
    from bcd_shared.errors import RetryableError
    from bcd_shared.units import ApplyContext, RebootRequired
    from bcd_shared.units.mig import Repartition, SetMigMode

    state: dict[str, Any] = {"mode": "Disabled", "after_reset": "Enabled", "reset_rc": 0, "mig_rc": 0}

    def smi(argv: tuple[str, ...], stdin: bytes | None) -> tuple[int, bytes, bytes]:
        if argv[1].startswith("--query-gpu="):
            return 0, f"0, GPU-a, Enabled, Enabled\n3, GPU-d, {state['mode']}, Enabled\n".encode(), b""
        if argv[1] == "--gpu-reset":
            state["mode"] = state["after_reset"]
            return int(state["reset_rc"]), b"", b""
        if argv[1] == "-i" and argv[3] == "-mig":
            return int(state["mig_rc"]), b"", b"Unable to enable MIG Mode\n" if state["mig_rc"] else b""
        if argv[4] in ("-dci", "-dgi"):
            return 6, b"", b"No GPU instances found: Not Found\n"
        return 0, b"", b""

    host = Scripted(tmp_path, {"nvidia-smi": smi})
    SetMigMode("3", True).apply(host.system, ApplyContext())
    assert [c[1:4] for c in host.calls] == [
        ("-i", "3", "-mig"),
        ("--query-gpu=index,uuid,mig.mode.current,mig.mode.pending", "--format=csv,noheader,nounits"),
        ("--gpu-reset", "-i", "3"),
        ("--query-gpu=index,uuid,mig.mode.current,mig.mode.pending", "--format=csv,noheader,nounits"),
    ]
    assert host.calls[0] == ("nvidia-smi", "-i", "3", "-mig", "1")
    host.calls.clear()
    SetMigMode("3", True).apply(host.system, ApplyContext())  # already on: no reset
    assert len(host.calls) == 2
    state.update(mode="Enabled", after_reset="Enabled", reset_rc=1)
    with pytest.raises(RebootRequired) as boot:
        SetMigMode("3", False).apply(host.system, ApplyContext())
    assert boot.value.message == (
        "mig-layout: MIG mode of GPU 3 waits for a GPU reset, which failed (reboot the node)"
    )
    state.update(reset_rc=0)  # the reset "works" but the mode stays
    with pytest.raises(RebootRequired):
        SetMigMode("3", False).apply(host.system, ApplyContext())
    state.update(mig_rc=2)
    with pytest.raises(RetryableError) as exc:
        SetMigMode("3", True).apply(host.system, ApplyContext())
    assert (exc.value.reason, exc.value.message) == (
        "MigMode",
        "mig-layout: cannot set MIG mode on GPU 3: nvidia-smi exited 2: Unable to enable MIG Mode",
    )
    host.calls.clear()
    Repartition("3", ("3g.40gb", "1g.10gb")).apply(host.system, ApplyContext())  # "Not Found" is done
    assert host.calls == [
        ("nvidia-smi", "mig", "-i", "3", "-dci"),
        ("nvidia-smi", "mig", "-i", "3", "-dgi"),
        ("nvidia-smi", "mig", "-i", "3", "-cgi", "3g.40gb,1g.10gb", "-C"),
    ]
    host.calls.clear()
    Repartition("3", ()).apply(host.system, ApplyContext())
    assert [c[4] for c in host.calls] == ["-dci", "-dgi"]


def test_observe_nvidia_driver_and_fabric_manager(tmp_path: Any) -> None:
    from bcd_shared.units import UnitContext
    from bcd_shared.units.distro import Distro
    from bcd_shared.units.nvidia import DriverObserved, DriverVersion, FmObserved, require_driver

    active = {"nvidia-persistenced.service": 0, "nvidia-fabricmanager.service": 3}
    host = Scripted(
        tmp_path,
        {
            "modinfo": lambda a, i: (0, MODINFO_580_OPEN, b""),
            "systemctl": lambda a, i: (active[a[-1]], b"", b""),
        },
    )
    _tree(
        tmp_path,
        {
            "/etc/os-release": 'ID=ubuntu\nVERSION_ID="24.04"\n',
            "/sys/module/nvidia/": "",
            "/proc/driver/nvidia/version": PROC_580_OPEN,
            "/usr/bin/nvidia-persistenced": "",
            "/proc/driver/nvidia-nvswitch/devices/0000:01:00.0": "",
            "/proc/driver/nvidia-nvswitch/devices/0000:02:00.0": "",
        },
    )
    v = DriverVersion("580.82.07", "580", True)
    ubuntu = Distro("ubuntu", "24.04", "ubuntu")
    s = decoded("nvidia-driver", {"branch": "580"})
    assert REGISTRY["nvidia-driver"].observe(host.system, s, UnitContext()) == DriverObserved(
        ubuntu, v, v, True, True
    )
    assert host.calls[-1] == ("systemctl", "is-active", "--quiet", "nvidia-persistenced.service")
    fm = REGISTRY["fabric-manager"].observe(host.system, decoded("fabric-manager", {}), UnitContext())
    assert fm == FmObserved(2, ubuntu, v, False, False)  # nv-fabricmanager not installed: not asked
    host.system.write_atomic("/usr/sbin/nv-fabricmanager", b"")
    fm = REGISTRY["fabric-manager"].observe(host.system, decoded("fabric-manager", {}), UnitContext())
    assert (fm.installed, fm.active) == (True, False)
    active["nvidia-fabricmanager.service"] = 0
    fm = REGISTRY["fabric-manager"].observe(host.system, decoded("fabric-manager", {}), UnitContext())
    assert (fm.installed, fm.active) == (True, True)
    require_driver(host.system, "gpu-settings")  # loaded: no error
    shutil.rmtree(tmp_path / "proc/driver/nvidia-nvswitch")
    assert REGISTRY["fabric-manager"].observe(host.system, None, UnitContext()) == FmObserved(
        0, Distro("", "", "unknown"), None, False, False
    )
    shutil.rmtree(tmp_path / "sys/module/nvidia")
    o = REGISTRY["nvidia-driver"].observe(host.system, s, UnitContext())
    assert (o.installed, o.loaded) == (v, None)
    from bcd_shared.errors import RetryableError

    with pytest.raises(RetryableError) as exc:
        require_driver(host.system, "gpu-settings")
    assert (exc.value.reason, exc.value.message) == (
        "NoDriver",
        "gpu-settings: no NVIDIA driver is loaded yet",
    )


def test_HST_MOD_13_every_spelling_of_a_boolean_parameter_compares_equal() -> None:
    head = HEAD.format(unit="kernel-modules").encode()
    tun = ModuleView(True, 0, ())
    for now, want in (
        ("Y", "1"),
        ("y", "1"),
        ("N", "0"),
        ("n", "0"),
        ("1", "Y"),
        ("0", "N"),
        ("1", "y"),
        ("0", "n"),
    ):
        settings = {"load": ["kvm", "tun"], "options": {"kvm": f"p={want}"}}
        load, opts = head + b"kvm\ntun\n", head + f"options kvm p={want}\n".encode()
        assert _kmod_plan(
            settings, load, opts, {"kvm": ModuleView(True, 0, (("p", now),)), "tun": tun}
        ).converged
    # Y is not 0, N is not 1: those reload
    settings = {"load": ["kvm"], "options": {"kvm": "p=1"}}
    load, opts = head + b"kvm\n", head + b"options kvm p=1\n"
    assert len(_kmod_plan(settings, load, opts, {"kvm": ModuleView(True, 0, (("p", "N"),))}).steps) == 2
    # an empty option value matches a parameter the module does not show
    settings = {"load": ["kvm"], "options": {"kvm": "p="}}
    opts = head + b"options kvm p=\n"
    assert _kmod_plan(settings, load, opts, {"kvm": ModuleView(True, 0, ())}).converged


def test_HST_MOD_12_14_every_module_is_planned_after_one_that_loads() -> None:
    head = HEAD.format(unit="kernel-modules").encode()
    settings = {"load": ["a_mod", "kvm"], "options": {"kvm": "p=1"}}
    load, opts = head + b"a_mod\nkvm\n", head + b"options kvm p=1\n"
    p = _kmod_plan(
        settings, load, opts, {"a_mod": ModuleView(False, 0, ()), "kvm": ModuleView(True, 0, (("p", "0"),))}
    )
    assert p.steps == (
        Run(("modprobe", "--", "a_mod"), message="cannot load a_mod"),
        Run(("modprobe", "-r", "--", "kvm"), message="cannot unload kvm"),
        Run(("modprobe", "--", "kvm"), message="cannot load kvm"),
    )


def test_HST_MOD_05_an_option_value_may_hold_an_equals_sign() -> None:
    assert decoded("kernel-modules", {"options": {"kvm": "a=b=c"}}).options == (
        ("kvm", (("a", "b=c"),), "a=b=c"),
    )


def test_observe_gpu_settings_sharing_and_toolkit(tmp_path: Any) -> None:
    from bcd_shared.units import UnitContext
    from bcd_shared.units.distro import Distro
    from bcd_shared.units.gpusettings import GpuPower, GpuSettingsObserved
    from bcd_shared.units.sharing import SharingObserved
    from bcd_shared.units.toolkit import ToolkitObserved, stamp_of

    # --query-gpu rows as the reference CSV shows them (590.48.01: [N/A] without power management)
    rows = (
        b"0, GPU-a, 700.00, 100.00, 700.00, Enabled, Enabled\n1, GPU-b, [N/A], [N/A], [N/A], [N/A], [N/A]\n"
    )
    host = Scripted(
        tmp_path,
        {
            "nvidia-smi": lambda a, i: (
                0,
                rows if a[1].startswith("--query") else b"GPU 0: H100 (UUID: GPU-a)\n",
                b"",
            ),
            "systemctl": lambda a, i: (0, b"", b""),
        },
    )
    s = decoded("gpu-settings", {"ecc": True})
    assert REGISTRY["gpu-settings"].observe(host.system, s, UnitContext()) == GpuSettingsObserved(
        (
            GpuPower("0", 700.0, 100.0, 700.0, "Enabled", "Enabled"),
            GpuPower("1", None, None, None, "[N/A]", "[N/A]"),
        )
    )
    assert host.calls == [
        (
            "nvidia-smi",
            "--query-gpu=index,uuid,power.limit,power.min_limit,power.max_limit,ecc.mode.current,ecc.mode.pending",
            "--format=csv,noheader,nounits",
        )
    ]
    host.calls.clear()
    assert (
        REGISTRY["gpu-settings"].observe(host.system, decoded("gpu-settings", {}), UnitContext()).gpus == ()
    )
    assert REGISTRY["gpu-settings"].observe(host.system, None, UnitContext()).gpus == ()
    assert host.calls == []
    # gpu-sharing: the control program and the service are only asked about for MPS or a unit file
    assert REGISTRY["gpu-sharing"].observe(host.system, None, UnitContext()) == SharingObserved(
        False, None, False
    )
    _tree(tmp_path, {"/usr/bin/nvidia-cuda-mps-control": "", "/etc/systemd/system/bcd-mps.service": "u"})
    mps = decoded("gpu-sharing", {"mode": "mps"})
    assert REGISTRY["gpu-sharing"].observe(host.system, mps, UnitContext()) == SharingObserved(
        True, b"u", True
    )
    ts = decoded("gpu-sharing", {"mode": "timeslice"})
    assert REGISTRY["gpu-sharing"].observe(host.system, ts, UnitContext()) == SharingObserved(
        False, b"u", True
    )
    # container-toolkit
    _tree(
        tmp_path,
        {
            "/etc/os-release": "ID=debian\nVERSION_ID=12\n",
            "/usr/bin/nvidia-ctk": "",
            "/usr/bin/containerd": "",
            "/etc/containerd/config.toml": "[plugins]\n",
            "/usr/bin/dockerd": "",
            "/etc/docker/daemon.json": '{"runtimes": {"nvidia": {"path": "nvidia-container-runtime"}}}',
            "/etc/nvidia-container-runtime/config.toml": "c\n",
            "/var/lib/bcd-hostconfig/cdi-nvidia.stamp": "# h\nabc\n",
            "/etc/cdi/nvidia.yaml": "",
            "/sys/module/nvidia/": "",
            "/proc/driver/nvidia/version": PROC_580_OPEN,
        },
    )
    o = REGISTRY["container-toolkit"].observe(host.system, decoded("container-toolkit", {}), UnitContext())
    assert o == ToolkitObserved(
        Distro("debian", "12", "debian"),
        True,
        ("containerd",),
        "c\n",
        stamp_of("580.82.07", "GPU 0: H100 (UUID: GPU-a)\n"),
        "abc",
        False,
        True,
    )
    o = REGISTRY["container-toolkit"].observe(
        host.system, decoded("container-toolkit", {"cdi": False}), UnitContext()
    )
    assert o.stamp_now is None
    assert REGISTRY["container-toolkit"].observe(host.system, None, UnitContext()) == ToolkitObserved(
        Distro("", "", "unknown"), False, (), "", None, None, False, False
    )


def test_HST_CTK_generate_cdi_writes_the_spec_then_its_stamp(tmp_path: Any) -> None:
    from bcd_shared.units import ApplyContext
    from bcd_shared.units.toolkit import GenerateCdi

    host = Scripted(tmp_path, {"nvidia-ctk": lambda a, i: (0, b"", b"")})
    GenerateCdi("d1g3st").apply(host.system, ApplyContext())
    assert host.calls == [
        (
            "nvidia-ctk",
            "cdi",
            "generate",
            "--format=json",
            "--device-name-strategy=uuid",
            "--output=/etc/cdi/nvidia.json",
        )
    ]
    assert host.system.read_text("/var/lib/bcd-hostconfig/cdi-nvidia.stamp") == (
        HEAD.format(unit="container-toolkit") + "d1g3st\n"
    )
    from bcd_shared.errors import RetryableError

    failing = Scripted(tmp_path / "f", {"nvidia-ctk": lambda a, i: (1, b"", b"no driver\n")})
    with pytest.raises(RetryableError) as exc:
        GenerateCdi("x").apply(failing.system, ApplyContext())
    assert exc.value.message == "generating the NVIDIA CDI spec: nvidia-ctk exited 1: no driver"
    assert not failing.system.exists("/var/lib/bcd-hostconfig/cdi-nvidia.stamp")


def test_HST_HP_one_page_of_1g_mounts_and_missing_pool_files_read_as_zero(tmp_path: Any) -> None:
    from bcd_shared.errors import RetryableError
    from bcd_shared.units import ApplyContext, RebootRequired
    from bcd_shared.units.bootargs import BootloaderView
    from bcd_shared.units.hugepages import Set1GPages, Set2MPages, mount_unit_text

    g1 = POOL.format("1048576kB")
    assert _hp_plan({"pages1g": 1}, counts=((g1, 1),)).steps[0] == WriteFile(
        "/etc/systemd/system/dev-hugepages1G.mount", mount_unit_text()
    )
    # a kernel file that vanished reads as 0 pages: 0 asked is met, 2 asked is short by 2
    host = Scripted(tmp_path, {"tee": lambda a, i: (0, b"", b""), "grubby": lambda a, i: (0, b"", b"")})
    Set2MPages("/sys/none", 0).apply(host.system, ApplyContext())
    Set1GPages((("/sys/none", 0),), 0, "", BootloaderView(False, True)).apply(host.system, ApplyContext())
    with pytest.raises(RetryableError) as exc:
        Set2MPages("/sys/none", 2).apply(host.system, ApplyContext())
    assert exc.value.message == "hugepages: /sys/none holds 0 pages, not 2 (memory fragmented or short)"
    # grubby: the arguments set before are removed, then the new ones added; unreadable counts add nothing
    host.system.write_atomic("/sys/bad", b"err\n")
    host.calls.clear()
    with pytest.raises(RebootRequired) as boot:
        Set1GPages((("/sys/bad", 4),), 4, "hugepagesz=1G hugepages=2", BootloaderView(False, True)).apply(
            host.system, ApplyContext()
        )
    assert boot.value.message.startswith(
        "hugepages: 4 pages of 1 GiB could not be allocated now (0 allocated)"
    )
    assert host.calls[1:] == [
        ("grubby", "--update-kernel=ALL", "--remove-args=hugepagesz=1G hugepages=2"),
        ("grubby", "--update-kernel=ALL", "--args=hugepagesz=1G hugepages=4"),
    ]


def test_HST_CPU_every_cpu_is_read_past_entries_that_are_not_cpus(tmp_path: Any) -> None:
    from bcd_shared.units import UnitContext
    from bcd_shared.units.cpu import CpuView, format_cpulist

    assert format_cpulist(frozenset({1, 2, 5, 8, 9, 10})) == "1-2,5,8-10"
    base = "/sys/devices/system/cpu"
    system = _tree(
        tmp_path,
        {
            f"{base}/amd_pstate/status": "active\n",  # sorts before cpu0
            f"{base}/cpu0/": "",  # no cpufreq
            f"{base}/cpu1/cpufreq/scaling_governor": "schedutil\n",
        },
    )
    o = REGISTRY["cpu"].observe(system, decoded("cpu", {"governor": "performance"}), UnitContext())
    assert o.cpus == (CpuView("cpu1", "schedutil", ()),)


def test_HST_GPUS_a_gpu_without_a_full_power_range_is_skipped_and_ecc_read_past_one_without_it() -> None:
    from bcd_shared.units.gpusettings import GpuPower

    partial = (
        GpuPower("0", None, 100.0, 700.0, "Enabled", "Enabled"),
        GpuPower("1", 300.0, 100.0, None, "Enabled", "Enabled"),
        GpuPower("2", 300.0, None, 700.0, "Enabled", "Enabled"),
    )
    assert _gpus_plan({"powerLimitWatts": 500}, partial).converged
    gpus = (_gpu("0", None, ("[N/A]", "[N/A]")), _gpu("1", None, ("Disabled", "Disabled")))
    p = _gpus_plan({"ecc": True}, gpus)
    assert p.steps == (Run(("nvidia-smi", "-i", "1", "-e", "1")),)
    assert p.issues[0].message.startswith("gpu-settings: the ECC mode of GPU(s) 1 changes")
    p = _gpus_plan({"ecc": True}, None)
    assert p.steps == () and p.terminal == () and p.issues[0].kind == "retryable"


def test_HST_SHARE_a_stopped_service_is_started_with_no_issue() -> None:
    from bcd_shared.units.sharing import service_text

    p = _share_plan({"mode": "mps", "replicas": 48}, True, service_text(48), False)
    assert p.steps == (Run(("systemctl", "start", "bcd-mps.service")),)
    assert p.issues == () and p.terminal == ()


def test_HST_CTK_stamp_of_output_that_is_not_utf8_and_a_missing_config(tmp_path: Any) -> None:
    from bcd_shared.units import UnitContext
    from bcd_shared.units.toolkit import stamp_of

    host = Scripted(tmp_path, {"nvidia-smi": lambda a, i: (0, b"GPU 0: \xff\n", b"")})
    _tree(
        tmp_path,
        {"/usr/bin/nvidia-ctk": "", "/sys/module/nvidia/": "", "/proc/driver/nvidia/version": PROC_580_OPEN},
    )
    o = REGISTRY["container-toolkit"].observe(host.system, decoded("container-toolkit", {}), UnitContext())
    assert o.stamp_now == stamp_of("580.82.07", "GPU 0: \ufffd\n")
    assert o.ctk_config == "" and o.unconfigured == ()


def test_HST_MIG_mode_off_without_reset_and_with_one_and_rows_that_vanish(tmp_path: Any) -> None:
    from bcd_shared.units import ApplyContext, RebootRequired
    from bcd_shared.units.mig import SetMigMode

    state: dict[str, Any] = {
        "rows": "3, GPU-d, Disabled, Enabled\n",
        "after": "3, GPU-d, Disabled, Enabled\n",
    }

    def smi(argv: tuple[str, ...], stdin: bytes | None) -> tuple[int, bytes, bytes]:
        if argv[1].startswith("--query-gpu="):
            return 0, state["rows"].encode(), b""
        if argv[1] == "--gpu-reset":
            state["rows"] = state["after"]
        return 0, b"", b""

    host = Scripted(tmp_path, {"nvidia-smi": smi})
    SetMigMode("3", False).apply(host.system, ApplyContext())  # already off after -mig 0: no reset
    assert [c[1] for c in host.calls] == ["-i", "--query-gpu=index,uuid,mig.mode.current,mig.mode.pending"]
    state["rows"] = "3, GPU-d, Enabled, Disabled\n"  # the reset applies the pending mode
    SetMigMode("3", False).apply(host.system, ApplyContext())
    assert host.calls[-2][1] == "--gpu-reset"
    # the GPU's row is missing after the reset: a reboot, not a crash; missing before it: the reset decides
    state.update(rows="3, GPU-d, Enabled, Enabled\n", after="")
    with pytest.raises(RebootRequired):
        SetMigMode("3", False).apply(host.system, ApplyContext())
    state.update(rows="", after="3, GPU-d, Disabled, Disabled\n")
    SetMigMode("3", False).apply(host.system, ApplyContext())  # missing before, there after the reset


def test_HST_MIG_repartition_failures_named_and_not_found_in_either_case(tmp_path: Any) -> None:
    from bcd_shared.errors import RetryableError
    from bcd_shared.units import ApplyContext
    from bcd_shared.units.mig import Repartition

    answers: dict[str, tuple[int, bytes]] = {}

    def smi(argv: tuple[str, ...], stdin: bytes | None) -> tuple[int, bytes, bytes]:
        rc, err = answers.get(argv[4], (0, b""))
        return rc, b"", err

    host = Scripted(tmp_path, {"nvidia-smi": smi})
    answers.update({"-dci": (6, b"No compute instances found: not found\n"), "-dgi": (6, b"Not Found\n")})
    Repartition("0", ("1g.10gb",)).apply(host.system, ApplyContext())
    for flag, message in (
        ("-dci", "destroying compute instances: nvidia-smi exited 1: In use by another client"),
        ("-dgi", "destroying GPU instances: nvidia-smi exited 1: In use by another client"),
        ("-cgi", "creating GPU instances on GPU 0: nvidia-smi exited 1: In use by another client"),
    ):
        answers.clear()
        answers[flag] = (1, b"In use by another client\n")
        with pytest.raises(RetryableError) as exc:
            Repartition("0", ("1g.10gb",)).apply(host.system, ApplyContext())
        assert exc.value.message == message


def test_HST_MIG_observe_pending_mode_failed_listing_and_bytes_that_are_not_utf8(tmp_path: Any) -> None:
    from bcd_shared.units import UnitContext
    from bcd_shared.units.mig import MigGpu
    from bcd_shared.units.nvsmi import MigProfile

    answers: dict[str, tuple[int, bytes]] = {
        "query": (0, b"0, GPU-x, [N/A], [N/A]\n1, GPU-a, Enabled, Disabled\n"),
        "-lgip": (0, LGIP.encode().replace(b"GPU instance profiles:", b"GPU instance profiles\xff")),
        "-lgi": (0, LGI.encode().replace(b"GPU instances:", b"GPU instances\xfe")),
    }

    def smi(argv: tuple[str, ...], stdin: bytes | None) -> tuple[int, bytes, bytes]:
        rc, out = answers["query" if argv[1].startswith("--query") else argv[2]]
        return rc, out, b""

    host = Scripted(tmp_path, {"nvidia-smi": smi})
    s = decoded("mig-layout", {"layout": "all-1g.6gb"})
    o = REGISTRY["mig-layout"].observe(host.system, s, UnitContext())
    assert o.gpus == (MigGpu("1", "GPU-a", "Enabled", "Disabled", (MigProfile("4g.24gb", 0, 1),), ()),)
    answers["query"] = (0, b"1, GPU-x, [N/A], [N/A]\n0, GPU-a, Enabled, Disabled\n")
    o = REGISTRY["mig-layout"].observe(host.system, s, UnitContext())
    assert o.gpus is not None and len(o.gpus) == 1
    assert [p.name for p in o.gpus[0].profiles] == ["1g.6gb", "2g.12gb"]
    assert o.gpus[0].instances == ("1g.6gb", "2g.12gb")
    answers["-lgip"] = (6, LGIP.encode())  # a failed listing is not read, whatever it printed
    o = REGISTRY["mig-layout"].observe(host.system, s, UnitContext())
    assert o.gpus is not None and o.gpus[0].profiles == () and o.gpus[0].instances == ("1g.6gb", "2g.12gb")
    p = REGISTRY["mig-layout"].plan(s, type(o)(None, frozenset()))
    assert p.steps == () and p.terminal == ()


MODINFO_570_PROP = (
    b"filename: /lib/modules/nvidia.ko\nversion: 570.124.06\nlicense: NVIDIA\nvermagic: 6.8 \xff\n"
)


def test_HST_DRV_load_names_each_flavor_and_failure(tmp_path: Any) -> None:
    from bcd_shared.errors import RetryableError
    from bcd_shared.units import ApplyContext, RebootRequired
    from bcd_shared.units.nvidia import LoadDriver

    host = _driver_host(tmp_path / "a", MODINFO_570_PROP, None)
    with pytest.raises(TerminalError) as exc:
        LoadDriver("570", True, None).apply(host.system, ApplyContext())
    assert (
        exc.value.message == "the driver packages installed 570.124.06 (proprietary), not branch 570 (open)"
    )
    # modinfo failing is no module on disk, whatever it printed
    host = Scripted(
        tmp_path / "b",
        {
            "modinfo": lambda a, i: (1, MODINFO_570_PROP, b"modinfo: ERROR: Module nvidia not found.\n"),
            "modprobe": lambda a, i: (0, b"", b""),
        },
    )
    _tree(tmp_path / "b", {"/sys/module/nvidia/": "", "/proc/driver/nvidia/version": PROC_580_OPEN})
    LoadDriver("580", True, None).apply(host.system, ApplyContext())
    # the loaded driver's flavor is checked too
    with pytest.raises(RebootRequired) as boot:
        LoadDriver("580", False, None).apply(host.system, ApplyContext())
    assert boot.value.message == "the loaded driver is 580.82.07, not branch 580: reboot the node"
    for failing in ("nvidia", "nvidia_uvm"):
        host = Scripted(
            tmp_path / failing,
            {
                "modinfo": lambda a, i: (1, b"", b""),
                "modprobe": lambda a, i, f=failing: (
                    1 if a[-1] == f else 0,
                    b"",
                    b"modprobe: FATAL: no such device\n",
                ),
            },
        )
        with pytest.raises(RetryableError) as failed:
            LoadDriver("580", None, None).apply(host.system, ApplyContext())
        assert (
            failed.value.message
            == f"cannot load {failing}: modprobe exited 1: modprobe: FATAL: no such device"
        )


def test_HST_DRV_swap_unloads_nvidia_drm_too(tmp_path: Any) -> None:
    from bcd_shared.units import ApplyContext
    from bcd_shared.units.nvidia import LoadDriver

    host = _driver_host(tmp_path, None, PROC_580_OPEN)
    for mod in ("nvidia", "nvidia_drm"):
        host.system.write_atomic(f"/sys/module/{mod}/refcnt", b"0\n")
    LoadDriver("580", None, "570.1").apply(host.system, ApplyContext())
    assert [c[-1] for c in host.calls if c[:2] == ("modprobe", "-r")] == ["nvidia_drm", "nvidia"]


def test_HST_DRV_observe_reads_modinfo_of_nvidia_only_when_it_succeeds(tmp_path: Any) -> None:
    from bcd_shared.units import UnitContext
    from bcd_shared.units.nvidia import DriverVersion

    answer: dict[str, Any] = {"rc": 0}
    host = Scripted(
        tmp_path,
        {
            "modinfo": lambda a, i: (
                answer["rc"],
                MODINFO_570_PROP if a == ("modinfo", "nvidia") else b"",
                b"",
            ),
            "systemctl": lambda a, i: (0, b"", b""),
        },
    )
    s = decoded("nvidia-driver", {"branch": "570"})
    o = REGISTRY["nvidia-driver"].observe(host.system, s, UnitContext())
    assert o.installed == DriverVersion("570.124.06", "570", False) and o.loaded is None
    answer["rc"] = 1
    assert REGISTRY["nvidia-driver"].observe(host.system, s, UnitContext()).installed is None
    from bcd_shared.units.distro import Distro
    from bcd_shared.units.nvidia import DriverObserved

    nameless = DriverObserved(Distro("", "", "unknown"), None, None, False, False)
    p = REGISTRY["nvidia-driver"].plan(s, nameless)
    assert p.issues == (Issue("terminal", "bcd has no driver packages for this distribution"),)


def test_HST_LVL_converge_hands_settings_observation_and_context_through() -> None:
    """Every observe and plan of converge_unit sees the unit's own settings, context and observation,
    in each round, after stop_after and after a failed step."""
    from bcd_shared.errors import RetryableError
    from bcd_shared.units import ApplyContext, ConfigUnit, Plan, UnitCondition, UnitContext, converge_unit

    ctx = UnitContext(busy_gpus=frozenset({"GPU-a"}))
    seen: list[tuple[Any, ...]] = []
    cond = (UnitCondition("C", "R", "m"),)

    class Checked(ConfigUnit[str, tuple[str, Any]]):
        name = "checked"

        def __init__(self, plans: list[Plan]) -> None:
            self.plans = plans

        def decode(self, obj: dict[str, Any]) -> str:
            return "s"

        def observe(self, system: Any, settings: str | None, c: Any) -> tuple[str, Any]:
            seen.append(("observe", settings, c))
            return ("observed", settings)

        def plan(self, settings: str | None, observed: tuple[str, Any]) -> Plan:
            seen.append(("plan", settings, observed))
            return self.plans.pop(0) if len(self.plans) > 1 else self.plans[0]

    for plans in (
        [Plan((_Step("a"),)), Plan((_Step("b"),)), Plan()],  # rounds
        [Plan((_Step("a"),)), Plan((_Step("b"),)), Plan((_Step("c"),)), Plan()],  # every round, then a plan
        [Plan((_Step("a"),), stop_after=True), Plan(conditions=cond)],  # stop_after
        [Plan((_Step("a"), _Step("x", RetryableError("X", "no")))), Plan(conditions=cond)],  # a failed step
    ):
        seen.clear()
        r = converge_unit(Checked(plans), "s", _Host(), ctx, ApplyContext())  # type: ignore[arg-type]
        assert r.name == "checked"
        assert all(e == ("observe", "s", ctx) for e in seen[0::2]), seen
        assert all(e == ("plan", "s", ("observed", "s")) for e in seen[1::2]), seen
        assert len(seen) >= 4
    assert r.conditions == cond
