"""k8s-join at its edges, written against mutation testing's survivors (docs/mutation.md, "shared units:
k8s, _base, bootargs, distro, nvsmi, rootonly").

The planner is pure: each plan here is computed over a constructed observation and compared step for
step (exact argv, exact files, exact messages). The settings helpers and the files bcd renders are checked
word for word; the two steps (`Join`, `Release`) and the observer run over a host tree whose programs are
scripted and recorded. The unit's whole runs on the simulated host are in test_units_simhost.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from attrs import evolve
from bcd_shared.errors import RetryableError, TerminalError
from bcd_shared.system import CommandResult, LocalSystem
from bcd_shared.units import ApplyContext, ClusterPin, Issue, Plan, UnitCondition, UnitContext
from bcd_shared.units._base import HEADER_TEXT, Run, WriteFile, json_record
from bcd_shared.units.distro import Distro
from bcd_shared.units.k8s import (
    UNIT,
    Join,
    K8sObserved,
    K8sSettings,
    NodeView,
    Release,
    StagedTokenSource,
    check_label_key,
    containerd_config,
    containerd_dropin,
    join_configuration,
    label_safe,
    node_name,
    normalise_or_none,
    normalise_pin,
    normalise_server,
    parse_allowed_clusters,
    parse_taint,
    taint_text,
    workload_pods,
)

PIN = "ab" * 32
SERVER = "https://10.0.0.1:6443"
HEAD = f"# {HEADER_TEXT.format(unit='k8s-join')}\n"
KUBE = ("kubectl", "--kubeconfig", "/etc/kubernetes/kubelet.conf")
MODS = (HEAD + "overlay\nbr_netfilter\n").encode()
SYSCTLS = (
    HEAD
    + "net.bridge.bridge-nf-call-iptables = 1\n"
    + "net.bridge.bridge-nf-call-ip6tables = 1\n"
    + "net.ipv4.ip_forward = 1\n"
).encode()
CONFIG = 'version = 3\nimports = ["/etc/containerd/conf.d/*.toml"]\n'
RECORD = "/var/lib/bcd-hostconfig/k8s-join.json"


def settings(**kw: Any) -> K8sSettings:
    base: dict[str, Any] = {"server": SERVER, "caCertSha256": PIN, "tokenRef": "secret://k8s/join"}
    return UNIT.decode_settings(json.dumps({**base, **kw}))


def observed(**kw: Any) -> K8sObserved:
    """A joined, converged host: every file and service as bcd leaves them (containerd 2.x)."""
    base = K8sObserved(
        distro=Distro("ubuntu", "24.04", "ubuntu"),
        tools=(),
        modules_file=MODS,
        modules_loaded=("overlay", "br_netfilter"),
        sysctl_file=SYSCTLS,
        sysctls=tuple(
            (k, "1")
            for k in (
                "net.bridge.bridge-nf-call-iptables",
                "net.bridge.bridge-nf-call-ip6tables",
                "net.ipv4.ip_forward",
            )
        ),
        swap=False,
        containerd_config=CONFIG,
        containerd_dropin=containerd_dropin(3),
        containerd_major=2,
        containerd_active=True,
        kubelet_server=SERVER,
        kubeadm_version=None,
        hostname="gpu-node-01",
        record=None,
        kubelet_active=True,
        node=NodeView((), (), False),
        pods=(),
        identity_labels=(),
        allowed=(),
    )
    return evolve(base, **kw)


def record_of(s: K8sSettings, name: str = "gpu-node-01", **kw: Any) -> dict[str, Any]:
    """The k8s-join.json bcd writes, as read back."""
    body: dict[str, Any] = {
        "cluster": s.server,
        "caCertSha256": s.ca_sha256,
        "node": name,
        "labels": dict(sorted(s.labels)),
        "taints": [list(t) for t in s.taints],
        "gpu": s.gpu,
        "gpuApi": s.gpu_api,
        "released": False,
    }
    return json.loads(json_record("k8s-join", {**body, **kw}))


# -- settings helpers


def test_HST_K8S_02_03_server_normalised_and_each_refusal_named() -> None:
    assert normalise_server("https://10.0.0.1") == "https://10.0.0.1:443"
    assert normalise_server("https://K8s.Example.com:6443/") == "https://k8s.example.com:6443"
    assert normalise_server("https://[fd00::1]:6443") == "https://[fd00::1]:6443"
    assert normalise_server("https://[fd00::1]") == "https://[fd00::1]:443"
    shape = "is not https://host[:port]"
    for bad, message in (
        ("http://10.0.0.1", f"server: 'http://10.0.0.1' {shape}"),
        ("https://", f"server: 'https://' {shape}"),
        ("https://10.0.0.1:99999", f"server: 'https://10.0.0.1:99999' {shape}"),
        ("https://10.0.0.1:x", f"server: 'https://10.0.0.1:x' {shape}"),
        ("https://u@10.0.0.1", "server: credentials are not allowed"),
        ("https://:p@10.0.0.1", "server: credentials are not allowed"),
        ("https://10.0.0.1/api", "server: a path, query or fragment is not allowed"),
        ("https://10.0.0.1?x", "server: a path, query or fragment is not allowed"),
        ("https://10.0.0.1#f", "server: a path, query or fragment is not allowed"),
        ("https://10.0.0.1?", "server: a path, query or fragment is not allowed"),
        ("https://10.0.0.1#", "server: a path, query or fragment is not allowed"),
        ("https://bad_host", "server: 'bad_host' is not a host name or address"),
        ("https://-x.example", "server: '-x.example' is not a host name or address"),
    ):
        with pytest.raises(TerminalError) as exc:
            normalise_server(bad)
        assert (exc.value.reason, exc.value.message) == ("InvalidSettings", message), bad
    with pytest.raises(TerminalError, match=r"^there: credentials are not allowed$"):
        normalise_server("https://u:p@h", "there")
    assert normalise_or_none("https://h:1") == "https://h:1" and normalise_or_none("http://h") is None


def test_HST_K8S_04_pin_normalised_and_refused_by_length_and_digits() -> None:
    assert normalise_pin("sha256:" + "AB" * 32) == PIN == normalise_pin(PIN)
    for bad in ("ab" * 31, "ab" * 32 + "a", "sha1:" + PIN, "g" + PIN[1:], "sha256:", "SHA256:" + PIN):
        with pytest.raises(TerminalError) as exc:
            normalise_pin(bad)
        assert exc.value.message == "caCertSha256: must be 64 hex digits, optionally prefixed sha256:", bad
    with pytest.raises(TerminalError, match=r"^pin: must be"):
        normalise_pin("x", "pin")


def test_HST_K8S_54_55_allowed_clusters_parsed_and_each_fault_named() -> None:
    assert parse_allowed_clusters(" , ") == ()
    # an empty entry between two is skipped, not the end of the list
    assert parse_allowed_clusters(f"{SERVER}#sha256:{PIN},,https://h#sha256:{PIN}") == (
        ClusterPin(SERVER, PIN),
        ClusterPin("https://h:443", PIN),
    )
    assert parse_allowed_clusters(f" https://H.example#sha256:{PIN.upper()} , {SERVER}#sha256:{PIN},") == (
        ClusterPin("https://h.example:443", PIN),
        ClusterPin(SERVER, PIN),
    )
    for text, message in (
        (SERVER, f"allowed_clusters: {SERVER!r} is not https://host[:port]#sha256:<64 hex digits>"),
        (f"{SERVER}#{PIN}", f"allowed_clusters: '{SERVER}#{PIN}': the pin must start with sha256:"),
        (f"http://h#sha256:{PIN}", "allowed_clusters: 'http://h' is not https://host[:port]"),
        (f"{SERVER}#sha256:ab", "allowed_clusters: must be 64 hex digits, optionally prefixed sha256:"),
        # the first '#' ends the server: what follows is the pin, whatever it holds
        (f"https://h#x#sha256:{PIN}", "allowed_clusters: must be 64 hex digits, optionally prefixed sha256:"),
    ):
        with pytest.raises(ValueError) as exc:
            parse_allowed_clusters(text)
        assert str(exc.value) == message, text


def test_HST_K8S_08_label_keys_checked_part_by_part() -> None:
    for good in ("team", "bcd.dev/pool", "a" * 63, "x/" + "a" * 63, "A-b_c.d", "example.com/k8s.io"):
        check_label_key(good, "f")
    for bad, message in (
        ("a" * 64, f"f: {'a' * 64!r} is not a Kubernetes label key"),
        ("-team", "f: '-team' is not a Kubernetes label key"),
        ("team-", "f: 'team-' is not a Kubernetes label key"),
        ("", "f: '' is not a Kubernetes label key"),
        ("x/", "f: 'x/' is not a Kubernetes label key"),
        ("Bad_Prefix/x", "f: 'Bad_Prefix/x': the prefix is not a DNS subdomain"),
        ("/x", "f: '/x': the prefix is not a DNS subdomain"),
        ("kubernetes.io/x", "f: 'kubernetes.io/x': the kubernetes.io prefix is refused"),
        ("node.kubernetes.io/x", "f: 'node.kubernetes.io/x': the kubernetes.io prefix is refused"),
        ("k8s.io/x", "f: 'k8s.io/x': the k8s.io prefix is refused"),
        ("a.k8s.io/x", "f: 'a.k8s.io/x': the k8s.io prefix is refused"),
    ):
        with pytest.raises(TerminalError) as exc:
            check_label_key(bad, "f")
        assert exc.value.message == message, bad
    check_label_key("notkubernetes.io/x", "f")  # a suffix without the dot is another domain
    check_label_key("xk8s.io/x", "f")


def test_HST_K8S_09_taints_parsed_and_refused_naming_the_field() -> None:
    assert parse_taint("gpu=true:NoSchedule", "t") == ("gpu", "true", "NoSchedule")
    assert parse_taint("spot:PreferNoSchedule", "t") == ("spot", "", "PreferNoSchedule")
    assert parse_taint("a=:NoExecute", "t") == ("a", "", "NoExecute")
    assert taint_text(("gpu", "true", "NoSchedule")) == "gpu=true:NoSchedule"
    assert taint_text(("spot", "", "NoExecute")) == "spot:NoExecute"
    shape = "is not key[=value]:NoSchedule|PreferNoSchedule|NoExecute"
    for bad, message in (
        ("gpu:Evict", f"t: 'gpu:Evict' {shape}"),
        ("gpu=true", f"t: 'gpu=true' {shape}"),
        (":NoSchedule", f"t: ':NoSchedule' {shape}"),
        ("gpu=a:b:NoSchedule", f"t: 'gpu=a:b:NoSchedule' {shape}"),
        ("k8s.io/x:NoSchedule", "t: 'k8s.io/x': the k8s.io prefix is refused"),
        ("gpu=bad value:NoSchedule", "t: 'bad value' is not a Kubernetes label value"),
    ):
        with pytest.raises(TerminalError) as exc:
            parse_taint(bad, "t")
        assert exc.value.message == message, bad


def test_HST_K8S_37_node_name_and_label_safe_values() -> None:
    assert node_name("  GPU_Node 01\n") == "gpu-node-01"
    assert label_safe("NVIDIA H100 80GB HBM3") == "NVIDIA-H100-80GB-HBM3"
    assert label_safe("-_.x(y)._-") == "x-y"
    assert label_safe("a" * 70) == "a" * 63
    assert label_safe("a" * 62 + " b") == "a" * 62
    assert label_safe("Xeon X") == "Xeon-X"


def test_HST_K8S_06_07_10_11_12_decoded_settings_defaults_sorted_and_refusals() -> None:
    """HST-K8S-11/12: gpu defaults to true, gpuApi to device-plugin; HST-K8S-06: the version's minor;
    HST-K8S-07: 64 labels pass, a 65th or a non-string value is refused; HST-K8S-10: twice means the
    same key and effect, whatever the value, and one key with two effects is two taints."""
    s = settings()
    assert s == K8sSettings(SERVER, PIN, "secret://k8s/join", None, (), (), True, "device-plugin")
    assert s.minor is None
    assert settings(kubernetesVersion="v1.34.1").minor == "1.34"
    assert settings(kubernetesVersion="1.31").minor == "1.31"
    s = settings(
        server="https://h",
        caCertSha256="sha256:" + PIN.upper(),
        nodeLabels={"z": "1", "a": ""},
        taints=["spot:NoExecute", "gpu=true:NoSchedule"],
        gpu=False,
        gpuApi="dra",
    )
    assert s == K8sSettings(
        "https://h:443",
        PIN,
        "secret://k8s/join",
        None,
        (("a", ""), ("z", "1")),
        (("gpu", "true", "NoSchedule"), ("spot", "", "NoExecute")),
        False,
        "dra",
    )
    base = {"server": SERVER, "caCertSha256": PIN, "tokenRef": "secret://k8s/join"}
    for missing in ("server", "caCertSha256", "tokenRef"):
        with pytest.raises(TerminalError, match=f"^{missing}: required$"):
            UNIT.decode_settings(json.dumps({k: v for k, v in base.items() if k != missing}))
    for extra, message in (
        ({"nodeLabels": {"team": "a b"}}, "nodeLabels.team: 'a b' is not a Kubernetes label value"),
        ({"nodeLabels": {"k8s.io/a": "b"}}, "nodeLabels.k8s.io/a: 'k8s.io/a': the k8s.io prefix is refused"),
        ({"taints": ["x"]}, "taints[0]: 'x' is not key[=value]:NoSchedule|PreferNoSchedule|NoExecute"),
        ({"taints": ["a:NoSchedule", "a=1:NoSchedule"]}, "taints: a:NoSchedule appears twice"),
        ({"server": "https://" + "a" * 505}, "server: at most 512 characters, not 513"),
        ({"tokenRef": "secret://" + "a" * 257}, None),
        ({"kubernetesVersion": "1.1234"}, None),
        ({"surprise": 1}, "surprise: unknown field"),
    ):
        with pytest.raises(TerminalError) as exc:
            UNIT.decode_settings(json.dumps({**base, **extra}))
        if message is not None:
            assert exc.value.message == message
    many = [f"t{i}:NoSchedule" for i in range(65)]
    with pytest.raises(TerminalError, match=r"^taints: at most 64 entries, not 65$"):
        settings(taints=many)
    assert len(settings(taints=many[:64]).taints) == 64
    assert settings(tokenRef="secret://Pool_1/K8s.join-A").token_ref == "secret://Pool_1/K8s.join-A"
    labels = {f"l{i}": "v" for i in range(64)}
    assert len(settings(nodeLabels=labels).labels) == 64
    with pytest.raises(TerminalError, match=r"^nodeLabels: at most 64 entries, not 65$"):
        settings(nodeLabels={**labels, "l64": "v"})
    with pytest.raises(TerminalError, match=r"^nodeLabels\.team: must be a string$"):
        settings(nodeLabels={"team": 1})
    with pytest.raises(TerminalError, match=r"^nodeLabels: must be an object of strings$"):
        settings(nodeLabels=["team"])
    # the same key with two effects is two taints
    assert len(settings(taints=["a:NoSchedule", "a:NoExecute"]).taints) == 2
    assert settings(server="https://" + "a" * 48 + ".example").server.endswith(".example:443")


def test_HST_K8S_56_58_59_validate_against_roots_allowlist_word_for_word() -> None:
    s = settings()
    with pytest.raises(TerminalError) as exc:
        UNIT.validate(s, UnitContext())
    assert (exc.value.reason, exc.value.message) == (
        "ClusterNotAllowed",
        "joining a Kubernetes cluster needs [kubernetes] allowed_clusters in bcd's config",
    )
    with pytest.raises(TerminalError) as exc:
        UNIT.validate(s, UnitContext(allowed_clusters=(ClusterPin(SERVER, "cd" * 32),)))
    assert (exc.value.reason, exc.value.message) == (
        "ClusterNotAllowed",
        f"k8s-join: {SERVER} with CA pin sha256:{PIN} is not in [kubernetes] allowed_clusters",
    )
    UNIT.validate(
        s, UnitContext(allowed_clusters=(ClusterPin("https://x:443", PIN), ClusterPin(SERVER, PIN)))
    )


def test_HST_K8S_62_63_workload_pods_only() -> None:
    def pod(name: str, phase: str | None = "Running", ns: str | None = "ml", **meta: Any) -> dict[str, Any]:
        m: dict[str, Any] = {"name": name, **meta}
        if ns is not None:
            m["namespace"] = ns
        return {"metadata": m, "status": {} if phase is None else {"phase": phase}}

    doc = {
        "items": [
            pod("z"),
            pod("a", "Pending"),
            pod("nons", ns=None),
            pod("done", "Succeeded"),
            pod("failed", "Failed"),
            pod("nophase", None),
            pod("ds", ownerReferences=[{"kind": "ReplicaSet"}, {"kind": "DaemonSet"}]),
            pod("rs", ownerReferences=[{"kind": "ReplicaSet"}]),
            pod("nullowners", ownerReferences=None),
            pod("mirror", annotations={"kubernetes.io/config.mirror": ""}),
            pod("other", annotations={"x": "y"}),
            pod("nullnotes", annotations=None),
            {"status": {"phase": "Running"}},
            {"metadata": {"namespace": "ml", "name": "nostatus"}},  # no phase: not running
        ]
    }
    assert workload_pods(doc) == (
        ("default", ""),
        ("default", "nons"),
        ("ml", "a"),
        ("ml", "nullnotes"),
        ("ml", "nullowners"),
        ("ml", "other"),
        ("ml", "rs"),
        ("ml", "z"),
    )
    assert workload_pods({}) == ()


# -- rendered files


def test_HST_K8S_33_34_join_configuration_word_for_word() -> None:
    s = settings(
        server="https://k8s.example.com",
        nodeLabels={"team": "ml", "bcd.dev/pool": "gpu-a"},
        taints=["gpu=true:NoSchedule", "spot:PreferNoSchedule"],
    )
    common = (
        f"{HEAD}"
        "{api}"
        "kind: JoinConfiguration\n"
        "discovery:\n"
        "  bootstrapToken:\n"
        '    apiServerEndpoint: "k8s.example.com:443"\n'
        '    token: "abcdef.0123456789abcdef"\n'
        "    caCertHashes:\n"
        f'    - "sha256:{PIN}"\n'
        "nodeRegistration:\n"
        '  name: "gpu-node-01"\n'
        '  criSocket: "unix:///run/containerd/containerd.sock"\n'
        "  taints:\n"
        '  - key: "gpu"\n'
        '    value: "true"\n'
        '    effect: "NoSchedule"\n'
        '  - key: "spot"\n'
        '    effect: "PreferNoSchedule"\n'
        "  kubeletExtraArgs:\n"
    )
    v3 = join_configuration(s, "gpu-node-01", "abcdef.0123456789abcdef", (1, 30))
    assert v3 == common.format(api="apiVersion: kubeadm.k8s.io/v1beta3\n") + (
        '    node-labels: "bcd.dev/pool=gpu-a,team=ml"\n'
    )
    v4 = join_configuration(s, "gpu-node-01", "abcdef.0123456789abcdef", (1, 31))
    assert v4 == common.format(api="apiVersion: kubeadm.k8s.io/v1beta4\n") + (
        '  - name: "node-labels"\n    value: "bcd.dev/pool=gpu-a,team=ml"\n'
    )
    assert "v1beta4" in join_configuration(s, "n", "t", (2, 0))
    bare = join_configuration(settings(), "n", "t", (1, 29))
    assert bare.endswith('  criSocket: "unix:///run/containerd/containerd.sock"\n  taints: []\n')


def test_HST_K8S_26_to_29_containerd_files_word_for_word() -> None:
    assert (
        containerd_dropin(2)
        == (
            HEAD + "version = 2\n\n"
            '[plugins."io.containerd.grpc.v1.cri"]\n'
            "  enable_cdi = true\n"
            '  cdi_spec_dirs = ["/etc/cdi", "/var/run/cdi"]\n\n'
            '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]\n'
            "  SystemdCgroup = true\n"
        ).encode()
    )
    assert containerd_dropin(3).decode().splitlines()[1:4] == [
        "version = 3",
        "",
        '[plugins."io.containerd.cri.v1.runtime"]',
    ]
    assert containerd_config(None, 2) == HEAD + 'version = 2\nimports = ["/etc/containerd/conf.d/*.toml"]\n'
    imp = 'imports = ["/etc/containerd/conf.d/*.toml"]\n'
    assert (
        containerd_config("# mine\nversion = 2\n[a]\nb = 1\n", 3) == f"# mine\nversion = 2\n{imp}[a]\nb = 1\n"
    )
    assert containerd_config("  version=3\n", 3) == f"  version=3\n{imp}"
    assert containerd_config("[a]\nb = 1\n", 2) == f"{imp}[a]\nb = 1\n"  # no version line: at the top
    assert containerd_config('imports = ["/x/*.toml", "/etc/containerd/conf.d/*.toml"]\n', 2) is None
    for text, message in (
        (
            'imports = ["/x/*.toml"]\n',
            "k8s-join: /etc/containerd/config.toml has an imports list without "
            "/etc/containerd/conf.d/*.toml; add it by hand",
        ),
        (
            'imports = "/etc/containerd/conf.d/*.toml"\n',
            "k8s-join: /etc/containerd/config.toml has an imports list without "
            "/etc/containerd/conf.d/*.toml; add it by hand",
        ),
    ):
        with pytest.raises(TerminalError) as exc:
            containerd_config(text, 2)
        assert (exc.value.reason, exc.value.message) == ("ContainerdConfig", message)
    with pytest.raises(TerminalError) as exc:
        containerd_config("version = = 2\n", 2)
    assert exc.value.reason == "ContainerdConfig"
    assert exc.value.message.startswith("k8s-join: /etc/containerd/config.toml is not TOML (")
    assert exc.value.message.endswith("); fix it")


# -- plan: packages


APT_KEY = ("curl", "-fsSL", "--proto", "=https", "-o", "/var/lib/bcd-hostconfig/k8s-release.key")


def test_HST_K8S_14_to_19_22_package_steps_per_family() -> None:
    s = settings(kubernetesVersion="1.34.1")
    missing = ("kubeadm", "kubelet", "kubectl", "containerd")
    base = "https://pkgs.k8s.io/core:/stable:/v1.34"
    p = UNIT.plan(s, observed(tools=missing))
    assert p.stop_after and p.issues == () and p.conditions == ()
    assert p.steps == (
        Run((*APT_KEY, f"{base}/deb/Release.key"), message="fetching the pkgs.k8s.io key"),
        Run(
            (
                "gpg",
                "--batch",
                "--yes",
                "--dearmor",
                "-o",
                "/etc/apt/keyrings/bcd-kubernetes.gpg",
                "/var/lib/bcd-hostconfig/k8s-release.key",
            ),
            message="installing the pkgs.k8s.io key",
        ),
        WriteFile(
            "/etc/apt/sources.list.d/bcd-kubernetes.list",
            (HEAD + f"deb [signed-by=/etc/apt/keyrings/bcd-kubernetes.gpg] {base}/deb/ /\n").encode(),
        ),
        Run(("apt-get", "update"), message="installing Kubernetes packages"),
        Run(
            (
                "env",
                "DEBIAN_FRONTEND=noninteractive",
                "apt-get",
                "install",
                "-y",
                "--no-install-recommends",
                "-o",
                "Dpkg::Options::=--force-confold",
                *missing,
            ),
            message="installing Kubernetes packages",
        ),
        Run(("apt-mark", "hold", "kubeadm", "kubelet", "kubectl")),
    )
    p = UNIT.plan(s, observed(tools=("kubelet",), distro=Distro("rocky", "9", "rhel")))
    repo = (
        HEAD + "[bcd-kubernetes]\nname=Kubernetes (bcd)\n"
        f"baseurl={base}/rpm/\nenabled=1\ngpgcheck=1\ngpgkey={base}/rpm/repodata/repomd.xml.key\n"
        "exclude=kubelet kubeadm kubectl cri-tools kubernetes-cni\n"
    )
    assert p.stop_after and p.steps == (
        WriteFile("/etc/yum.repos.d/bcd-kubernetes.repo", repo.encode()),
        Run(
            ("dnf", "-y", "install", "--disableexcludes=bcd-kubernetes", "kubelet"),
            message="installing Kubernetes packages",
        ),
    )
    # containerd alone: the family's own install, without the Kubernetes repository
    p = UNIT.plan(settings(), observed(tools=("containerd",), distro=Distro("rocky", "9", "rhel")))
    assert p == Plan(
        (Run(("dnf", "-y", "install", "containerd"), message="installing containerd"),), stop_after=True
    )


def test_HST_K8S_20_21_missing_packages_refused_word_for_word() -> None:
    p = UNIT.plan(settings(), observed(tools=("kubeadm", "kubectl", "containerd")))
    assert p == Plan(
        (),
        (
            Issue(
                "terminal",
                "k8s-join: kubeadm, kubectl missing and no kubernetesVersion says which to install",
            ),
        ),
    )
    none = "k8s-join: bcd has no Kubernetes packages for "
    for distro, shown in (
        (Distro("alpine", "3", "unknown"), "alpine"),
        (Distro("", "", "unknown"), "this distribution"),
    ):
        p = UNIT.plan(settings(kubernetesVersion="1.34"), observed(tools=("kubelet",), distro=distro))
        assert p == Plan((), (Issue("terminal", none + shown),))
        p = UNIT.plan(settings(), observed(tools=("containerd",), distro=distro))
        assert p == Plan((), (Issue("terminal", none + shown),))
    p = UNIT.plan(
        settings(kubernetesVersion="1.34"), observed(tools=("kubelet",), distro=Distro("sles", "15", "suse"))
    )
    assert p.issues == (Issue("terminal", none + "sles"),)


# -- plan: kernel, containerd, join


def test_HST_K8S_23_24_25_kernel_steps_for_what_differs() -> None:
    s = settings()
    assert UNIT.plan(s, observed()) == Plan((WriteFile(RECORD, json_record("k8s-join", record_of(s) | {})),))
    o = observed(
        modules_file=None,
        modules_loaded=("br_netfilter",),
        sysctl_file=b"old",
        sysctls=(("net.bridge.bridge-nf-call-iptables", None), ("net.ipv4.ip_forward", "0"), ("x", "1")),
        swap=True,
        record=record_of(s),
    )
    assert UNIT.plan(s, o).steps == (
        WriteFile("/etc/modules-load.d/90-bcd-k8s.conf", MODS),
        Run(("modprobe", "--", "overlay"), message="cannot load overlay"),
        WriteFile("/etc/sysctl.d/90-bcd-k8s.conf", SYSCTLS),
        Run(
            ("sysctl", "-w", "net.bridge.bridge-nf-call-iptables=1"),
            message="cannot set net.bridge.bridge-nf-call-iptables",
        ),
        Run(("sysctl", "-w", "net.ipv4.ip_forward=1"), message="cannot set net.ipv4.ip_forward"),
        Run(("swapoff", "-a")),
    )
    o = observed(modules_loaded=("overlay",), record=record_of(s))
    assert UNIT.plan(s, o).steps == (
        Run(("modprobe", "--", "br_netfilter"), message="cannot load br_netfilter"),
    )


def test_HST_K8S_26_27_30_31_containerd_steps() -> None:
    s = settings()
    rec = record_of(s)
    restart = Run(("systemctl", "restart", "containerd.service"))
    # the config version follows containerd's major version: 2.x reads 3, older (or unknown) 2
    for major, version in ((None, 2), (1, 2), (2, 3), (3, 3)):
        fresh = HEAD + f'version = {version}\nimports = ["/etc/containerd/conf.d/*.toml"]\n'
        o = observed(containerd_major=major, containerd_config=None, containerd_dropin=None, record=rec)
        assert UNIT.plan(s, o).steps == (
            WriteFile("/etc/containerd/config.toml", fresh.encode()),
            WriteFile("/etc/containerd/conf.d/90-bcd-k8s.toml", containerd_dropin(version)),
            restart,
        ), major
    o = observed(containerd_dropin=containerd_dropin(2), record=rec)
    assert UNIT.plan(s, o).steps == (
        WriteFile("/etc/containerd/conf.d/90-bcd-k8s.toml", containerd_dropin(3)),
        restart,
    )
    o = observed(containerd_config="version = 3\n", record=rec)
    assert UNIT.plan(s, o).steps == (
        WriteFile("/etc/containerd/config.toml", CONFIG.encode()),
        restart,
    )
    assert UNIT.plan(s, observed(containerd_active=False, record=rec)).steps == (
        Run(("systemctl", "enable", "--now", "containerd.service")),
    )
    # changed and stopped: the restart starts it, once
    o = observed(containerd_active=False, containerd_dropin=b"", record=rec)
    assert UNIT.plan(s, o).steps[-1] == restart and len(UNIT.plan(s, o).steps) == 2
    p = UNIT.plan(s, observed(containerd_config='imports = ["/x"]\n', swap=True))
    assert p == Plan(
        (),
        (
            Issue(
                "terminal",
                "k8s-join: /etc/containerd/config.toml has an imports list without "
                "/etc/containerd/conf.d/*.toml; add it by hand",
            ),
        ),
    )


def test_HST_K8S_32_37_38_39_join_step_and_its_refusals() -> None:
    s = settings(taints=["gpu=true:NoSchedule"], nodeLabels={"team": "ml"}, gpu=False)
    ids = (("bcd.dev/node-id", "n-1"),)
    o = observed(
        kubelet_server=None, kubeadm_version=(1, 31), hostname="GPU_Node 01", identity_labels=ids, swap=True
    )
    p = UNIT.plan(s, o)
    assert p.issues == () and p.conditions == () and not p.stop_after
    assert p.steps[0] == Run(("swapoff", "-a"))
    join = p.steps[1]
    assert isinstance(join, Join) and len(p.steps) == 2
    assert (join.settings, join.name, join.kubeadm) == (s, "gpu-node-01", (1, 31))
    assert json.loads(join.record) == record_of(s, labels={"bcd.dev/node-id": "n-1", "team": "ml"}, gpu=False)
    assert join.describe() == f"kubeadm join {SERVER} as gpu-node-01"
    p = UNIT.plan(s, evolve(o, kubeadm_version=None))
    assert p == Plan(
        (Run(("swapoff", "-a")),), (Issue("retryable", "k8s-join: cannot read kubeadm's version"),)
    )
    for host in ("bad.name.", "a" * 254, "ünï"):
        p = UNIT.plan(s, evolve(o, hostname=host))
        assert p == Plan(
            (),
            (
                Issue(
                    "terminal",
                    f"k8s-join: the Node name {node_name(host)!r} (from the host name) "
                    "is not a DNS subdomain",
                ),
            ),
        )


# -- plan: kept


def test_HST_K8S_40_another_cluster_refused_after_normalising() -> None:
    s = settings(server="https://h.example")
    assert UNIT.plan(s, observed(kubelet_server="https://H.example:443", record=record_of(s))).converged
    for server, shown in (
        ("https://h.example:6443", "https://h.example:6443"),
        ("not a url", "not a url"),
        ("", "a cluster /etc/kubernetes/kubelet.conf names no server of"),
    ):
        p = UNIT.plan(s, observed(kubelet_server=server, swap=True))
        assert p == Plan(
            (),
            (
                Issue(
                    "terminal",
                    f"k8s-join: the kubelet is joined to {shown}, not https://h.example:443: "
                    "reset it by hand (kubeadm reset) to move it",
                ),
            ),
        )


def test_HST_K8S_41_kubelet_started_and_node_read_with_its_credentials() -> None:
    s = settings()
    rec = record_of(s, name="recorded-name")
    p = UNIT.plan(s, observed(kubelet_active=False, node=None, record=rec))
    assert p == Plan(
        (Run(("systemctl", "enable", "--now", "kubelet.service")),),
        (Issue("retryable", "k8s-join: cannot read Node recorded-name with the kubelet's credentials"),),
    )
    p = UNIT.plan(s, observed(node=None, record={**rec, "node": ""}))
    assert p.issues == (
        Issue("retryable", "k8s-join: cannot read Node gpu-node-01 with the kubelet's credentials"),
    )


def test_HST_K8S_42_43_labels_set_and_only_bcds_removed() -> None:
    """HST-K8S-42: the labels are kept with the kubelet's own credentials (`kubectl --kubeconfig
    /etc/kubernetes/kubelet.conf label`); 43: only bcd's old labels and bcd.dev/ ones are removed. The
    identity labels are set beside the spec's, but bcd.dev/site is never set (see compliance-notes)."""
    s = settings(nodeLabels={"team": "ml", "zone": "a"})
    ids = (("bcd.dev/node-id", "n-1"), ("zone", "b"))  # identity wins over the spec
    node = NodeView(
        (
            ("bcd.dev/node-id", "n-1"),
            ("bcd.dev/old", "x"),
            ("kubernetes.io/hostname", "gpu-node-01"),
            ("old-mine", "1"),
            ("team", "other"),
            ("theirs", "2"),
        ),
        (),
        False,
    )
    rec = record_of(s, name="n", labels={"old-mine": "1"})
    p = UNIT.plan(s, observed(node=node, identity_labels=ids, record=rec))
    assert p.steps[0] == Run(
        (*KUBE, "label", "node", "n", "--overwrite", "team=ml", "zone=b", "bcd.dev/old-", "old-mine-"),
        message="labelling the Node",
    )
    assert p.steps[1:] == (
        WriteFile(
            RECORD,
            json_record(
                "k8s-join",
                {
                    k: v
                    for k, v in record_of(
                        s, name="n", labels={"bcd.dev/node-id": "n-1", "team": "ml", "zone": "b"}
                    ).items()
                    if k != "_comment"
                },
            ),
            0o644,
        ),
    )
    assert p.issues == () and p.conditions == ()
    # no record: only bcd.dev/ labels are bcd's to remove
    p = UNIT.plan(s, observed(node=node, identity_labels=ids, record=None))
    assert p.steps[0].argv[-1] == "bcd.dev/old-"  # type: ignore[attr-defined]
    # a record whose labels are null
    p = UNIT.plan(s, observed(node=node, identity_labels=ids, record={**rec, "labels": None}))
    assert p.steps[0].argv[-1] == "bcd.dev/old-"  # type: ignore[attr-defined]


def test_HST_K8S_66_released_node_uncordoned_and_record_rewritten() -> None:
    s = settings()
    rec = record_of(s, released=True)
    p = UNIT.plan(s, observed(record=rec))
    assert p.steps == (
        Run((*KUBE, "uncordon", "gpu-node-01"), message="uncordoning the Node"),
        WriteFile(
            RECORD, json_record("k8s-join", {k: v for k, v in record_of(s).items() if k != "_comment"}), 0o644
        ),
    )
    assert UNIT.plan(s, observed(record=record_of(s))) == Plan()


def test_HST_K8S_46_to_49_taint_drift_condition_word_for_word() -> None:
    """HST-K8S-46..48: drift is reported as the admin's command, never changed by bcd; HST-K8S-49: the
    labels are reconciled all the same while the taints drift."""
    s_taints = ["gpu=true:NoSchedule", "spot:PreferNoSchedule"]
    s = settings(taints=s_taints)
    registered = [["gpu", "true", "NoSchedule"], ["old", "", "NoExecute"]]
    rec = record_of(s, taints=registered)
    node = NodeView(
        (),
        (("gpu", "true", "NoSchedule"), ("old", "", "NoExecute"), ("theirs", "", "NoSchedule")),
        False,
    )
    p = UNIT.plan(s, observed(node=node, record=rec))
    assert p.steps == () and p.issues == ()
    assert p.conditions == (
        UnitCondition(
            "KubernetesTaintsDrift",
            "NodeRestriction",
            "kubectl taint node gpu-node-01 --overwrite "
            "gpu=true:NoSchedule spot:PreferNoSchedule old:NoExecute-",
        ),
    )
    # a label that differs too is set in the same pass: the drift stops nothing but the taints
    node_l = NodeView((("team", "other"),), node.taints, False)
    p = UNIT.plan(settings(taints=s_taints, nodeLabels={"team": "ml"}), observed(node=node_l, record=rec))
    assert p.steps[0] == Run(
        (*KUBE, "label", "node", "gpu-node-01", "--overwrite", "team=ml"), message="labelling the Node"
    )
    assert [c.type for c in p.conditions] == ["KubernetesTaintsDrift"] and p.conditions[0].message.endswith(
        "old:NoExecute-"
    )
    # the same key with another value counts as drift; the record keeps what was registered
    node2 = NodeView((), (("gpu", "false", "NoSchedule"), ("spot", "", "PreferNoSchedule")), False)
    rec2 = record_of(s)
    p = UNIT.plan(s, observed(node=node2, record=rec2))
    assert p.conditions[0].message == (
        "kubectl taint node gpu-node-01 --overwrite gpu=true:NoSchedule spot:PreferNoSchedule"
    )
    assert p.steps == ()
    # without a record, the unit's own taints count as registered
    node3 = NodeView((), (("gpu", "true", "NoSchedule"), ("spot", "", "PreferNoSchedule")), False)
    assert UNIT.plan(s, observed(node=node3, record=record_of(s))) == Plan()
    p = UNIT.plan(s, observed(node=NodeView((), (("gpu", "true", "NoSchedule"),), False), record=None))
    assert p.conditions[0].message == (
        "kubectl taint node gpu-node-01 --overwrite gpu=true:NoSchedule spot:PreferNoSchedule"
    )
    # a malformed registered entry is ignored, not a crash
    rec3 = record_of(s, taints=[["gpu", "true", "NoSchedule"], ["spot", "", "PreferNoSchedule"], ["x"]])
    assert UNIT.plan(s, observed(node=node3, record=rec3)).conditions == ()


# -- plan: release


def test_HST_K8S_61_67_release_planned_only_on_a_node_bcd_joined() -> None:
    s = settings()
    rec = record_of(s, name="n-7")
    pods = (("ml", "train"),)
    assert UNIT.plan(None, observed(record=None, pods=pods)) == Plan()
    assert UNIT.plan(None, observed(record=rec, kubelet_server=None, pods=pods)) == Plan()
    assert not UNIT.plan(None, observed(record={**rec, "released": True}, pods=pods)).steps  # released once
    body = {k: v for k, v in rec.items() if k != "_comment"} | {"released": True}
    assert UNIT.plan(None, observed(record=rec, pods=pods)) == Plan(
        (Release("n-7", pods, json_record("k8s-join", body)),)
    )
    # a record whose comment was edited is written back with bcd's own header
    edited = {**rec, "_comment": "edited by hand"}
    assert UNIT.plan(None, observed(record=edited, pods=pods)) == Plan(
        (Release("n-7", pods, json_record("k8s-join", body)),)
    )
    nameless = {k: v for k, v in rec.items() if k != "node"}
    release = UNIT.plan(None, observed(record=nameless, hostname="Host_A")).steps[0]
    assert isinstance(release, Release) and release.name == "host-a"
    assert release.describe() == "release Node host-a (cordon, delete 0 workload pods)"


def test_HST_K8S_64_a_released_member_raises_kubernetes_released() -> None:
    """HST-K8S-64: after the release, while k8s-join is absent and the node is still a member, the unit
    raises `KubernetesReleased` (reason `Released`), naming the node and its cluster; it plans no step.
    Not before the release, not once the node left the cluster, not when the unit is back."""
    s = settings()
    rec = record_of(s, name="n-7")
    released = {**rec, "released": True}
    plan = UNIT.plan(None, observed(record=released, kubelet_server="https://10.0.0.1:6443"))
    assert plan.steps == () and plan.issues == ()
    assert [(c.type, c.reason) for c in plan.conditions] == [("KubernetesReleased", "Released")]
    assert plan.conditions[0].message == (
        "k8s-join: node n-7 was released when k8s-join left the spec: cordoned, its workload pods "
        "deleted, the kubelet still a member of https://10.0.0.1:6443; remove the node from the "
        "cluster, or add k8s-join back to uncordon it"
    )
    nameless = {k: v for k, v in released.items() if k != "node"}  # an older record: the host's name
    (cond,) = UNIT.plan(None, observed(record=nameless, hostname="Host_A")).conditions
    assert cond.message.startswith("k8s-join: node host-a was released")
    assert UNIT.plan(None, observed(record=rec)).conditions == ()  # not released yet: the Release step
    assert UNIT.plan(None, observed(record=released, kubelet_server=None)) == Plan()  # no longer a member
    back = UNIT.plan(s, observed(record=released))
    assert all(c.type != "KubernetesReleased" for c in back.conditions)
    assert any("uncordon" in step.describe() for step in back.steps)


# -- steps and the observer on a host whose programs are scripted


class Host:
    """A host tree whose programs answer from a table (program -> function) and are recorded."""

    def __init__(
        self, tmp: Path, answers: dict[str, Callable[[tuple[str, ...]], tuple[int, str | bytes, str]]]
    ) -> None:
        self.calls: list[tuple[str, ...]] = []

        def tool(name: str) -> Any:
            def run(system: Any, argv: Any, stdin: bytes | None) -> CommandResult:
                self.calls.append(tuple(argv))
                rc, out, err = answers[name](tuple(argv))
                data = out if isinstance(out, bytes) else out.encode()
                return CommandResult(tuple(argv), rc, data, err.encode())

            return run

        self.system = LocalSystem(tmp, tools={name: tool(name) for name in answers})


class Tokens:
    def __init__(self, token: str) -> None:
        self.token = token
        self.fetched: list[str] = []
        self.consumed_count = 0

    def fetch(self, token_ref: str) -> str:
        self.fetched.append(token_ref)
        return self.token

    def consumed(self) -> None:
        self.consumed_count += 1


def test_HST_K8S_32_35_36_53_join_step_applied(tmp_path: Path) -> None:
    s = settings()
    seen: dict[str, Any] = {}

    def kubeadm(argv: tuple[str, ...]) -> tuple[int, str, str]:
        path = tmp_path / "var/lib/bcd-hostconfig/k8s-join.yaml"
        seen["yaml"], seen["mode"] = path.read_text(), path.stat().st_mode & 0o777
        return seen.get("rc", 0), "", "preflight failed\n"

    host = Host(tmp_path, {"kubeadm": kubeadm})
    guarded: list[str] = []
    step = Join(s, "n", (1, 31), b"{}\n")
    with pytest.raises(RetryableError) as exc:
        step.apply(host.system, ApplyContext())
    assert (exc.value.reason, exc.value.message) == (
        "NoToken",
        "k8s-join: no way to fetch the bootstrap token here",
    )
    tokens = Tokens(" abcdef.0123456789abcdef\n")
    step.apply(host.system, ApplyContext(guard=guarded.append, tokens=tokens))
    assert host.calls == [("kubeadm", "join", "--config", "/var/lib/bcd-hostconfig/k8s-join.yaml")]
    assert (
        seen["yaml"] == join_configuration(s, "n", "abcdef.0123456789abcdef", (1, 31))
        and seen["mode"] == 0o600
    )
    assert tokens.fetched == ["secret://k8s/join"] and tokens.consumed_count == 1
    assert not host.system.exists("/var/lib/bcd-hostconfig/k8s-join.yaml")
    assert (
        host.system.read_bytes(RECORD) == b"{}\n" and (tmp_path / RECORD[1:]).stat().st_mode & 0o777 == 0o644
    )
    assert guarded == ["/var/lib/bcd-hostconfig/k8s-join.yaml"] * 2 + [RECORD]
    # kubeadm fails: the YAML (the token) is removed all the same, the token kept for the next try
    host.system.remove(RECORD)
    seen["rc"] = 1
    with pytest.raises(RetryableError) as exc:
        step.apply(host.system, ApplyContext(tokens=tokens))
    assert (exc.value.reason, exc.value.message) == (
        "ToolFailed",
        "kubeadm join failed: kubeadm exited 1: preflight failed",
    )
    assert not host.system.exists("/var/lib/bcd-hostconfig/k8s-join.yaml") and not host.system.exists(RECORD)
    assert tokens.consumed_count == 1
    for bad in (
        "abcdef.0123456789abcde",
        "ABCDEF.0123456789abcdef",
        "abcdef-0123456789abcdef",
        "x\nabcdef.0123456789abcdef",
    ):
        with pytest.raises(TerminalError) as t:
            step.apply(host.system, ApplyContext(tokens=Tokens(bad)))
        assert (t.value.reason, t.value.message) == (
            "BadToken",
            "k8s-join: the fetched bootstrap token is not a kubeadm token",
        ), bad
    assert len(host.calls) == 2  # never ran kubeadm with a bad token


def test_HST_K8S_61_62_65_release_step_applied(tmp_path: Path) -> None:
    """HST-K8S-61/62: cordon, then each workload pod deleted with its own grace period; HST-K8S-65: that
    is all, nothing resets or stops the kubelet (kubeadm and systemctl answer here, and are never run)."""

    def kubectl(argv: tuple[str, ...]) -> tuple[int, str, str]:
        if "gone" in argv:
            return 1, "", 'Error from server (NotFound): pods "gone" not found\n'
        if "stuck" in argv:
            return 1, "", "forbidden\n"
        return 0, "", ""

    ok = lambda argv: (0, "", "")  # noqa: E731
    host = Host(tmp_path, {"kubectl": kubectl, "kubeadm": ok, "systemctl": ok, "kubelet": ok})
    Release("n", (("ml", "a"), ("ml", "gone")), b"rec\n").apply(host.system, ApplyContext())
    assert host.calls == [
        (*KUBE, "cordon", "n"),
        (*KUBE, "delete", "pod", "-n", "ml", "a", "--wait=false"),
        (*KUBE, "delete", "pod", "-n", "ml", "gone", "--wait=false"),
    ]
    assert (
        host.system.read_bytes(RECORD) == b"rec\n" and (tmp_path / RECORD[1:]).stat().st_mode & 0o777 == 0o644
    )
    host.system.remove(RECORD)
    with pytest.raises(RetryableError) as exc:
        Release("n", (("ml", "stuck"),), b"rec\n").apply(host.system, ApplyContext())
    assert exc.value.message == "deleting ml/stuck: kubectl exited 1: forbidden"
    assert not host.system.exists(RECORD)
    host2 = Host(tmp_path, {"kubectl": lambda argv: (1, "", "Unauthorized\n")})
    with pytest.raises(RetryableError) as exc:
        Release("n", (), b"rec\n").apply(host2.system, ApplyContext())
    assert exc.value.message == "cordoning the Node: kubectl exited 1: Unauthorized"


def test_HST_K8S_52_53_staged_token_source(tmp_path: Path) -> None:
    system = LocalSystem(tmp_path)
    staged = StagedTokenSource(system)
    with pytest.raises(RetryableError) as exc:
        staged.fetch("secret://x")
    assert (exc.value.reason, exc.value.message) == (
        "NoToken",
        "k8s-join: the node has not staged the bootstrap token yet",
    )
    system.write_atomic("/var/lib/bcd-hostconfig/k8s/bootstrap-token", b" abcdef.0123456789abcdef \n", 0o600)
    assert staged.fetch("secret://x") == "abcdef.0123456789abcdef"
    staged.consumed()
    assert not system.exists("/var/lib/bcd-hostconfig/k8s/bootstrap-token")


def _files(tmp: Path, files: dict[str, str]) -> None:
    for path, text in files.items():
        target = tmp / path.lstrip("/")
        if path.endswith("/"):
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)


KUBELET_CONF = "apiVersion: v1\nclusters:\n- cluster:\n    server: 'https://10.0.0.1:6443'\n  name: k\n"
NODE_JSON = {
    "metadata": {"name": "gpu-node-01", "labels": {"team": "ml", "bcd.dev/node-id": "n-1"}},
    "spec": {
        "taints": [
            {"key": "gpu", "value": "true", "effect": "NoSchedule"},
            {"key": "spot", "effect": "NoExecute"},
        ],
        "unschedulable": True,
    },
}


def test_HST_K8S_observe_a_joined_host(tmp_path: Path) -> None:
    _files(
        tmp_path,
        {
            "/etc/os-release": 'ID=ubuntu\nVERSION_ID="24.04"\n',
            "/etc/hostname": "GPU_Node 01\n",
            "/proc/sys/kernel/hostname": "ignored\n",
            "/usr/bin/kubeadm": "",
            "/usr/local/bin/kubelet": "",
            "/usr/bin/containerd": "",
            "/etc/modules-load.d/90-bcd-k8s.conf": "mods",
            "/sys/module/br_netfilter/": "",
            "/etc/sysctl.d/90-bcd-k8s.conf": "sysctls",
            "/proc/sys/net/bridge/bridge-nf-call-iptables": " 1\n",
            "/proc/sys/net/ipv4/ip_forward": "0\n",
            "/proc/swaps": "Filename\tType\tSize\tUsed\tPriority\n/swap.img file 1 0 -2\n",
            "/etc/containerd/config.toml": "version = 2\n",
            "/etc/containerd/conf.d/90-bcd-k8s.toml": "dropin",
            "/etc/kubernetes/kubelet.conf": KUBELET_CONF,
        },
    )
    answers: dict[str, Callable[[tuple[str, ...]], tuple[int, str | bytes, str]]] = {
        "containerd": lambda a: (0, "containerd containerd.io 1.7.24 88bf19b\n", ""),
        "systemctl": lambda a: (0 if a[-1] == "kubelet.service" else 3, "", ""),
        "kubectl": lambda a: (0, json.dumps(NODE_JSON), ""),
        "kubeadm": lambda a: (0, "v1.34.1\n", ""),
    }
    host = Host(tmp_path, answers)
    ctx = UnitContext(allowed_clusters=(ClusterPin(SERVER, PIN),), identity_labels=(("bcd.dev/site", "s"),))
    o = UNIT.observe(host.system, settings(), ctx)
    assert o == K8sObserved(
        distro=Distro("ubuntu", "24.04", "ubuntu"),
        tools=("kubectl",),
        modules_file=b"mods",
        modules_loaded=("br_netfilter",),
        sysctl_file=b"sysctls",
        sysctls=(
            ("net.bridge.bridge-nf-call-iptables", "1"),
            ("net.bridge.bridge-nf-call-ip6tables", None),
            ("net.ipv4.ip_forward", "0"),
        ),
        swap=True,
        containerd_config="version = 2\n",
        containerd_dropin=b"dropin",
        containerd_major=1,
        containerd_active=False,
        kubelet_server=SERVER,
        kubeadm_version=None,  # joined: not asked
        hostname="GPU_Node 01",
        record=None,
        kubelet_active=True,
        node=NodeView(
            (("bcd.dev/node-id", "n-1"), ("team", "ml")),
            (("gpu", "true", "NoSchedule"), ("spot", "", "NoExecute")),
            True,
        ),
        pods=(),
        identity_labels=(("bcd.dev/site", "s"),),
        allowed=(ClusterPin(SERVER, PIN),),
    )
    assert host.calls == [
        ("containerd", "--version"),
        (*KUBE, "get", "node", "gpu-node-01", "-o", "json"),
        ("systemctl", "is-active", "--quiet", "containerd.service"),
        ("systemctl", "is-active", "--quiet", "kubelet.service"),
    ]
    # the recorded Node name wins over the host name
    _files(tmp_path, {RECORD: json.dumps({"node": "recorded"})})
    host.calls.clear()
    assert UNIT.observe(host.system, settings(), ctx).record == {"node": "recorded"}
    assert (*KUBE, "get", "node", "recorded", "-o", "json") in host.calls


def test_HST_K8S_observe_before_the_join(tmp_path: Path) -> None:
    _files(
        tmp_path,
        {
            "/proc/sys/kernel/hostname": "node-b\n",
            "/usr/sbin/kubeadm": "",
            "/sbin/kubelet": "",
            "/bin/kubectl": "",
            "/usr/local/sbin/containerd": "",
            "/proc/swaps": "Filename\tType\tSize\tUsed\tPriority\n  \n",
            "/etc/kubernetes/": "",
        },
    )
    versions = {
        "containerd": "containerd github.com/containerd/containerd v2.0.1 abc\n",
        "kubeadm": "v1.30.2\n",
    }
    host = Host(
        tmp_path,
        {
            "containerd": lambda a: (0, versions["containerd"], ""),
            "kubeadm": lambda a: (0, versions["kubeadm"], ""),
            "systemctl": lambda a: (0, "", ""),
        },
    )
    o = UNIT.observe(host.system, settings(), UnitContext())
    assert (o.tools, o.swap, o.containerd_major, o.containerd_active) == ((), False, 2, True)
    assert (o.kubelet_server, o.kubeadm_version, o.kubelet_active, o.node) == (None, (1, 30), False, None)
    assert (o.hostname, o.distro) == ("node-b", Distro("", "", "unknown"))
    assert host.calls == [
        ("containerd", "--version"),
        ("kubeadm", "version", "-o", "short"),
        ("systemctl", "is-active", "--quiet", "containerd.service"),
    ]
    versions.update(containerd="containerd 2.0\n", kubeadm="unknown\n")
    o = UNIT.observe(host.system, settings(), UnitContext())
    assert (o.containerd_major, o.kubeadm_version) == (None, None)
    # a kubeconfig without a server line: joined somewhere bcd cannot name
    _files(tmp_path, {"/etc/kubernetes/kubelet.conf": "clusters: []\n"})
    host.calls.clear()
    answers_kubectl = Host(
        tmp_path,
        {
            "kubectl": lambda a: (1, "", "Unauthorized\n"),
            "systemctl": lambda a: (3, "", ""),
            "containerd": lambda a: (0, "", ""),
            "kubeadm": lambda a: (0, "", ""),
        },
    )
    o = UNIT.observe(answers_kubectl.system, settings(), UnitContext())
    assert (o.kubelet_server, o.node, o.kubeadm_version, o.containerd_major) == ("", None, None, None)
    assert ("kubeadm", "version", "-o", "short") not in answers_kubectl.calls


def test_HST_K8S_62_observe_for_the_release_lists_pods_only_when_bcd_joined(tmp_path: Path) -> None:
    pods = {
        "items": [
            {"metadata": {"namespace": "ml", "name": "train"}, "status": {"phase": "Running"}},
            {"metadata": {"namespace": "ml", "name": "done"}, "status": {"phase": "Succeeded"}},
        ]
    }
    _files(tmp_path, {"/etc/hostname": "Node_C\n", "/etc/kubernetes/kubelet.conf": KUBELET_CONF})
    host = Host(tmp_path, {"kubectl": lambda a: (0, json.dumps(pods), "")})
    ctx = UnitContext(allowed_clusters=(ClusterPin(SERVER, PIN),))
    o = UNIT.observe(host.system, None, ctx)
    assert o == K8sObserved(
        Distro("", "", "unknown"), (), None, (), None, (), False, None, None, None, False,
        SERVER, None, "Node_C", None, False, None, (), (), ctx.allowed_clusters,
    )  # fmt: skip
    assert host.calls == []  # no record: not a node bcd joined
    _files(tmp_path, {RECORD: json.dumps({"released": False})})
    o = UNIT.observe(host.system, None, ctx)
    assert o.pods == (("ml", "train"),)
    assert host.calls == [
        (*KUBE, "get", "pods", "--all-namespaces", "--field-selector", "spec.nodeName=node-c", "-o", "json")
    ]
    (tmp_path / RECORD[1:]).write_text(json.dumps({"node": "rec", "released": True}))
    host.calls.clear()
    assert UNIT.observe(host.system, None, ctx).pods == () and host.calls == []
    (tmp_path / RECORD[1:]).write_text(json.dumps({"node": "rec"}))
    failing = Host(tmp_path, {"kubectl": lambda a: (1, "", "Unauthorized\n")})
    assert UNIT.observe(failing.system, None, ctx).pods == ()
    assert failing.calls[0][-3] == "spec.nodeName=rec"
    (tmp_path / "etc/kubernetes/kubelet.conf").unlink()
    failing.calls.clear()
    assert UNIT.observe(failing.system, None, ctx).kubelet_server is None and failing.calls == []


def test_HST_K8S_observe_what_a_host_without_the_tools_shows(tmp_path: Path) -> None:
    """No containerd, no kubeadm: neither is asked its version; no host name reads as ""."""
    _files(tmp_path, {"/sys/module/overlay/": ""})
    # the programs answer if asked (they are not installed: no file in a bin directory)
    host = Host(
        tmp_path,
        {
            "systemctl": lambda a: (0, "", ""),
            "containerd": lambda a: (0, "containerd v2.0.0 x\n", ""),
            "kubeadm": lambda a: (0, "v1.34.1\n", ""),
        },
    )
    o = UNIT.observe(host.system, settings(), UnitContext())
    assert o.modules_loaded == ("overlay",)
    assert o.tools == ("kubeadm", "kubelet", "kubectl", "containerd")
    assert (o.containerd_major, o.containerd_active, o.kubeadm_version, o.hostname) == (None, False, None, "")
    assert host.calls == []


def test_HST_K8S_observe_version_output_that_is_not_utf8(tmp_path: Path) -> None:
    _files(tmp_path, {"/usr/bin/containerd": "", "/usr/bin/kubeadm": ""})
    host = Host(
        tmp_path,
        {
            "containerd": lambda a: (0, b"containerd \xff v2.1.0 abc\n", ""),
            "kubeadm": lambda a: (0, b"\xffv1.31.0\n", ""),
            "systemctl": lambda a: (0, "", ""),
        },
    )
    o = UNIT.observe(host.system, settings(), UnitContext())
    assert (o.containerd_major, o.kubeadm_version) == (2, (1, 31))


def test_HST_K8S_kubeconfig_server_read_as_written() -> None:
    from bcd_shared.units.k8s import _kubelet_server

    assert _kubelet_server(None) is None
    assert _kubelet_server("clusters: []\n") == ""
    assert _kubelet_server("  server: 'https://NODEX'\n") == "https://NODEX"
    assert _kubelet_server('server: "https://h:6443"  # c\n') == "https://h:6443"
    assert _kubelet_server("    server:https://a\nserver: https://b\n") == "https://a"


def test_HST_K8S_observe_a_node_object_with_fields_left_out(tmp_path: Path) -> None:
    """The API server leaves out empty fields: a Node without labels or taints, a taint without value,
    key or effect; each reads as empty, never a crash."""
    _files(tmp_path, {"/etc/hostname": "n\n", "/etc/kubernetes/kubelet.conf": KUBELET_CONF})
    docs = [
        {},
        {"metadata": {}, "spec": {}},
        {"metadata": {"labels": None}, "spec": {"taints": None}},
        {"spec": {"taints": [{"effect": "NoSchedule"}, {"key": "k"}, {"key": "v", "value": None}]}},
    ]
    seen = []
    for doc in docs:
        host = Host(
            tmp_path,
            {"kubectl": lambda a, doc=doc: (0, json.dumps(doc), ""), "systemctl": lambda a: (0, "", "")},
        )
        node = UNIT.observe(host.system, settings(), UnitContext()).node
        assert node is not None
        seen.append(node)
    assert seen[:3] == [NodeView((), (), False)] * 3
    assert seen[3] == NodeView((), (("", "", "NoSchedule"), ("k", "", ""), ("v", "", "")), False)


def test_HST_K8S_observe_for_the_release_keeps_the_record(tmp_path: Path) -> None:
    _files(tmp_path, {"/etc/kubernetes/kubelet.conf": KUBELET_CONF, RECORD: json.dumps({"node": "r"})})
    host = Host(tmp_path, {"kubectl": lambda a: (0, json.dumps({"items": []}), "")})
    o = UNIT.observe(host.system, None, UnitContext())
    assert o.record == {"node": "r"} and o.kubelet_server == SERVER
    assert UNIT.plan(None, o).steps[0] == Release(
        "r", (), json_record("k8s-join", {"node": "r", "released": True})
    )


def test_HST_K8S_45_registered_taints_recorded_without_a_record_and_read_back_without_one() -> None:
    s = settings(taints=["gpu=true:NoSchedule"])
    node = NodeView((), (("gpu", "true", "NoSchedule"),), False)
    # no record (joined by an older bcd, say): the unit's taints count as registered, and are recorded
    p = UNIT.plan(s, observed(node=node, record=None))
    assert p == Plan((WriteFile(RECORD, json_record("k8s-join", _body(record_of(s))), 0o644),))
    # a record without its taints list: nothing registered
    rec = {k: v for k, v in record_of(s).items() if k != "taints"}
    p = UNIT.plan(s, observed(node=node, record=rec))
    assert p == Plan((WriteFile(RECORD, json_record("k8s-join", _body(record_of(s, taints=[]))), 0o644),))


def _body(rec: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in rec.items() if k != "_comment"}
