"""The instances' network policy as nftables rules: one builder for the node (as root) and the helper.

Input is typed (`NicPolicy`, one per instance NIC) and checked here (`check_nics`); the output is the
text of one `nft -f` transaction that replaces three tables atomically (DLV-NFT-01, -19, -20): nft
1.0.6 has no `destroy`, so each table is declared (`table X`), deleted and declared again with its
content in the same file; a batch with an error is rejected whole and the old rules stay.

`bridge bcd_instances` (the instances' taps are bridge ports, matched by name, DLV-NFT-07):
- chain `pre` (prerouting, every port): a guarded address (DLV-NFT-16) sent from, or claimed in ARP or
  a neighbour advert by, any port but its own tap is dropped; then, for `bc*` taps only: DHCP server
  replies (udp sport 67/547, DLV-NFT-08), router advertisements (DLV-NFT-09), redirects (DLV-NFT-10),
  the host's own addresses as source or claim (DLV-NFT-11/12); then each guarded tap jumps to its
  `g_<tap>` chain (`iifname vmap`): frames must carry the NIC's MAC (DLV-NFT-13) and only IPv4, IPv6
  or ARP; IP packets its own addresses plus 0.0.0.0 / :: and its EUI-64 link-local (DLV-NFT-14); ARP
  its own IPv4 addresses (DLV-NFT-15).
- chains `fwd` (forward) and `out` (output, the host into a tap): the tcp/22 drops of
  `ssh_from_host_only` first (DLV-NFT-28..32), then PRIVATE (DLV-NFT-02: IP only to and from its
  subnets, link-scope multicast and broadcast, and the host) and NONE (DLV-NFT-03: nothing forwarded,
  the host only); chain `in` (input, to the host): PRIVATE and NONE destinations. EGRESS adds no
  policy rule (DLV-NFT-04).
`inet bcd_taps` / `arp bcd_taps`: the backstops (`iifname "bc*" drop` on input and forward, `oifname
"bc*" drop` on forward and output; ARP input and output), which see only a tap off its bridge.

Every drop rule counts and carries a comment naming what it guards, so an operator (and the real
tests) can read which rule dropped a frame. The integrity check digests the tables' JSON listing
without counters and handles, set elements included (`listing_digest`): `nft flush set` empties a
guard while every rule stays, so a rule count is not enough.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from attrs import frozen

from bcd_shared.instancenames import BRIDGE_RE, MAC_RE, MAX_NICS, tap_name, valid_instance_id

POLICIES = ("EGRESS", "PRIVATE", "NONE")
TABLES = (("bridge", "bcd_instances"), ("inet", "bcd_taps"), ("arp", "bcd_taps"))
MAX_ADDRESSES = 64  # per NIC
MAX_NIC_POLICIES = 16384  # per ruleset: 1,024 instances of 16 NICs
# One `nft -j list table` per table: nft 1.0.6 answers `list` commands read from a file with "No such
# file or directory", so the three tables are listed by three processes (DLV-NFT-23's order).
LIST_ARGVS = tuple(("nft", "-j", "list", "table", fam, name) for fam, name in TABLES)


class PolicyError(ValueError):
    """A policy that cannot be expressed; the message names the field and the rule."""


@frozen
class NicPolicy:
    """One instance NIC as the rules see it. The tap is derived (`tap_name(instance, index)`), never
    given: root builds it itself."""

    instance: str
    index: int
    bridge: str
    mac: str = ""
    addresses: tuple[str, ...] = ()  # IPAM addresses in CIDR form
    policy: str = "EGRESS"
    ssh_from_host_only: bool = False

    @property
    def tap(self) -> str:
        return tap_name(self.instance, self.index)

    @property
    def guarded(self) -> bool:
        """Anti-spoofed: a NIC with a MAC and IPAM addresses, whatever its policy (DLV-NFT-13)."""
        return bool(self.mac and self.addresses)


@frozen
class HostAddresses:
    """The host's own addresses on the bridges its instances attach to."""

    v4: tuple[str, ...] = ()
    v6: tuple[str, ...] = ()


def eui64_link_local(mac: str) -> str:
    """The modified EUI-64 link-local address of `mac` (RFC 4291 appendix A): fe80::/64 + the MAC with
    ff:fe in the middle and the universal/local bit flipped."""
    b = bytes.fromhex(mac.replace(":", ""))
    iid = bytes([b[0] ^ 0x02]) + b[1:3] + b"\xff\xfe" + b[3:6]
    return str(ipaddress.IPv6Address(b"\xfe\x80" + bytes(6) + iid))


