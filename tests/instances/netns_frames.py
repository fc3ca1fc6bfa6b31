"""Run inside a private network namespace (`unshare -n`, made by test_netpolicy_real.py): a bridge, `bc*`
taps opened through /dev/net/tun, bcd's rules loaded by the node's own code (DirectNft), frames written
as a guest would, and what happened to each as JSON on stdout: delivered (the payload was read on the
receiving tap or socket) and the counters of bcd's rules it moved. Never run outside a new namespace:
it changes the namespace's links and nftables."""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import select
import socket
import struct
import subprocess
import sys
import time
from typing import Any

from bcd_agent.sections.instances.network import DirectNft, NetworkPolicy
from bcd_shared.netpolicy import NicPolicy, eui64_link_local
from bcd_shared.system import LocalSystem

TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
BCAST = "ff:ff:ff:ff:ff:ff"


def sh(*argv: str) -> bytes:
    return subprocess.run(argv, check=True, capture_output=True).stdout


def mac_b(mac: str) -> bytes:
    return bytes.fromhex(mac.replace(":", ""))


def csum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    s = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def eth(dst: str, src: str, etype: int, body: bytes) -> bytes:
    return mac_b(dst) + mac_b(src) + struct.pack("!H", etype) + body


def ip4(src: str, dst: str, proto: int, body: bytes) -> bytes:
    hdr = struct.pack(
        "!BBHHHBBH4s4s", 0x45, 0, 20 + len(body), 1, 0, 64, proto, 0,
        ipaddress.IPv4Address(src).packed, ipaddress.IPv4Address(dst).packed,
    )  # fmt: skip
    return hdr[:10] + struct.pack("!H", csum(hdr)) + hdr[12:] + body


def ip6(src: str, dst: str, nh: int, body: bytes) -> bytes:
    return (
        struct.pack("!IHBB", 6 << 28, len(body), nh, 64)
        + ipaddress.IPv6Address(src).packed
        + ipaddress.IPv6Address(dst).packed
        + body
    )


def udp(sport: int, dport: int, data: bytes) -> bytes:
    return struct.pack("!HHHH", sport, dport, 8 + len(data), 0) + data


def tcp(sport: int, dport: int, data: bytes) -> bytes:
    return struct.pack("!HHIIBBHHH", sport, dport, 1, 0, 5 << 4, 0x02, 65535, 0, 0) + data


def icmp6(typ: int, body: bytes) -> bytes:
    return struct.pack("!BBH", typ, 0, 0) + body


def arp(sha: str, spa: str, tpa: str) -> bytes:
    return (
        struct.pack("!HHBBH", 1, 0x0800, 6, 4, 1)
        + mac_b(sha)
        + ipaddress.IPv4Address(spa).packed
        + bytes(6)
        + ipaddress.IPv4Address(tpa).packed
    )


def open_tap(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


def _port_states(taps: list[str]) -> set[str]:
    links = json.loads(sh("ip", "-j", "-d", "link", "show", "master", "br0"))
    states = {x["ifname"]: x.get("linkinfo", {}).get("info_slave_data", {}).get("state") for x in links}
    return {str(states.get(t)) for t in taps}


def counters() -> dict[str, int]:
    doc = json.loads(sh("nft", "-j", "list", "table", "bridge", "bcd_instances"))
    out: dict[str, int] = {}
    for item in doc["nftables"]:
        rule = item.get("rule")
        if rule and "comment" in rule:
            for e in rule["expr"]:
                if "counter" in e:
                    out[rule["comment"]] = out.get(rule["comment"], 0) + e["counter"]["packets"]
    for fam in ("inet", "arp"):
        d = json.loads(sh("nft", "-j", "list", "table", fam, "bcd_taps"))
        for item in d["nftables"]:
            rule = item.get("rule")
            if rule:
                n = sum(e["counter"]["packets"] for e in rule["expr"] if "counter" in e)
                key = f"{fam}-{rule['chain']}"
                out[key] = out.get(key, 0) + n
    return out


def host_tcp22(src: str, tap_fd: int, counters: Any) -> dict[str, Any]:
    """A SYN to 10.0.0.10:22 sent by the host with source `src` (IP_HDRINCL); whether a's tap got it."""
    while True:
        try:
            os.read(tap_fd, 65536)
        except BlockingIOError:
            break
    before = counters()
    sport = 40000 + int(src.rsplit(".", 1)[1])
    seg = tcp(sport, 22, b"")
    s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
    try:
        s.sendto(ip4(src, "10.0.0.10", 6, seg), ("10.0.0.10", 0))
    finally:
        s.close()
    got = False
    deadline = time.monotonic() + 0.3
    while time.monotonic() < deadline and not got:
        r, _, _ = select.select([tap_fd], [], [], 0.05)
        if r:
            with contextlib.suppress(BlockingIOError):
                frame = os.read(tap_fd, 65536)
                got = (
                    frame[12:14] == b"\x08\x00"
                    and frame[26:30] == ipaddress.IPv4Address(src).packed
                    and (frame[34:36] == struct.pack("!H", sport))
                )
    after = counters()
    return {
        "delivered": got,
        "moved": {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)},
    }


