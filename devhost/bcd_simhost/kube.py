# ruff: noqa: E501  (tool output and fixture lines are kept whole)
"""Fake `kubeadm` and `kubectl` of the simulated host: one simulated cluster.

Cluster state: <root>/var/lib/bcd-sim/k8s.json ({"nodes": {name: {labels, taints, unschedulable}},
"pods": [...]}). `kubeadm join --config F` reads the JoinConfiguration (apiServerEndpoint, token,
name, taints, node-labels), refuses a malformed token, registers the Node and writes
/etc/kubernetes/kubelet.conf naming the server, then starts the kubelet. `kubectl` answers
`get node NAME -o json`, `label node`, `cordon`, `uncordon`, `get pods ... -o json` and
`delete pod`, in the JSON shapes of the real API (metadata/spec/status).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from bcd_shared.system import CommandResult, LocalSystem

from ._state import fail, installed, load, not_found, ok, put, save


def _cluster(system: LocalSystem) -> dict[str, Any]:
    c: dict[str, Any] = load(system, "k8s.json", {"nodes": {}, "pods": []})
    return c


def _yaml_scalar(text: str, key: str) -> str | None:
    m = re.search(rf"(?m)^\s*-?\s*{re.escape(key)}:\s*(.+)$", text)
    if not m:
        return None
    v = m.group(1).strip()
    return json.loads(v) if v.startswith('"') else v


def kubeadm(system: LocalSystem, argv: Sequence[str], stdin: bytes | None) -> CommandResult:
    if not installed(system, "kubeadm"):
        return not_found(argv)
    args = list(argv[1:])
    version = load(system, "packages.json", {}).get("kubeadm", {}).get("version", "1.34.1")
    if args[:1] == ["version"]:
        return ok(argv, f"v{version}\n")
    if args[:1] == ["join"] and "--config" in args:
        text = system.read_text(args[args.index("--config") + 1]) or ""
        token = _yaml_scalar(text, "token") or ""
        if not re.fullmatch(r"[a-z0-9]{6}\.[a-z0-9]{16}", token):
            return fail(argv, "error execution phase preflight: invalid bootstrap token\n")
        endpoint = _yaml_scalar(text, "apiServerEndpoint")
        name = _yaml_scalar(text, "name") or "node"
        taints = []
        for m in re.finditer(r'- key: ("[^"]*")\n(?:\s+value: ("[^"]*")\n)?\s+effect: ("[^"]*")', text):
            taints.append(
                {
                    "key": json.loads(m.group(1)),
                    "value": json.loads(m.group(2)) if m.group(2) else "",
                    "effect": json.loads(m.group(3)),
                }
            )
        labels_text = _yaml_scalar(text, "node-labels")
        if labels_text is None:
            m2 = re.search(r'name: "node-labels"\n\s+value: ("[^"]*")', text)
            labels_text = json.loads(m2.group(1)) if m2 else ""
        labels = dict(kv.split("=", 1) for kv in labels_text.split(",") if kv)
        labels.update({"kubernetes.io/hostname": name, "kubernetes.io/os": "linux"})
        c = _cluster(system)
        c["nodes"][name] = {"labels": labels, "taints": taints, "unschedulable": False}
        save(system, "k8s.json", c)
        put(
            system,
            "/etc/kubernetes/kubelet.conf",
            f"apiVersion: v1\nkind: Config\nclusters:\n- cluster:\n    server: https://{endpoint}\n  name: default-cluster\n",
            0o600,
        )
        system.run(["systemctl", "enable", "--now", "kubelet.service"])
        return ok(argv, "This node has joined the cluster.\n")
    return fail(argv, f"kubeadm: unsupported on the simulated host: {' '.join(args)}\n")


def kubectl(system: LocalSystem, argv: Sequence[str], stdin: bytes | None) -> CommandResult:
    if not installed(system, "kubectl"):
        return not_found(argv)
    args = list(argv[1:])
    if "--kubeconfig" in args:
        i = args.index("--kubeconfig")
        del args[i : i + 2]
    c = _cluster(system)
    if args[:2] == ["get", "node"]:
        node = c["nodes"].get(args[2])
        if node is None:
            return fail(argv, f'Error from server (NotFound): nodes "{args[2]}" not found\n')
        doc = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": args[2], "labels": node["labels"]},
            "spec": {"taints": node["taints"], **({"unschedulable": True} if node["unschedulable"] else {})},
        }
        return ok(argv, json.dumps(doc))
    if args[:2] == ["label", "node"]:
        node = c["nodes"][args[2]]
        for a in args[3:]:
            if a.startswith("--"):
                continue
            if a.endswith("-"):
                node["labels"].pop(a[:-1], None)
            else:
                k, _, v = a.partition("=")
                node["labels"][k] = v
        save(system, "k8s.json", c)
        return ok(argv, f"node/{args[2]} labeled\n")
    if args[:1] in (["cordon"], ["uncordon"]):
        c["nodes"][args[1]]["unschedulable"] = args[0] == "cordon"
        save(system, "k8s.json", c)
        return ok(argv, f"node/{args[1]} {args[0]}ed\n")
    if args[:2] == ["get", "pods"]:
        sel = next((a.split("=", 1)[1] for a in args if a.startswith("spec.nodeName=")), None)
        items = [p for p in c["pods"] if sel is None or p.get("spec", {}).get("nodeName") == sel]
        return ok(argv, json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))
    if args[:2] == ["delete", "pod"]:
        ns = args[args.index("-n") + 1]
        name = next(a for a in args[2:] if not a.startswith("-") and a != ns)
        c["pods"] = [
            p for p in c["pods"] if (p["metadata"]["namespace"], p["metadata"]["name"]) != (ns, name)
        ]
        save(system, "k8s.json", c)
        return ok(argv, f'pod "{name}" deleted\n')
    return fail(argv, f"kubectl: unsupported on the simulated host: {' '.join(args)}\n")