def _check_one(i: int, n: NicPolicy, bridges: frozenset[str] | None) -> None:
    where = f"nics[{i}]"
    if not isinstance(n.instance, str) or not valid_instance_id(n.instance):
        raise PolicyError(f"{where}.instance: {str(n.instance)[:80]!r} is not an instance id")
    if isinstance(n.index, bool) or not isinstance(n.index, int) or not 0 <= n.index < MAX_NICS:
        raise PolicyError(f"{where}.index: {n.index!r} is not a NIC index 0..{MAX_NICS - 1}")
    if not isinstance(n.bridge, str) or not BRIDGE_RE.fullmatch(n.bridge):
        raise PolicyError(f"{where}.bridge: {str(n.bridge)[:40]!r} is not an interface name")
    if n.bridge.startswith("bc"):
        raise PolicyError(f"{where}.bridge: {n.bridge!r} starts with 'bc' (it would match every tap rule)")
    if bridges is not None and n.bridge not in bridges:
        raise PolicyError(f"{where}.bridge: {n.bridge!r} is not one of the instance bridges")
    if n.policy not in POLICIES:
        raise PolicyError(f"{where}.policy: {str(n.policy)[:20]!r} is not one of {', '.join(POLICIES)}")
    if n.mac:
        if not isinstance(n.mac, str) or not MAC_RE.fullmatch(n.mac):
            raise PolicyError(f"{where}.mac: {str(n.mac)[:40]!r} is not a lowercase colon-separated MAC")
        if int(n.mac[:2], 16) & 1 or n.mac == "00:00:00:00:00:00":
            raise PolicyError(f"{where}.mac: {n.mac} is not a unicast address")
    if len(n.addresses) > MAX_ADDRESSES:
        raise PolicyError(f"{where}.addresses: {len(n.addresses)} addresses, at most {MAX_ADDRESSES}")
    for j, a in enumerate(n.addresses):
        if not isinstance(a, str) or "/" not in a:
            raise PolicyError(f"{where}.addresses[{j}]: {str(a)[:60]!r} is not an address in CIDR form")
        try:
            iface = ipaddress.ip_interface(a)
        except ValueError:
            raise PolicyError(f"{where}.addresses[{j}]: {a[:60]!r} is not an address in CIDR form") from None
        ip = iface.ip
        if ip.is_unspecified or ip.is_multicast or ip.is_loopback or ip.is_link_local:
            raise PolicyError(f"{where}.addresses[{j}]: {a} is not a unicast address an instance may own")
        if (
            isinstance(ip, ipaddress.IPv4Address)
            and ip == iface.network.broadcast_address
            and iface.network.prefixlen < 31
        ):
            raise PolicyError(f"{where}.addresses[{j}]: {a} is its subnet's broadcast address")
    if n.policy != "EGRESS" and not n.guarded:
        raise PolicyError(
            f"{where}: policy {n.policy} needs a MAC and IPAM addresses (a policy that cannot be expressed)"
        )


def check_nics(nics: Sequence[NicPolicy], bridges: frozenset[str] | None = None) -> None:
    """Refuse a set of NIC policies the builder cannot express faithfully: a bad field, a `bc*` bridge
    (DLV-NFT-22), a guarded policy without a MAC or addresses (DLV-NFT-05), a NIC listed twice, or an
    address two NICs claim (DLV-NFT-18: an address is bound to exactly one tap). `bridges`: the only
    bridges allowed (root's `[helper] instance_bridges`); None: any."""
    if len(nics) > MAX_NIC_POLICIES:
        raise PolicyError(f"nics: {len(nics)} NICs, at most {MAX_NIC_POLICIES}")
    seen: dict[tuple[str, int], int] = {}
    owner: dict[str, int] = {}
    for i, n in enumerate(nics):
        _check_one(i, n, bridges)
        key = (n.instance, n.index)
        if key in seen:
            raise PolicyError(f"nics[{i}]: {n.instance} NIC {n.index} is listed twice (nics[{seen[key]}])")
        seen[key] = i
        if n.mac:
            for a in [*(str(ipaddress.ip_interface(x).ip) for x in n.addresses), *_ll(n)]:
                if a in owner and owner[a] != i:
                    raise PolicyError(f"nics[{i}]: address {a} is claimed by nics[{owner[a]}] too")
                owner[a] = i


