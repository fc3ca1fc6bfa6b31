# ruff: noqa: E501  (tool output and fixture lines are kept whole)
"""Small fakes the host-config units run on the simulated host.

`tee` writes kernel files and answers as the kernel would for the files bcd sets: a 1 GiB pool
holds at most what <root>/var/lib/bcd-sim/hugepages-1g-limit allows (a fragmented host), a 2 MiB
pool at most what hugepages-2m-limit allows (memory short), a
governor not listed in scaling_available_governors is EINVAL. `env` strips VAR=value words and runs
the rest. `sysctl -w` writes /proc/sys (an unknown key is sysctl's "cannot stat" with status 255).
`update-grub`, `grubby`, `mount`, `swapoff`, `curl`, `gpg`, `mkdir`, `containerd --version` and
`nvidia-ctk` (only once the toolkit is installed) do what the units need of them. `curl` reads a URL
given on its stdin (`--config -`, how bcd passes presigned URLs) and hands an https URL on loopback
(127.0.0.1, localhost: a test's server, or an operator's in `bcd sim`) to the real curl.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

from bcd_shared.system import CommandResult, LocalSystem, atomic_write

from ._state import fail, installed, load, not_found, ok, put, save


def _under_root(system: LocalSystem, real: str) -> str | None:
    """The host path of a real path under the simulated root."""
    try:
        rel = Path(real).relative_to(system.root)
    except ValueError:
        return None
    return "/" + rel.as_posix()


def tee(system: LocalSystem, argv: Sequence[str], stdin: bytes | None) -> CommandResult:
    paths = [a for a in argv[1:] if not a.startswith("-")]
    data = stdin or b""
    for real in paths:
        host = _under_root(system, real)
        if host is None:
            return fail(argv, f"tee: {real}: Permission denied (outside the simulated host)\n")
        value = data.decode().strip()
        if host.startswith("/sys/bus/pci/"):
            from .pcisim import pci_write

            if pci_write(system, host, data.decode()):
                continue
        if host.endswith("/scaling_governor"):
            avail = (system.read_text(host.rsplit("/", 1)[0] + "/scaling_available_governors") or "").split()
            if value not in avail:
                return fail(argv, f"tee: {real}: Invalid argument\n")
        if re.search(r"hugepages-1048576kB/nr_hugepages$", host):
            limit = system.read_text("/var/lib/bcd-sim/hugepages-1g-limit")
            if limit is not None and value.isdigit():
                value = str(min(int(value), int(limit.strip())))
            data = f"{value}\n".encode()
        if re.search(r"hugepages-2048kB/nr_hugepages$", host):
            limit = system.read_text("/var/lib/bcd-sim/hugepages-2m-limit")
            if limit is not None and value.isdigit():
                value = str(min(int(value), int(limit.strip())))
            data = f"{value}\n".encode()
        if host == "/sys/kernel/mm/transparent_hugepage/enabled":
            data = (
                " ".join(f"[{m}]" if m == value else m for m in ("always", "madvise", "never")) + "\n"
            ).encode()
        Path(real).parent.mkdir(parents=True, exist_ok=True)
        Path(real).write_bytes(data)
    return ok(argv, data.decode())


def env(system: LocalSystem, argv: Sequence[str], stdin: bytes | None) -> CommandResult:
    rest = list(argv[1:])
    while rest and "=" in rest[0] and not rest[0].startswith("-"):
        rest.pop(0)
    return system.run(rest, input=stdin)


def sysctl(system: LocalSystem, argv: Sequence[str], stdin: bytes | None) -> CommandResult:
    args = list(argv[1:])
    if args[:1] == ["-w"] and len(args) == 2:
        key, _, value = args[1].partition("=")
        path = "/proc/sys/" + key.replace(".", "/")
        if not system.exists(path):
            return fail(
                argv,
                f"sysctl: cannot stat /proc/sys/{key.replace('.', '/')}: No such file or directory\n",
                255,
            )
        put(system, path, value.replace(" ", "\t") + "\n")
        return ok(argv, f"{key} = {value}\n")
    if len(args) == 1 and not args[0].startswith("-"):
        text = system.read_text("/proc/sys/" + args[0].replace(".", "/"))
        if text is None:
            return fail(
                argv,
                f"sysctl: cannot stat /proc/sys/{args[0].replace('.', '/')}: No such file or directory\n",
                255,
            )
        return ok(argv, f"{args[0]} = {text.strip()}\n")
    return fail(argv, "sysctl: the simulated host supports -w KEY=VALUE and KEY\n")


def update_grub(system: LocalSystem, argv: Sequence[str], stdin: bytes | None) -> CommandResult:
    extra = []
    for name in system.listdir("/etc/default/grub.d"):
        for line in (system.read_text(f"/etc/default/grub.d/{name}") or "").splitlines():
            m = re.fullmatch(r'GRUB_CMDLINE_LINUX="\$GRUB_CMDLINE_LINUX (.*)"', line.strip())
            if m:
                extra.append(m.group(1))
    cmdline = " ".join(["root=/dev/sda1 ro quiet", *extra])
    put(
        system,
        "/boot/grub/grub.cfg",
        f"# generated by the simulated update-grub\nlinux /boot/vmlinuz {cmdline}\n",
    )
    return ok(argv, "", 0, "Generating grub configuration file ...\ndone\n")


def grubby(system: LocalSystem, argv: Sequence[str], stdin: bytes | None) -> CommandResult:
    args: list[str] = load(system, "grubby-args.json", [])
    for a in argv[1:]:
        if a.startswith("--remove-args="):
            drop = set(a.split("=", 1)[1].split())
            args = [x for x in args if x not in drop]
        elif a.startswith("--args="):
            args += [x for x in a.split("=", 1)[1].split() if x not in args]
    save(system, "grubby-args.json", args)
    return ok(argv)


def mount(system: LocalSystem, argv: Sequence[str], stdin: bytes | None) -> CommandResult:
    target = argv[-1]
    mounts = system.read_text("/proc/mounts") or ""
    if f" {target} " not in mounts:
        put(system, "/proc/mounts", mounts + f"hugetlbfs {target} hugetlbfs rw,relatime,pagesize=1024M 0 0\n")
    return ok(argv)


def swapoff(system: LocalSystem, argv: Sequence[str], stdin: bytes | None) -> CommandResult:
    put(system, "/proc/swaps", "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n")
    return ok(argv)


def _config_url(stdin: bytes | None) -> str:
    """The `url = "..."` line curl reads from `--config -` (how bcd passes a presigned URL)."""
    m = re.search(rb'^url = "((?:[^"\\]|\\.)*)"$', stdin or b"", re.M)
    return re.sub(r"\\(.)", r"\1", m.group(1).decode()) if m else ""


def curl(system: LocalSystem, argv: Sequence[str], stdin: bytes | None) -> CommandResult:
    args = list(argv)
    out = args[args.index("-o") + 1] if "-o" in args else None
    url = _config_url(stdin) if args[-2:] == ["--config", "-"] else args[-1]
    if re.match(r"^https://(127\.0\.0\.1|localhost)[:/]", url):
        # A server on this machine's loopback (a test's, or an operator's in `bcd sim`): the real curl,
        # with the paths bcd gave it (already real paths on the simulated host).
        import subprocess

        done = subprocess.run(list(argv), input=stdin, capture_output=True, timeout=21700, check=False)
        return CommandResult(tuple(argv), done.returncode, done.stdout, done.stderr)
    from bcd_simhost.libvirt import serve_image

    image = serve_image(system, argv, url)
    if image is not None:
        return image
    if not url.startswith("https://pkgs.k8s.io/"):
        return fail(argv, f"curl: (6) Could not resolve host: {url}\n", 6)
    if out:
        put(
            system,
            out,
            "-----BEGIN PGP PUBLIC KEY BLOCK-----\n(simulated pkgs.k8s.io key)\n-----END PGP PUBLIC KEY BLOCK-----\n",
        )
    return ok(argv)


def gpg(system: LocalSystem, argv: Sequence[str], stdin: bytes | None) -> CommandResult:
    args = list(argv)
    out = args[args.index("-o") + 1]
    src = system.read_bytes(args[-1])
    if src is None:
        return fail(argv, f"gpg: can't open '{args[-1]}': No such file or directory\n", 2)
    atomic_write(system.host_path(out), b"\x99\x01\x0d(simulated dearmored key)")
    return ok(argv)


def mkdir(system: LocalSystem, argv: Sequence[str], stdin: bytes | None) -> CommandResult:
    for p in argv[1:]:
        if not p.startswith("-"):
            system.host_path(p).mkdir(parents=True, exist_ok=True)
    return ok(argv)


def containerd(system: LocalSystem, argv: Sequence[str], stdin: bytes | None) -> CommandResult:
    if not installed(system, "containerd"):
        return not_found(argv)
    version = load(system, "packages.json", {}).get("containerd", {}).get("version", "1.7.24")
    return ok(
        argv,
        f"containerd github.com/containerd/containerd v{version} 88bf19b2105c8b17560993bee28a01ddc2f97182\n",
    )


def nvidia_ctk(system: LocalSystem, argv: Sequence[str], stdin: bytes | None) -> CommandResult:
    if not installed(system, "nvidia-ctk"):
        return not_found(argv)
    args = list(argv[1:])
    if args[:2] == ["runtime", "configure"]:
        runtime = next((a.split("=", 1)[1] for a in args if a.startswith("--runtime=")), "docker")
        cdi = "--cdi.enabled" in args
        if runtime == "containerd":
            text = system.read_text("/etc/containerd/config.toml") or "version = 2\n"
            text += (
                '\n[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]\n  runtime_type = "io.containerd.runc.v2"\n'
                '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia.options]\n'
                '  BinaryName = "/usr/bin/nvidia-container-runtime"\n'
            )
            if cdi:
                text += '[plugins."io.containerd.grpc.v1.cri"]\n  enable_cdi = true\n'
            put(system, "/etc/containerd/config.toml", text)
        elif runtime == "docker":
            doc = json.loads(system.read_text("/etc/docker/daemon.json") or "{}")
            doc.setdefault("runtimes", {})["nvidia"] = {"args": [], "path": "nvidia-container-runtime"}
            if cdi:
                doc.setdefault("features", {})["cdi"] = True
            put(system, "/etc/docker/daemon.json", json.dumps(doc, indent=4) + "\n")
        else:
            return fail(argv, f"level=error msg=\"unrecognized runtime '{runtime}'\"\n")
        return ok(argv, "", 0, f"INFO[0000] Wrote updated config to {'/etc/containerd/config.toml'}\n")
    if args[:1] == ["config"] and "--set" in args:
        key, _, value = args[args.index("--set") + 1].partition("=")
        path = "/etc/nvidia-container-runtime/config.toml"
        text = system.read_text(path) or ""
        line = f"{key} = {value}"
        if re.search(rf"(?m)^\s*#?\s*{re.escape(key)}\s*=.*$", text):
            text = re.sub(rf"(?m)^\s*#?\s*{re.escape(key)}\s*=.*$", line, text)
        else:
            text += line + "\n"
        put(system, path, text)
        return ok(argv)
    if args[:2] == ["cdi", "generate"]:
        # The spec of the GPUs and MIG devices nvidia-smi lists now (gpus.vendor_spec: the toolkit's
        # JSON shape), with the loaded driver's library versions.
        from . import gpus as simgpus
        from .nvidia_smi import loaded_driver

        out = next((a.split("=", 1)[1] for a in args if a.startswith("--output=")), None)
        state = simgpus.load_state(system)
        driver = None if state is None else loaded_driver(system, state)
        if state is None or driver is None:
            return fail(argv, 'level=error msg="failed to initialize NVML: Driver Not Loaded"\n')
        spec = simgpus.vendor_spec(dict(state, driver_version=driver["version"]))
        if out:
            put(system, out, json.dumps(spec, indent=2) + "\n")
        return ok(argv)
    return fail(argv, f"nvidia-ctk: unsupported on the simulated host: {' '.join(args)}\n")
