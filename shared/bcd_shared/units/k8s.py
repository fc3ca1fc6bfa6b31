"""k8s-join: join the machine to a Kubernetes cluster as a worker and keep it (HST-K8S-*).

Each pass, in order: packages (pkgs.k8s.io of kubernetesVersion's minor; a pass that installs ends
there), kernel (overlay, br_netfilter, three sysctls, swapoff), containerd (imports conf.d, bcd's
drop-in with CDI and the systemd cgroup driver), the join (a JoinConfiguration v1beta3/v1beta4 by
kubeadm version, token from a TokenSource, removed after), then kept: the kubelet running, the
Node's labels, taints set once (KubernetesTaintsDrift with the admin's kubectl command).

Root decides which clusters: `[kubernetes] allowed_clusters` (parse_allowed_clusters) is checked in
validate(); an empty list refuses every join.

Decisions: Q-HST-K8S-01 only `secret://` refs; kubernetesVersion is `[v]1.<minor>[.<patch>]`; the
fetched token must match kubeadm's `[a-z0-9]{6}.[a-z0-9]{16}`. Q-HST-K8S-02 the kubernetes.io and
k8s.io prefixes are refused with their subdomains; `label_safe` makes inventory values label-safe.
Q-HST-K8S-03 entries match after normalising (port 443 explicit, pin lowercase without `sha256:`);
the refusal reads `k8s-join: <server> with CA pin sha256:<pin> is not in [kubernetes] allowed_clusters`.
Q-HST-K8S-04 a pass that installed packages is retryable (PROGRESSING). Q-HST-K8S-05 a config.toml
without `imports` gets the line added at the top; containerd 2.x reads config version 3, older 2.
Q-HST-K8S-06 cordon, pod deletion and uncordon use the kubelet's credentials; the release is
`"released": true` in k8s-join.json (the device-plugin manager reads it); a node is "joined by bcd"
when k8s-join.json exists; the unit is CONVERGED while KubernetesTaintsDrift holds. A released node
raises KubernetesReleased (reason `Released`, informational) while it is still a member (kubelet.conf
names a server) and k8s-join is absent; the unit's return clears it.
"""

from __future__ import annotations

import json
import re
import tomllib
from typing import Any
from urllib.parse import urlsplit

from attrs import frozen

from bcd_shared.errors import RetryableError, TerminalError
from bcd_shared.system import System

from ._base import (
    STATE_DIR,
    ApplyContext,
    Fields,
    Issue,
    Plan,
    RemoveFile,
    Run,
    Step,
    UnitCondition,
    WriteFile,
    check,
    has_program,
    header,
    json_record,
    read_json_record,
    refuse,
    service_active,
)
from ._unit import ClusterPin, ConfigUnit, UnitContext
from .distro import Distro, detect, install_commands

NAME = "k8s-join"
RECORD = f"{STATE_DIR}/k8s-join.json"
RELEASED = "KubernetesReleased"  # the condition a released node raises (HST-K8S-64)
JOIN_YAML = f"{STATE_DIR}/k8s-join.yaml"
RELEASE_KEY = f"{STATE_DIR}/k8s-release.key"
STAGED_TOKEN = f"{STATE_DIR}/k8s/bootstrap-token"
KUBELET_CONF = "/etc/kubernetes/kubelet.conf"
MODULES_FILE = "/etc/modules-load.d/90-bcd-k8s.conf"
SYSCTL_FILE = "/etc/sysctl.d/90-bcd-k8s.conf"
CONTAINERD_CONFIG = "/etc/containerd/config.toml"
CONTAINERD_DROPIN = "/etc/containerd/conf.d/90-bcd-k8s.toml"
IMPORT_GLOB = "/etc/containerd/conf.d/*.toml"
APT_LIST = "/etc/apt/sources.list.d/bcd-kubernetes.list"
APT_KEYRING = "/etc/apt/keyrings/bcd-kubernetes.gpg"
YUM_REPO = "/etc/yum.repos.d/bcd-kubernetes.repo"
CRI_SOCKET = "unix:///run/containerd/containerd.sock"
KUBE = ("kubectl", "--kubeconfig", KUBELET_CONF)
SYSCTLS = ("net.bridge.bridge-nf-call-iptables", "net.bridge.bridge-nf-call-ip6tables", "net.ipv4.ip_forward")
EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
NO_ALLOWLIST = "joining a Kubernetes cluster needs [kubernetes] allowed_clusters in bcd's config"