def _ll(n: NicPolicy) -> list[str]:
    return [eui64_link_local(n.mac)] if n.guarded else []


def _split(n: NicPolicy) -> tuple[list[str], list[str], list[str], list[str]]:
    """(own v4, own v6, v4 subnets, v6 subnets) of a NIC."""
    v4: list[str] = []
    v6: list[str] = []
    s4: list[str] = []
    s6: list[str] = []
    for a in n.addresses:
        iface = ipaddress.ip_interface(a)
        if iface.version == 4:
            v4.append(str(iface.ip))
            s4.append(str(iface.network))
        else:
            v6.append(str(iface.ip))
            s6.append(str(iface.network))
    return v4, v6, sorted(set(s4)), sorted(set(s6))


_TADDR = "@th,64,128"
_NA = "ether type ip6 icmpv6 type nd-neighbor-advert"
_ANY4 = "0.0.0.0"  # noqa: S104 (an address in a rule, DHCP's unspecified source)


def _drop(rules: list[str]) -> Callable[[str, str], None]:
    def add(match: str, comment: str) -> None:
        rules.append(f'{match} counter drop comment "{comment}"')

    return add


def _chain_rules(w: Callable[[str], object], rules: Iterable[str]) -> None:
    for r in rules:
        w(f"\t\t{r}\n")
    w("\t}\n")


def _hex6(address: str) -> str:
    return f"0x{int(ipaddress.IPv6Address(address)):032x}"


def _set(items: Iterable[str]) -> str:
    return "{ " + ", ".join(items) + " }"


def _elements(items: Sequence[str]) -> str:
    return f"elements = {_set(items)}; " if items else ""