def main() -> None:
    sh("ip", "link", "set", "lo", "up")
    sh("ip", "link", "add", "br0", "type", "bridge")
    sh("ip", "addr", "add", "10.0.0.1/24", "dev", "br0")
    sh("ip", "-6", "addr", "add", "fd00::1/64", "dev", "br0", "nodad")
    sh("ip", "link", "set", "br0", "up")
    a = NicPolicy("a", 0, "br0", "52:54:00:00:00:0a", ("10.0.0.10/24", "fd00::10/64"), "PRIVATE", True)
    b = NicPolicy("b", 0, "br0", "52:54:00:00:00:0b", ("10.0.0.11/24",), "NONE", False)
    c = NicPolicy("c", 0, "br0", "", (), "EGRESS", False)
    e = NicPolicy("e", 0, "br0", "52:54:00:00:00:0e", ("10.0.0.14/24",), "EGRESS", False)
    fds: dict[str, int] = {}
    for n in (a, b, c, e):
        sh("ip", "tuntap", "add", "dev", n.tap, "mode", "tap")
        sh("ip", "link", "set", n.tap, "master", "br0", "up")
        fds[n.tap] = open_tap(n.tap)
    off = "bcfffffffffff0"  # a tap off its bridge: only the backstops see it (DLV-NFT-21)
    sh("ip", "tuntap", "add", "dev", off, "mode", "tap")
    sh("ip", "addr", "add", "192.168.77.1/24", "dev", off)
    sh("ip", "link", "set", off, "up")
    fds[off] = open_tap(off)
    links = {x["ifname"]: x.get("address", "") for x in json.loads(sh("ip", "-j", "link"))}
    host_sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    host_sock.bind(("0.0.0.0", 5555))
    host_sock.setblocking(False)
    # A port forwards once the kernel's link watcher (a worker thread, late on a loaded machine) has
    # seen the tap's carrier, which opening it turns on: wait for that, not for a fixed time.
    deadline = time.monotonic() + 30
    while (states := _port_states([a.tap, b.tap, c.tap, e.tap])) != {"forwarding"}:
        assert time.monotonic() < deadline, f"bridge ports not forwarding: {states}"
        time.sleep(0.02)

    policy = NetworkPolicy(DirectNft(LocalSystem()))
    policy.apply({"a": (a,), "b": (b,), "c": (c,), "e": (e,)})
    result: dict[str, Any] = {"cases": {}, "trusted": policy.trusted, "bound": policy.bound_addresses()}

    seq = [0]

    def drain() -> None:
        for fd in fds.values():
            while True:
                try:
                    os.read(fd, 65536)
                except BlockingIOError:
                    break
        try:
            while True:
                host_sock.recv(65536)
        except BlockingIOError:
            pass

    def case(name: str, src_tap: str, build: Any, to: str) -> None:
        """Write the frame `build(payload)` on src_tap; `to`: the tap, or "host", it should reach."""
        drain()
        seq[0] += 1
        payload = f"BCDTEST-{seq[0]}-{name}".encode()
        before = counters()
        os.write(fds[src_tap], build(payload))
        got = False
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline and not got:
            if to == "host":
                r, _, _ = select.select([host_sock], [], [], 0.05)
                if r:
                    got = payload in host_sock.recv(65536)
            else:
                r, _, _ = select.select([fds[to]], [], [], 0.05)
                if r:
                    with contextlib.suppress(BlockingIOError):
                        got = payload in os.read(fds[to], 65536)
        after = counters()
        moved = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
        result["cases"][name] = {"delivered": got, "moved": moved}

    A, B, C = a.tap, b.tap, c.tap
    ma, mb, mc = a.mac, b.mac, "52:54:00:00:00:0c"
    mbr = links["br0"]
    lla = eui64_link_local(ma)
    case("a_ok", A, lambda p: eth(mc, ma, 0x0800, ip4("10.0.0.10", "10.0.0.12", 17, udp(1, 9, p))), C)
    case(
        "a_host", A, lambda p: eth(mbr, ma, 0x0800, ip4("10.0.0.10", "10.0.0.1", 17, udp(1, 5555, p))), "host"
    )
    case(
        "a_mac",
        A,
        lambda p: eth(mc, "52:54:00:00:00:99", 0x0800, ip4("10.0.0.10", "10.0.0.12", 17, udp(1, 9, p))),
        C,
    )
    case("a_ip4", A, lambda p: eth(mc, ma, 0x0800, ip4("10.0.0.99", "10.0.0.12", 17, udp(1, 9, p))), C)
    case(
        "a_ll_ok", A, lambda p: eth("33:33:00:00:00:01", ma, 0x86DD, ip6(lla, "ff02::1", 17, udp(1, 9, p))), C
    )
    case(
        "a_ll_bad",
        A,
        lambda p: eth("33:33:00:00:00:01", ma, 0x86DD, ip6("fe80::1234", "ff02::1", 17, udp(1, 9, p))),
        C,
    )
    case("a_arp_ok", A, lambda p: eth(BCAST, ma, 0x0806, arp(ma, "10.0.0.10", "10.0.0.12") + p), C)
    case("a_arp_bad", A, lambda p: eth(BCAST, ma, 0x0806, arp(ma, "10.0.0.50", "10.0.0.12") + p), C)
    case("a_arp_claim", A, lambda p: eth(BCAST, ma, 0x0806, arp(ma, "10.0.0.11", "10.0.0.12") + p), C)
    case("a_vlan", A, lambda p: eth(mc, ma, 0x8100, b"\x00\x05\x08\x00" + p), C)
    case(
        "a_dhcp",
        A,
        lambda p: eth(BCAST, ma, 0x0800, ip4("10.0.0.10", "255.255.255.255", 17, udp(67, 68, p))),
        C,
    )
    case(
        "a_dhcp6",
        A,
        lambda p: eth("33:33:00:01:00:02", ma, 0x86DD, ip6(lla, "ff02::1:2", 17, udp(547, 546, p))),
        C,
    )
    case(
        "a_ra",
        A,
        lambda p: eth("33:33:00:00:00:01", ma, 0x86DD, ip6(lla, "ff02::1", 58, icmp6(134, bytes(12) + p))),
        C,
    )
    case(
        "a_redirect6", A, lambda p: eth(mc, ma, 0x86DD, ip6(lla, "fe80::c", 58, icmp6(137, bytes(36) + p))), C
    )
    case(
        "a_redirect",
        A,
        lambda p: eth(mc, ma, 0x0800, ip4("10.0.0.10", "10.0.0.12", 1, struct.pack("!BBHI", 5, 1, 0, 0) + p)),
        C,
    )
    case("a_private", A, lambda p: eth(mc, ma, 0x0800, ip4("10.0.0.10", "8.8.8.8", 17, udp(1, 9, p))), C)
    na_claim = icmp6(136, struct.pack("!I", 0x20000000) + ipaddress.IPv6Address("fd00::11").packed)
    case("a_na_other", A, lambda p: eth(mc, ma, 0x86DD, ip6(lla, "ff02::1", 58, na_claim + p)), C)
    case("b_none", B, lambda p: eth(mc, mb, 0x0800, ip4("10.0.0.11", "10.0.0.12", 17, udp(1, 9, p))), C)
    case(
        "b_host", B, lambda p: eth(mbr, mb, 0x0800, ip4("10.0.0.11", "10.0.0.1", 17, udp(1, 5555, p))), "host"
    )
    case("c_bound", C, lambda p: eth(ma, mc, 0x0800, ip4("10.0.0.10", "10.0.0.11", 17, udp(1, 9, p))), A)
    case("c_host", C, lambda p: eth(ma, mc, 0x0800, ip4("10.0.0.1", "10.0.0.10", 17, udp(1, 9, p))), A)
    case("c_ssh", C, lambda p: eth(ma, mc, 0x0800, ip4("10.0.0.12", "10.0.0.10", 6, tcp(4000, 22, p))), A)
    case("c_http", C, lambda p: eth(ma, mc, 0x0800, ip4("10.0.0.12", "10.0.0.10", 6, tcp(4000, 80, p))), A)
    na_host = icmp6(136, struct.pack("!I", 0x20000000) + ipaddress.IPv6Address("fd00::1").packed)
    case("c_na_host", C, lambda p: eth(ma, mc, 0x86DD, ip6("fe80::c", "ff02::1", 58, na_host + p)), A)
    na_a = icmp6(136, struct.pack("!I", 0x20000000) + ipaddress.IPv6Address("fd00::10").packed)
    case("c_na_bound", C, lambda p: eth(ma, mc, 0x86DD, ip6("fe80::c", "ff02::1", 58, na_a + p)), A)
    me = e.mac
    case("e_egress", e.tap, lambda p: eth(mc, me, 0x0800, ip4("10.0.0.14", "8.8.8.8", 17, udp(1, 9, p))), C)
    # the host into a's tap, tcp/22: from the host's own address it passes; from another source the
    # output rule drops it (a raw socket writes the source)
    sh("ip", "neigh", "replace", "10.0.0.10", "lladdr", ma, "dev", "br0", "nud", "permanent")
    result["cases"]["host_ssh_own"] = host_tcp22("10.0.0.1", fds[A], counters)
    result["cases"]["host_ssh_other"] = host_tcp22("10.0.0.77", fds[A], counters)
    moff = links[off]
    case(
        "off_bridge",
        off,
        lambda p: eth(
            moff, "52:54:00:00:00:ee", 0x0800, ip4("192.168.77.2", "192.168.77.1", 17, udp(1, 5555, p))
        ),
        "host",
    )

    case(
        "off_bridge_arp",
        off,
        lambda p: eth(
            BCAST, "52:54:00:00:00:ee", 0x0806, arp("52:54:00:00:00:ee", "192.168.77.2", "192.168.77.1") + p
        ),
        "host",
    )

    # the integrity check: a flushed set, a deleted rule, a deleted table (DLV-NFT-23..25)
    checks: dict[str, Any] = {"intact": policy.integrity_check()}
    sh("nft", "flush", "set", "bridge", "bcd_instances", "bind4")
    checks["after_flush_set"] = policy.integrity_check()
    checks["restored_flush_set"] = policy.integrity_check()
    checks["bind4_after"] = json.loads(sh("nft", "-j", "list", "set", "bridge", "bcd_instances", "bind4"))[
        "nftables"
    ][1]["set"].get("elem", [])
    doc = json.loads(sh("nft", "-a", "-j", "list", "chain", "bridge", "bcd_instances", "tap_pre"))
    handle = next(x["rule"]["handle"] for x in doc["nftables"] if x.get("rule", {}).get("comment") == "ra")
    sh("nft", "delete", "rule", "bridge", "bcd_instances", "tap_pre", "handle", str(handle))
    checks["after_delete_rule"] = policy.integrity_check()
    checks["restored_delete_rule"] = policy.integrity_check()
    sh("nft", "delete", "table", "inet", "bcd_taps")
    checks["after_delete_table"] = policy.integrity_check()
    checks["restored_delete_table"] = policy.integrity_check()
    # a new host address on the bridge: the check sees it and the rules follow (DLV-NFT-30's exception)
    sh("ip", "addr", "add", "10.0.0.2/24", "dev", "br0")
    checks["after_host_address"] = policy.integrity_check()
    checks["restored_host_address"] = policy.integrity_check()
    checks["host4_after"] = json.loads(sh("nft", "-j", "list", "set", "bridge", "bcd_instances", "host4"))[
        "nftables"
    ][1]["set"].get("elem", [])
    # a reload that fails: trust stays ended and the next apply (a pass) retries (DLV-NFT-26)
    sh("nft", "flush", "ruleset")
    real = policy.backend

    class Broken:
        def load(self, nics: Any) -> None:
            from bcd_shared.errors import RetryableError

            raise RetryableError("nft", "nft -f: refused")

        def check(self) -> bool:
            return False

    policy.backend = Broken()
    checks["failed_reload"] = policy.integrity_check()
    checks["trusted_after_failed_reload"] = policy.trusted
    checks["bound_after_failed_reload"] = policy.bound_addresses()
    checks["needs_reload"] = policy.needs_reload
    policy.backend = real
    policy.apply(dict(policy.loaded))
    checks["trusted_after_pass"] = policy.trusted
    checks["intact_after_pass"] = policy.integrity_check()
    result["checks"] = checks
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