_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS_SUBDOMAIN = rf"^(?=.{{1,253}}$){_DNS_LABEL}(\.{_DNS_LABEL})*$"
_LABEL_NAME = r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)"
LABEL_VALUE = rf"^({_LABEL_NAME})?$"
TOKEN_RE = r"^[a-z0-9]{6}\.[a-z0-9]{16}$"  # noqa: S105 (a pattern, not a secret)


# --------------------------------------------------------------------------------------------- settings


def normalise_server(value: str, field: str = "server") -> str:
    try:
        u = urlsplit(value)
        port = u.port
    except ValueError:
        raise refuse(f"{field}: {value!r} is not https://host[:port]") from None
    if u.scheme != "https" or not u.hostname:
        raise refuse(f"{field}: {value!r} is not https://host[:port]")
    if u.username is not None or u.password is not None:
        raise refuse(f"{field}: credentials are not allowed")
    if u.path not in ("", "/") or u.query or u.fragment or value.endswith("?") or value.endswith("#"):
        raise refuse(f"{field}: a path, query or fragment is not allowed")
    host = u.hostname
    if not (re.fullmatch(DNS_SUBDOMAIN, host) or re.fullmatch(r"[0-9a-f:.]+", host)):
        raise refuse(f"{field}: {host!r} is not a host name or address")
    shown = f"[{host}]" if ":" in host else host
    return f"https://{shown}:{port or 443}"


def normalise_pin(value: str, field: str = "caCertSha256") -> str:
    m = re.fullmatch(r"(?:sha256:)?([0-9a-fA-F]{64})", value)
    if not m:
        raise refuse(f"{field}: must be 64 hex digits, optionally prefixed sha256:")
    return m.group(1).lower()


def parse_allowed_clusters(text: str) -> tuple[ClusterPin, ...]:
    """`https://host[:port]#sha256:<hex>,...`; ValueError for a malformed entry (bcd must not start)."""
    out = []
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        server, sep, pin = entry.partition("#")
        if not sep:
            raise ValueError(f"allowed_clusters: {entry!r} is not https://host[:port]#sha256:<64 hex digits>")
        try:
            out.append(
                ClusterPin(
                    normalise_server(server, "allowed_clusters"), normalise_pin(pin, "allowed_clusters")
                )
            )
        except TerminalError as exc:
            raise ValueError(str(exc)) from None
        if not pin.startswith("sha256:"):
            raise ValueError(f"allowed_clusters: {entry!r}: the pin must start with sha256:")
    return tuple(out)


def check_label_key(key: str, field: str) -> None:
    prefix, slash, name = key.rpartition("/")
    if slash:
        if not re.fullmatch(DNS_SUBDOMAIN, prefix):
            raise refuse(f"{field}: {key!r}: the prefix is not a DNS subdomain")
        for banned in ("kubernetes.io", "k8s.io"):
            if prefix == banned or prefix.endswith("." + banned):
                raise refuse(f"{field}: {key!r}: the {banned} prefix is refused")
    if not re.fullmatch(_LABEL_NAME, name) or len(name) > 63:
        raise refuse(f"{field}: {key!r} is not a Kubernetes label key")


def parse_taint(text: str, field: str) -> tuple[str, str, str]:
    m = re.fullmatch(r"([^=:]+)(?:=([^:]*))?:([A-Za-z]+)", text)
    if not m or m.group(3) not in EFFECTS:
        raise refuse(f"{field}: {text!r} is not key[=value]:NoSchedule|PreferNoSchedule|NoExecute")
    key, value, effect = m.group(1), m.group(2) or "", m.group(3)
    check_label_key(key, field)
    if not re.fullmatch(LABEL_VALUE, value):
        raise refuse(f"{field}: {value!r} is not a Kubernetes label value")
    return key, value, effect


