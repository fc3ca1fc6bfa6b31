"""HST-K8S-01 as one test: the k8s-join unit, pass after pass on the simulated host (its kubeadm,
kubectl and systemctl, devhost/bcd_simhost/kube.py and systemctl.py), makes the machine a worker and
nothing else. Every command the unit runs is recorded, kubeadm's own included."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bcd_shared.system import CommandResult
from bcd_shared.units import UnitContext
from hostunits_support import ALLOWED, K8S, make_host, run

JOIN_YAML = "/var/lib/bcd-hostconfig/k8s-join.yaml"
KUBELET_CONF = "/etc/kubernetes/kubelet.conf"
# What setting up or running a control plane would name beside kubeadm's subcommands (checked apart):
# kubeadm's control-plane flags, the static pods' components, and the files they leave.
CONTROL_PLANE_WORDS = (
    "upload-certs",
    "--control-plane",
    "--certificate-key",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "etcd",
    "admin.conf",
    "manifests",
)


def test_HST_K8S_01_the_unit_joins_as_a_worker_only_and_keeps_kubelet_and_labels(tmp_path: Path) -> None:
    """HST-K8S-01: from a bare host the unit installs, then joins with `kubeadm join` (once, from a
    JoinConfiguration with no controlPlane part) and no other kubeadm command but `version`; nothing
    it runs names a control-plane phase, component or file, and no control plane's files appear. Passes
    after the join keep the kubelet started (stopped by hand, it is started again) and the spec's labels
    on the Node (removed by hand, put back), with the kubelet's own credentials. Leaving the spec
    cordons the Node and leaves the kubelet running: bcd never resets or removes the worker."""
    root, system = make_host(tmp_path)
    calls: list[tuple[str, ...]] = []
    joins: list[str] = []
    plain_run = system.run

    def recording(argv: Sequence[str], **kw: Any) -> CommandResult:
        calls.append(tuple(argv))
        if tuple(argv[:2]) == ("kubeadm", "join"):
            joins.append(system.read_text(JOIN_YAML) or "")
        return plain_run(argv, **kw)

    system.run = recording  # type: ignore[method-assign]
    ctx = UnitContext(allowed_clusters=ALLOWED, identity_labels=(("bcd.dev/node-id", "n-1"),))

    def cluster_node() -> dict[str, Any]:
        node: dict[str, Any] = json.loads((root / "var/lib/bcd-sim/k8s.json").read_text())["nodes"][
            "gpu-node-01"
        ]
        return node

    def kubelet_active() -> bool:
        return plain_run(["systemctl", "is-active", "kubelet.service"]).ok

    results = [run(system, "k8s-join", K8S, ctx=ctx) for _ in range(3)]  # install, join, converged
    assert [r.ok for r in results] == [False, True, True], results[0].issues
    assert kubelet_active() and cluster_node()["labels"]["team"] == "ml"
    # Drift by hand: the kubelet stopped, a spec label removed from the Node.
    plain_run(["systemctl", "stop", "kubelet.service"])
    doc = json.loads((root / "var/lib/bcd-sim/k8s.json").read_text())
    del doc["nodes"]["gpu-node-01"]["labels"]["team"]
    (root / "var/lib/bcd-sim/k8s.json").write_text(json.dumps(doc))
    assert not kubelet_active()
    mark = len(calls)
    assert run(system, "k8s-join", K8S, ctx=ctx).ok
    assert ("systemctl", "enable", "--now", "kubelet.service") in calls[mark:]
    assert kubelet_active() and cluster_node()["labels"]["team"] == "ml"
    # The unit leaves the spec: cordoned, still a member, its kubelet running.
    assert run(system, "k8s-join", None, ctx=ctx).ok
    assert cluster_node()["unschedulable"] is True and kubelet_active()
    assert system.exists(KUBELET_CONF)

    kubeadm = [c for c in calls if c[0] == "kubeadm"]
    assert set(kubeadm) == {("kubeadm", "version", "-o", "short"), ("kubeadm", "join", "--config", JOIN_YAML)}
    assert len(joins) == 1 and "kind: JoinConfiguration" in joins[0]
    assert "controlPlane" not in joins[0] and "InitConfiguration" not in joins[0]
    named = [c for c in calls if any(w in arg for arg in c for w in CONTROL_PLANE_WORDS)]
    assert named == [], named
    kubectl = [c for c in calls if c[0] == "kubectl"]
    assert kubectl and all(c[1:3] == ("--kubeconfig", KUBELET_CONF) for c in kubectl)
    for path in ("/etc/kubernetes/manifests", "/etc/kubernetes/admin.conf", "/var/lib/etcd"):
        assert not system.exists(path), path