def build_ruleset(nics: Sequence[NicPolicy], host: HostAddresses) -> str:
    """The `nft -f` text replacing the three tables (checks `nics` first; PolicyError when they cannot
    be expressed). Deterministic: the same input gives the same bytes on the node and in the helper."""
    check_nics(nics)
    nics = sorted(nics, key=lambda n: (n.tap, n.instance))
    out: list[str] = []
    w = out.append
    for fam, name in TABLES:
        w(f"table {fam} {name}\ndelete table {fam} {name}\n")
    host4 = sorted({str(ipaddress.IPv4Address(a)) for a in host.v4})
    host6 = sorted({str(ipaddress.IPv6Address(a)) for a in host.v6})
    bind4: list[str] = []
    bind6: list[str] = []
    bound4: list[str] = []
    bound6: list[str] = []
    guards: list[NicPolicy] = []
    for n in nics:
        if not n.guarded:
            continue
        guards.append(n)
        v4, v6, _, _ = _split(n)
        for a in v4:
            bind4.append(f'"{n.tap}" . {a}')
            bound4.append(a)
        for a in [*v6, eui64_link_local(n.mac)]:
            bind6.append(f'"{n.tap}" . {a}')
            bound6.append(a)
    w("table bridge bcd_instances {\n")
    w(f"\tset host4 {{ type ipv4_addr; {_elements(host4)}}}\n")
    w(f"\tset host6 {{ type ipv6_addr; {_elements(host6)}}}\n")
    w(f"\tset bound4 {{ type ipv4_addr; {_elements(sorted(bound4))}}}\n")
    w(f"\tset bound6 {{ type ipv6_addr; {_elements(sorted(bound6))}}}\n")
    w(f"\tset bind4 {{ type ifname . ipv4_addr; {_elements(sorted(bind4))}}}\n")
    w(f"\tset bind6 {{ type ifname . ipv6_addr; {_elements(sorted(bind6))}}}\n")
    w(f"\tset na_host6 {{ typeof {_TADDR}; {_elements(sorted(_hex6(a) for a in host6))}}}\n")
    w(f"\tset na_bound6 {{ typeof {_TADDR}; {_elements(sorted(_hex6(a) for a in bound6))}}}\n")
    na_bind = sorted(f"{x.split(' . ')[0]} . {_hex6(x.split(' . ')[1])}" for x in bind6)
    w(f"\tset na_bind6 {{ typeof iifname . {_TADDR}; {_elements(na_bind)}}}\n")
    # prerouting: every port
    w("\tchain tap_pre {\n\t\ttype filter hook prerouting priority filter; policy accept;\n")
    pre: list[str] = []
    d = _drop(pre)
    d("ether type ip ip saddr @bound4 iifname . ip saddr != @bind4", "bound4")
    d("ether type ip6 ip6 saddr @bound6 iifname . ip6 saddr != @bind6", "bound6")
    d("ether type arp arp saddr ip @bound4 iifname . arp saddr ip != @bind4", "bound-arp")
    # nft 1.0.6 has no `icmpv6 taddr`: a neighbour advert's target is the 128 bits at offset 64 of
    # the ICMPv6 header, matched against sets of the same integers.
    d(f"{_NA} {_TADDR} @na_bound6 iifname . {_TADDR} != @na_bind6", "bound-na")
    pre.append('iifname != "bc*" accept')
    d("ether type ip udp sport { 67, 547 }", "dhcp-server")
    d("ether type ip6 udp sport { 67, 547 }", "dhcp-server6")
    d("ether type ip6 icmpv6 type nd-router-advert", "ra")
    d("ether type ip6 icmpv6 type nd-redirect", "redirect6")
    d("ether type ip icmp type redirect", "redirect")
    d("ether type ip ip saddr @host4", "host4")
    d("ether type ip6 ip6 saddr @host6", "host6")
    d("ether type arp arp saddr ip @host4", "host-arp")
    d(f"{_NA} {_TADDR} @na_host6", "host-na")
    if guards:
        pre.append("iifname vmap " + _set(f'"{n.tap}" : jump g_{n.tap}' for n in guards))
    _chain_rules(w, pre)
    for n in guards:
        v4, v6, _, _ = _split(n)
        t = n.tap
        own4 = _set([*v4, _ANY4])
        own6 = [*v6, "::", eui64_link_local(n.mac)]
        g: list[str] = []
        d = _drop(g)
        d(f"ether saddr != {n.mac}", f"mac {t}")
        d("ether type != { ip, ip6, arp }", f"ethertype {t}")
        d(f"ether type ip ip saddr != {own4}", f"ip4 {t}")
        d(f"ether type ip6 ip6 saddr != {_set(own6)}", f"ip6 {t}")
        d(f"{_NA} {_TADDR} != {_set(_hex6(a) for a in own6 if a != '::')}", f"na {t}")
        d(f"ether type arp arp saddr ether != {n.mac}", f"arp-mac {t}")
        d(f"ether type arp arp saddr ip != {own4}", f"arp {t}")
        w(f"\tchain g_{t} {{\n")
        _chain_rules(w, g)
    # forward (port to port), input (to the host) and output (the host into a tap): the tcp/22 drops
    # of ssh_from_host_only ahead of everything (DLV-NFT-32), then the policies
    fwd: list[str] = []
    inp: list[str] = []
    outp: list[str] = []
    f, i, o = _drop(fwd), _drop(inp), _drop(outp)
    for n in nics:
        t = n.tap
        if n.ssh_from_host_only:
            f(f'oifname "{t}" tcp dport 22', f"ssh-fwd {t}")
            o(
                f'oifname "{t}" ether type ip tcp dport 22' + (" ip saddr != @host4" if host4 else ""),
                f"ssh4 {t}",
            )
            o(
                f'oifname "{t}" ether type ip6 tcp dport 22' + (" ip6 saddr != @host6" if host6 else ""),
                f"ssh6 {t}",
            )
    for n in nics:
        t = n.tap
        _, _, s4l, s6l = _split(n)
        s4 = _set(s4l or [_ANY4])
        s6 = _set(s6l or ["::"])
        if n.policy == "PRIVATE":
            d4 = _set([*s4l, "255.255.255.255"])
            d6 = _set([*s6l, "ff02::/16"])
            f(f'iifname "{t}" ether type ip ip daddr != {d4}', f"private4 {t}")
            f(f'iifname "{t}" ether type ip6 ip6 daddr != {d6}', f"private6 {t}")
            f(f'oifname "{t}" ether type ip ip saddr != {s4}', f"private4-in {t}")
            f(f'oifname "{t}" ether type ip6 ip6 saddr != {s6}', f"private6-in {t}")
            i(f'iifname "{t}" ether type ip ip daddr != @host4 ip daddr != {d4}', f"private4-host {t}")
            i(f'iifname "{t}" ether type ip6 ip6 daddr != @host6 ip6 daddr != {d6}', f"private6-host {t}")
            o(f'oifname "{t}" ether type ip ip saddr != @host4 ip saddr != {s4}', f"private4-out {t}")
            o(f'oifname "{t}" ether type ip6 ip6 saddr != @host6 ip6 saddr != {s6}', f"private6-out {t}")
        elif n.policy == "NONE":
            f(f'iifname "{t}"', f"none-fwd {t}")
            f(f'oifname "{t}"', f"none-fwd-in {t}")
            i(f'iifname "{t}" ether type ip ip daddr != @host4 ip daddr != 255.255.255.255', f"none4 {t}")
            i(f'iifname "{t}" ether type ip6 ip6 daddr != @host6 ip6 daddr != ff02::/16', f"none6 {t}")
            o(f'oifname "{t}" ether type ip ip saddr != @host4', f"none4-out {t}")
            o(f'oifname "{t}" ether type ip6 ip6 saddr != @host6', f"none6-out {t}")
    for chain, hook, rules in (
        ("tap_fwd", "forward", fwd),
        ("tap_in", "input", inp),
        ("tap_out", "output", outp),
    ):
        w(f"\tchain {chain} {{\n\t\ttype filter hook {hook} priority filter; policy accept;\n")
        _chain_rules(w, rules)
    w("}\n")
    # the backstops: only a tap off its bridge reaches these hooks under its own name (DLV-NFT-21)
    for fam, hooks in (("inet", ("input", "forward", "output")), ("arp", ("input", "output"))):
        w(f"table {fam} bcd_taps {{\n")
        for hook in hooks:
            w(f"\tchain {hook} {{\n\t\ttype filter hook {hook} priority filter; policy accept;\n")
            rules = []
            if hook in ("input", "forward"):
                rules.append('iifname "bc*" counter drop')
            if hook in ("forward", "output"):
                rules.append('oifname "bc*" counter drop')
            _chain_rules(w, rules)
        w("}\n")
    return "".join(out)