def taint_text(t: tuple[str, str, str]) -> str:
    key, value, effect = t
    return f"{key}={value}:{effect}" if value else f"{key}:{effect}"


def label_safe(value: str) -> str:
    """An inventory value as a label value: other characters become '-', trimmed to 63."""
    v = re.sub(r"[^A-Za-z0-9_.-]", "-", value)[:63].strip("-_.")
    return v


def node_name(hostname: str) -> str:
    return hostname.strip().lower().replace("_", "-").replace(" ", "-")


@frozen
class K8sSettings:
    server: str
    ca_sha256: str
    token_ref: str
    kubernetes_version: str | None = None
    labels: tuple[tuple[str, str], ...] = ()
    taints: tuple[tuple[str, str, str], ...] = ()
    gpu: bool = True
    gpu_api: str = "device-plugin"

    @property
    def minor(self) -> str | None:
        if self.kubernetes_version is None:
            return None
        return ".".join(self.kubernetes_version.lstrip("v").split(".")[:2])


# --------------------------------------------------------------------------------------------- observation


@frozen
class NodeView:
    labels: tuple[tuple[str, str], ...]
    taints: tuple[tuple[str, str, str], ...]
    unschedulable: bool


@frozen
class K8sObserved:
    distro: Distro
    tools: tuple[str, ...]  # the missing ones of kubeadm, kubelet, kubectl, containerd
    modules_file: bytes | None
    modules_loaded: tuple[str, ...]
    sysctl_file: bytes | None
    sysctls: tuple[tuple[str, str | None], ...]
    swap: bool
    containerd_config: str | None
    containerd_dropin: bytes | None
    containerd_major: int | None
    containerd_active: bool
    kubelet_server: str | None  # None: not joined
    kubeadm_version: tuple[int, int] | None
    hostname: str
    record: dict[str, Any] | None
    kubelet_active: bool
    node: NodeView | None
    pods: tuple[tuple[str, str], ...]  # (namespace, name) of workload pods, for a release
    identity_labels: tuple[tuple[str, str], ...]
    allowed: tuple[ClusterPin, ...]


def _kubelet_server(text: str | None) -> str | None:
    if text is None:
        return None
    m = re.search(r"(?m)^\s*server:\s*(\S+)", text)
    return m.group(1).strip("'\"") if m else ""