# --- the integrity check ---------------------------------------------------------------------------

_VOLATILE = frozenset({"handle", "metainfo", "packets", "bytes"})


def _strip(value: Any) -> Any:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            if k in _VOLATILE:
                continue
            if k == "counter" and isinstance(v, dict):
                out[k] = {}
                continue
            out[k] = _strip(v)
        return out
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def listing_digest(outputs: Sequence[bytes]) -> str:
    """SHA-256 of the `nft -j list table` outputs of LIST_ARGVS without counters' values and handles:
    what the tables hold, set elements included. ValueError when an output is not nft's JSON."""
    docs = []
    for output in outputs:
        doc = json.loads(output)
        items = doc.get("nftables", []) if isinstance(doc, dict) else []
        docs.append([_strip(x) for x in items if not (isinstance(x, dict) and "metainfo" in x)])
    return hashlib.sha256(json.dumps(docs, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def listing_counts(outputs: Sequence[bytes]) -> tuple[int, int]:
    """(rules, set elements) in the listings: checked against what was built when the first listing
    after a load becomes the reference digest, so a change racing the load is not taken as the truth."""
    rules = elements = 0
    for output in outputs:
        for x in json.loads(output).get("nftables", []):
            if "rule" in x:
                rules += 1
            elif "set" in x:
                elements += len(x["set"].get("elem", []))
    return rules, elements


def ruleset_counts(text: str) -> tuple[int, int]:
    """(rules, set elements) of a ruleset `build_ruleset` made (see listing_counts)."""
    rules = elements = 0
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("set "):
            m = re.search(r"elements = \{ (.*) \}", s)
            if m:
                elements += len(m.group(1).split(", "))
        elif s and not s.startswith(("table", "delete", "chain", "type ", "}")):
            rules += 1
    return rules, elements


# --- the host's addresses ---------------------------------------------------------------------------


def parse_ip_addr(output: bytes, bridges: Iterable[str]) -> HostAddresses:
    """The addresses on `bridges` from `ip -j addr show` (iproute2's JSON: a list of links, each with
    `ifname` and `addr_info` entries `{family: inet|inet6, local, prefixlen}`)."""
    wanted = set(bridges)
    v4: set[str] = set()
    v6: set[str] = set()
    for link in json.loads(output or b"[]"):
        if not isinstance(link, dict) or link.get("ifname") not in wanted:
            continue
        for a in link.get("addr_info", []):
            local = a.get("local")
            if not isinstance(local, str):
                continue
            if a.get("family") == "inet":
                v4.add(str(ipaddress.IPv4Address(local)))
            elif a.get("family") == "inet6":
                v6.add(str(ipaddress.IPv6Address(local)))
    return HostAddresses(tuple(sorted(v4)), tuple(sorted(v6)))