def workload_pods(doc: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """Running and pending pods that are not DaemonSet, static (mirror) or finished pods (HST-K8S-62/63)."""
    out = []
    for pod in doc.get("items", []):
        meta = pod.get("metadata", {})
        if any(o.get("kind") == "DaemonSet" for o in meta.get("ownerReferences", []) or []):
            continue
        if "kubernetes.io/config.mirror" in (meta.get("annotations") or {}):
            continue
        if pod.get("status", {}).get("phase") not in ("Running", "Pending"):
            continue
        out.append((meta.get("namespace", "default"), meta.get("name", "")))
    return tuple(sorted(out))


# --------------------------------------------------------------------------------------------- files


def join_configuration(s: K8sSettings, name: str, token: str, kubeadm: tuple[int, int]) -> str:
    """The JoinConfiguration YAML; strings are JSON-quoted (valid YAML double-quoted scalars)."""
    q = json.dumps
    v4 = kubeadm >= (1, 31)
    endpoint = s.server.removeprefix("https://")
    labels = ",".join(f"{k}={v}" for k, v in s.labels)
    lines = [
        header(NAME).rstrip("\n"),
        f"apiVersion: kubeadm.k8s.io/{'v1beta4' if v4 else 'v1beta3'}",
        "kind: JoinConfiguration",
        "discovery:",
        "  bootstrapToken:",
        f"    apiServerEndpoint: {q(endpoint)}",
        f"    token: {q(token)}",
        "    caCertHashes:",
        f"    - {q('sha256:' + s.ca_sha256)}",
        "nodeRegistration:",
        f"  name: {q(name)}",
        f"  criSocket: {q(CRI_SOCKET)}",
    ]
    if s.taints:
        lines.append("  taints:")
        for key, value, effect in s.taints:
            lines.append(f"  - key: {q(key)}")
            if value:
                lines.append(f"    value: {q(value)}")
            lines.append(f"    effect: {q(effect)}")
    else:
        lines.append("  taints: []")
    if labels:
        if v4:
            lines += ["  kubeletExtraArgs:", '  - name: "node-labels"', f"    value: {q(labels)}"]
        else:
            lines += ["  kubeletExtraArgs:", f"    node-labels: {q(labels)}"]
    return "\n".join(lines) + "\n"


def containerd_dropin(version: int) -> bytes:
    cri = 'plugins."io.containerd.cri.v1.runtime"' if version >= 3 else 'plugins."io.containerd.grpc.v1.cri"'
    return (
        header(NAME)
        + f"version = {version}\n\n"
        + f"[{cri}]\n"
        + "  enable_cdi = true\n"
        + '  cdi_spec_dirs = ["/etc/cdi", "/var/run/cdi"]\n\n'
        + f"[{cri}.containerd.runtimes.runc.options]\n"
        + "  SystemdCgroup = true\n"
    ).encode()


def containerd_config(existing: str | None, version: int) -> str | None:
    """The config.toml to write (None: it imports conf.d already); TerminalError: a foreign imports list."""
    if existing is None:
        return header(NAME) + f'version = {version}\nimports = ["{IMPORT_GLOB}"]\n'
    try:
        doc = tomllib.loads(existing)
    except tomllib.TOMLDecodeError as exc:
        raise TerminalError(
            "ContainerdConfig", f"k8s-join: {CONTAINERD_CONFIG} is not TOML ({exc}); fix it"
        ) from None
    imports = doc.get("imports")
    if imports is None:
        lines = existing.splitlines(keepends=True)
        at = next((i + 1 for i, ln in enumerate(lines) if re.match(r"\s*version\s*=", ln)), 0)
        lines.insert(at, f'imports = ["{IMPORT_GLOB}"]\n')
        return "".join(lines)
    if not isinstance(imports, list) or IMPORT_GLOB not in imports:
        raise TerminalError(
            "ContainerdConfig",
            f"k8s-join: {CONTAINERD_CONFIG} has an imports list without {IMPORT_GLOB}; add it by hand",
        )
    return None


def repo_steps(distro: Distro, minor: str, packages: tuple[str, ...]) -> tuple[Step, ...] | None:
    base = f"https://pkgs.k8s.io/core:/stable:/v{minor}"
    if distro.debian_like:
        listing = header(NAME) + f"deb [signed-by={APT_KEYRING}] {base}/deb/ /\n"
        return (
            Run(
                ("curl", "-fsSL", "--proto", "=https", "-o", RELEASE_KEY, f"{base}/deb/Release.key"),
                message="fetching the pkgs.k8s.io key",
            ),
            Run(
                ("gpg", "--batch", "--yes", "--dearmor", "-o", APT_KEYRING, RELEASE_KEY),
                message="installing the pkgs.k8s.io key",
            ),
            WriteFile(APT_LIST, listing.encode()),
            *(Run(a, message="installing Kubernetes packages") for a in install_commands(distro, packages)),
            Run(("apt-mark", "hold", *[p for p in packages if p != "containerd"])),
        )
    if distro.family == "rhel":
        repo = header(NAME) + (
            "[bcd-kubernetes]\nname=Kubernetes (bcd)\n"
            f"baseurl={base}/rpm/\nenabled=1\ngpgcheck=1\ngpgkey={base}/rpm/repodata/repomd.xml.key\n"
            "exclude=kubelet kubeadm kubectl cri-tools kubernetes-cni\n"
        )
        return (
            WriteFile(YUM_REPO, repo.encode()),
            Run(
                ("dnf", "-y", "install", "--disableexcludes=bcd-kubernetes", *packages),
                message="installing Kubernetes packages",
            ),
        )
    return None


# --------------------------------------------------------------------------------------------- steps


@frozen
class Join:
    settings: K8sSettings
    name: str
    kubeadm: tuple[int, int]
    record: bytes

    def describe(self) -> str:
        return f"kubeadm join {self.settings.server} as {self.name}"

    def apply(self, system: System, actx: ApplyContext) -> None:
        if actx.tokens is None:
            raise RetryableError("NoToken", "k8s-join: no way to fetch the bootstrap token here")
        token = actx.tokens.fetch(self.settings.token_ref).strip()
        if not re.fullmatch(TOKEN_RE, token):
            raise TerminalError("BadToken", "k8s-join: the fetched bootstrap token is not a kubeadm token")
        WriteFile(
            JOIN_YAML, join_configuration(self.settings, self.name, token, self.kubeadm).encode(), 0o600
        ).apply(system, actx)
        try:
            res = system.run(["kubeadm", "join", "--config", JOIN_YAML])
        finally:
            RemoveFile(JOIN_YAML).apply(system, actx)
        check(res, message="kubeadm join failed")
        actx.tokens.consumed()
        WriteFile(RECORD, self.record, 0o644).apply(system, actx)


@frozen
class Release:
    """The unit left the spec on a node bcd joined: cordon, delete workload pods, record the release."""

    name: str
    pods: tuple[tuple[str, str], ...]
    record: bytes

    def describe(self) -> str:
        return f"release Node {self.name} (cordon, delete {len(self.pods)} workload pods)"

    def apply(self, system: System, actx: ApplyContext) -> None:
        check(system.run([*KUBE, "cordon", self.name]), message="cordoning the Node")
        for ns, pod in self.pods:
            check(
                system.run([*KUBE, "delete", "pod", "-n", ns, pod, "--wait=false"]),
                ok=("NotFound",),
                message=f"deleting {ns}/{pod}",
            )
        WriteFile(RECORD, self.record, 0o644).apply(system, actx)


# --------------------------------------------------------------------------------------------- the unit


class K8sJoin(ConfigUnit[K8sSettings, K8sObserved]):
    name = NAME
    cleans = True

    def decode(self, obj: dict[str, Any]) -> K8sSettings:
        f = Fields(obj)
        server = f.string("server", max_len=512)
        pin = f.string("caCertSha256")
        token_ref = f.string("tokenRef", pattern=r"^secret://[A-Za-z0-9._/-]{1,256}$")
        version = f.string("kubernetesVersion", pattern=r"^v?1\.[0-9]{1,3}(\.[0-9]{1,3})?$")
        labels = f.string_map("nodeLabels", max_items=64) or ()
        taints = f.string_list("taints", max_items=64) or ()
        gpu = f.boolean("gpu")
        gpu_api = f.choice("gpuApi", ("device-plugin", "dra"))
        f.done()
        for key, missing in (("server", server), ("caCertSha256", pin), ("tokenRef", token_ref)):
            if missing is None:
                raise refuse(f"{key}: required")
        assert server is not None and pin is not None and token_ref is not None
        for k, v in labels:
            check_label_key(k, f"nodeLabels.{k}")
            if not re.fullmatch(LABEL_VALUE, v):
                raise refuse(f"nodeLabels.{k}: {v!r} is not a Kubernetes label value")
        parsed = [parse_taint(t, f"taints[{i}]") for i, t in enumerate(taints)]
        seen = set()
        for key, _v, effect in parsed:
            if (key, effect) in seen:
                raise refuse(f"taints: {key}:{effect} appears twice")
            seen.add((key, effect))
        return K8sSettings(
            normalise_server(server),
            normalise_pin(pin),
            token_ref,
            version,
            labels,
            tuple(sorted(parsed)),
            True if gpu is None else gpu,
            gpu_api or "device-plugin",
        )

    def validate(self, settings: K8sSettings, ctx: UnitContext) -> None:
        if not ctx.allowed_clusters:
            raise TerminalError("ClusterNotAllowed", NO_ALLOWLIST)
        if ClusterPin(settings.server, settings.ca_sha256) not in ctx.allowed_clusters:
            raise TerminalError(
                "ClusterNotAllowed",
                f"k8s-join: {settings.server} with CA pin sha256:{settings.ca_sha256} "
                "is not in [kubernetes] allowed_clusters",
            )

    def observe(self, system: System, settings: K8sSettings | None, ctx: UnitContext) -> K8sObserved:
        record = read_json_record(system, RECORD)
        kubelet_server = _kubelet_server(system.read_text(KUBELET_CONF))
        hostname = (
            system.read_text("/etc/hostname") or system.read_text("/proc/sys/kernel/hostname") or ""
        ).strip()
        name = str(record.get("node")) if record and record.get("node") else node_name(hostname)
        node = None
        pods: tuple[tuple[str, str], ...] = ()
        if settings is None:
            if record is not None and kubelet_server is not None and not record.get("released"):
                res = system.run(
                    [
                        *KUBE,
                        "get",
                        "pods",
                        "--all-namespaces",
                        "--field-selector",
                        f"spec.nodeName={name}",
                        "-o",
                        "json",
                    ]
                )
                if res.ok:
                    pods = workload_pods(json.loads(res.stdout))
            return K8sObserved(
                Distro("", "", "unknown"), (), None, (), None, (), False, None, None, None, False,
                kubelet_server, None, hostname, record, False, None, pods, (), ctx.allowed_clusters,
            )  # fmt: skip
        missing = tuple(
            t for t in ("kubeadm", "kubelet", "kubectl", "containerd") if not has_program(system, t)
        )
        sysctls = []
        for key in SYSCTLS:
            t = system.read_text("/proc/sys/" + key.replace(".", "/"))
            sysctls.append((key, None if t is None else t.strip()))
        swaps = (system.read_text("/proc/swaps") or "").splitlines()[1:]
        major = None
        if "containerd" not in missing:
            res = system.run(["containerd", "--version"])
            m = re.search(r"\sv?(\d+)\.\d+\.\d+", res.stdout.decode(errors="replace"))
            major = int(m.group(1)) if m else None
        kubeadm = None
        if kubelet_server is None and "kubeadm" not in missing:
            res = system.run(["kubeadm", "version", "-o", "short"])
            m = re.search(r"v?(\d+)\.(\d+)", res.stdout.decode(errors="replace"))
            kubeadm = (int(m.group(1)), int(m.group(2))) if m else None
        if kubelet_server is not None:
            res = system.run([*KUBE, "get", "node", name, "-o", "json"])
            if res.ok:
                doc = json.loads(res.stdout)
                node = NodeView(
                    tuple(sorted((doc.get("metadata", {}).get("labels") or {}).items())),
                    tuple(
                        sorted(
                            (t.get("key", ""), t.get("value", "") or "", t.get("effect", ""))
                            for t in doc.get("spec", {}).get("taints") or []
                        )
                    ),
                    bool(doc.get("spec", {}).get("unschedulable")),
                )
        return K8sObserved(
            detect(system),
            missing,
            system.read_bytes(MODULES_FILE),
            tuple(m for m in ("overlay", "br_netfilter") if system.exists(f"/sys/module/{m}")),
            system.read_bytes(SYSCTL_FILE),
            tuple(sysctls),
            any(s.strip() for s in swaps),
            system.read_text(CONTAINERD_CONFIG),
            system.read_bytes(CONTAINERD_DROPIN),
            major,
            "containerd" not in missing and service_active(system, "containerd.service"),
            kubelet_server,
            kubeadm,
            hostname,
            record,
            kubelet_server is not None and service_active(system, "kubelet.service"),
            node,
            (),
            ctx.identity_labels,
            ctx.allowed_clusters,
        )

    # -- plan

    def plan(self, settings: K8sSettings | None, o: K8sObserved) -> Plan:
        if settings is None:
            return self._plan_release(o)
        kube_missing = [t for t in o.tools if t != "containerd"]
        if o.tools:
            if kube_missing and settings.minor is None:
                return Plan(
                    (),
                    (
                        Issue(
                            "terminal",
                            f"k8s-join: {', '.join(kube_missing)} missing and no kubernetesVersion "
                            "says which to install",
                        ),
                    ),
                )
            if kube_missing:
                assert settings.minor is not None
                steps = repo_steps(o.distro, settings.minor, tuple(o.tools))
            else:
                cmds = install_commands(o.distro, ("containerd",))
                steps = tuple(Run(a, message="installing containerd") for a in cmds) if cmds else None
            if steps is None:
                return Plan(
                    (),
                    (
                        Issue(
                            "terminal",
                            f"k8s-join: bcd has no Kubernetes packages for "
                            f"{o.distro.id or 'this distribution'}",
                        ),
                    ),
                )
            return Plan(steps, (), (), stop_after=True)
        steps_: list[Step] = []
        # Kernel (HST-K8S-23..25)
        mods = (header(NAME) + "overlay\nbr_netfilter\n").encode()
        if o.modules_file != mods:
            steps_.append(WriteFile(MODULES_FILE, mods))
        for m in ("overlay", "br_netfilter"):
            if m not in o.modules_loaded:
                steps_.append(Run(("modprobe", "--", m), message=f"cannot load {m}"))
        sysctl_text = (header(NAME) + "".join(f"{k} = 1\n" for k in SYSCTLS)).encode()
        if o.sysctl_file != sysctl_text:
            steps_.append(WriteFile(SYSCTL_FILE, sysctl_text))
        for key, now in o.sysctls:
            if now != "1":
                steps_.append(Run(("sysctl", "-w", f"{key}=1"), message=f"cannot set {key}"))
        if o.swap:
            steps_.append(Run(("swapoff", "-a")))
        # containerd (HST-K8S-26..31)
        version = 3 if (o.containerd_major or 1) >= 2 else 2
        try:
            new_config = containerd_config(o.containerd_config, version)
        except TerminalError as exc:
            return Plan((), (Issue("terminal", exc.message),))
        dropin = containerd_dropin(version)
        changed = False
        if new_config is not None:
            steps_.append(WriteFile(CONTAINERD_CONFIG, new_config.encode()))
            changed = True
        if o.containerd_dropin != dropin:
            steps_.append(WriteFile(CONTAINERD_DROPIN, dropin))
            changed = True
        if changed:
            steps_.append(Run(("systemctl", "restart", "containerd.service")))
        elif not o.containerd_active:
            steps_.append(Run(("systemctl", "enable", "--now", "containerd.service")))
        # Join (HST-K8S-32..39)
        name = node_name(o.hostname)
        if o.kubelet_server is None:
            if not re.fullmatch(DNS_SUBDOMAIN, name):
                return Plan(
                    (),
                    (
                        Issue(
                            "terminal",
                            f"k8s-join: the Node name {name!r} (from the host name) is not a DNS subdomain",
                        ),
                    ),
                )
            if o.kubeadm_version is None:
                return Plan(tuple(steps_), (Issue("retryable", "k8s-join: cannot read kubeadm's version"),))
            steps_.append(
                Join(
                    settings,
                    name,
                    o.kubeadm_version,
                    self._record(settings, name, settings.taints, o, released=False),
                )
            )
            return Plan(tuple(steps_))
        # Kept (HST-K8S-40..49)
        if normalise_or_none(o.kubelet_server) != settings.server:
            # A kubelet.conf without a `server:` line is read as "" (joined, but to no server it names).
            joined = o.kubelet_server or f"a cluster {KUBELET_CONF} names no server of"
            return Plan(
                (),
                (
                    Issue(
                        "terminal",
                        f"k8s-join: the kubelet is joined to {joined}, not {settings.server}: "
                        "reset it by hand (kubeadm reset) to move it",
                    ),
                ),
            )
        if o.record and o.record.get("node"):
            name = str(o.record["node"])
        if not o.kubelet_active:
            steps_.append(Run(("systemctl", "enable", "--now", "kubelet.service")))
        if o.node is None:
            return Plan(
                tuple(steps_),
                (Issue("retryable", f"k8s-join: cannot read Node {name} with the kubelet's credentials"),),
            )
        registered = (
            tuple(tuple(t) for t in (o.record or {}).get("taints", [])) if o.record else settings.taints
        )
        conditions: tuple[UnitCondition, ...] = ()
        desired = dict(settings.labels) | dict(o.identity_labels)
        node_labels = dict(o.node.labels)
        previously = set((o.record or {}).get("labels", {}) or {})
        args = [f"{k}={v}" for k, v in sorted(desired.items()) if node_labels.get(k) != v]
        args += [
            f"{k}-"
            for k in sorted(node_labels)
            if k not in desired and (k in previously or k.startswith("bcd.dev/"))
        ]
        if args:
            steps_.append(
                Run((*KUBE, "label", "node", name, "--overwrite", *args), message="labelling the Node")
            )
        if o.record and o.record.get("released"):
            steps_.append(Run((*KUBE, "uncordon", name), message="uncordoning the Node"))
        managed_keys = {(k, e) for k, _v, e in settings.taints} | {
            (t[0], t[2]) for t in registered if len(t) == 3
        }
        on_node = {t for t in o.node.taints if (t[0], t[2]) in managed_keys}
        if on_node != set(settings.taints):
            remove = [
                f"{k}:{e}-"
                for k, _v, e in sorted(on_node)
                if (k, e) not in {(a, c) for a, _b, c in settings.taints}
            ]
            cmd = " ".join(
                [
                    "kubectl",
                    "taint",
                    "node",
                    name,
                    "--overwrite",
                    *[taint_text(t) for t in settings.taints],
                    *remove,
                ]
            )
            conditions = (UnitCondition("KubernetesTaintsDrift", "NodeRestriction", cmd),)
        record = self._record(settings, name, tuple(registered), o, released=False, labels=desired)
        if json.loads(record) != o.record:
            steps_.append(WriteFile(RECORD, record, 0o644))
        return Plan(tuple(steps_), (), conditions)

    def _record(
        self,
        s: K8sSettings,
        name: str,
        taints: tuple[tuple[str, ...], ...],
        o: K8sObserved,
        *,
        released: bool,
        labels: dict[str, str] | None = None,
    ) -> bytes:
        return json_record(
            NAME,
            {
                "cluster": s.server,
                "caCertSha256": s.ca_sha256,
                "node": name,
                "labels": dict(
                    sorted(
                        (labels if labels is not None else dict(s.labels) | dict(o.identity_labels)).items()
                    )
                ),
                "taints": [list(t) for t in taints],
                "gpu": s.gpu,
                "gpuApi": s.gpu_api,
                "released": released,
            },
        )

    def _plan_release(self, o: K8sObserved) -> Plan:
        rec = o.record
        if rec is None or o.kubelet_server is None:
            return Plan()  # HST-K8S-67: not a node bcd joined (or no longer a member)
        if rec.get("released"):
            # HST-K8S-64: raised while the released node is still a cordoned member; the unit's
            # return uncordons it, and a node the operator removed (no kubelet.conf) raises nothing.
            node = str(rec.get("node", node_name(o.hostname)))
            message = (
                f"k8s-join: node {node} was released when k8s-join left the spec: cordoned, its workload "
                f"pods deleted, the kubelet still a member of {o.kubelet_server}; remove the node from the "
                "cluster, or add k8s-join back to uncordon it"
            )
            return Plan(conditions=(UnitCondition(RELEASED, "Released", message),))
        body = {k: v for k, v in rec.items() if k != "_comment"} | {"released": True}
        return Plan((Release(str(rec.get("node", node_name(o.hostname))), o.pods, json_record(NAME, body)),))


def normalise_or_none(server: str) -> str | None:
    try:
        return normalise_server(server)
    except TerminalError:
        return None


UNIT = K8sJoin()


@frozen
class StagedTokenSource:
    """The helper's side: the token the node staged at /var/lib/bcd-hostconfig/k8s/bootstrap-token."""

    system: System

    def fetch(self, token_ref: str) -> str:
        text = self.system.read_text(STAGED_TOKEN)
        if text is None:
            raise RetryableError("NoToken", "k8s-join: the node has not staged the bootstrap token yet")
        return text.strip()

    def consumed(self) -> None:
        self.system.remove(STAGED_TOKEN)
