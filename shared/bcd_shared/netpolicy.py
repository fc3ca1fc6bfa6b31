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
import socket
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from attrs import frozen

from bcd_shared.instancenames import BRIDGE_RE, MAC_RE, MAX_NICS, tap_collision, tap_name, valid_instance_id

POLICIES = ("EGRESS", "PRIVATE", "NONE")
TABLES = (("bridge", "bcd_instances"), ("inet", "bcd_taps"), ("arp", "bcd_taps"))
MAX_ADDRESSES = 64  # per NIC
MAX_NIC_POLICIES = 16384  # per ruleset: 1,024 instances of 16 NICs
# One `nft -j list table` per table: nft 1.0.6 answers `list` commands read from a file with "No such
# file or directory", so the three tables are listed by three processes (DLV-NFT-23's order).
LIST_ARGVS = tuple(("nft", "-j", "list", "table", fam, name) for fam, name in TABLES)


class PolicyError(ValueError):
    """A policy that cannot be expressed; the message names the field and the rule."""


@frozen(cache_hash=True)  # a NicMemo key, hashed at every load
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


def _ll_bytes(mac: str) -> bytes:
    b = bytes.fromhex(mac.replace(":", ""))
    return b"".join((_LL_PREFIX, (b[0] ^ 0x02).to_bytes(1, "big"), b[1:3], b"\xff\xfe", b[3:6]))


_LL_PREFIX = b"\xfe\x80" + bytes(6)


def eui64_link_local(mac: str) -> str:
    """The modified EUI-64 link-local address of `mac` (RFC 4291 appendix A): fe80::/64 + the MAC with
    ff:fe in the middle and the universal/local bit flipped."""
    return socket.inet_ntop(socket.AF_INET6, _ll_bytes(mac))


# (family 4 or 6, the address, its network in CIDR form, the address's bytes)
Addr = tuple[int, str, str, bytes]


def parse_cidr(text: str) -> Addr:
    """An IPAM address `a.b.c.d/p` or `x::y/p`, parsed with inet_pton (ipaddress costs ~50 us an
    address, which 1,000 instances' rules cannot afford). ValueError when it is not one."""
    ip, sep, plen = text.partition("/")
    if not sep or not plen.isascii() or not plen.isdigit() or len(plen) > 3:
        raise ValueError(text)
    fam, bits = (socket.AF_INET6, 128) if ":" in ip else (socket.AF_INET, 32)
    try:
        raw = socket.inet_pton(fam, ip)
    except (OSError, ValueError):
        raise ValueError(text) from None
    prefix = int(plen)
    if prefix > bits:
        raise ValueError(text)
    x = int.from_bytes(raw, "big")
    host_bits = (1 << (bits - prefix)) - 1
    net = (x & ~host_bits).to_bytes(bits // 8, "big")
    return (
        6 if bits == 128 else 4,
        socket.inet_ntop(fam, raw),
        f"{socket.inet_ntop(fam, net)}/{prefix}",
        raw,
    )


def _unicast_problem(addr: Addr) -> str | None:
    fam, _ip, net, raw = addr
    return _problem(fam, int(net.rsplit("/", 1)[1]), raw)


def _problem(fam: int, prefix: int, raw: bytes) -> str | None:
    x = int.from_bytes(raw, "big")
    if fam == 4:
        if x == 0 or raw[0] == 127 or raw[0] >= 224 or raw[:2] == b"\xa9\xfe":
            return "is not a unicast address an instance may own"
        if prefix < 31 and x | ((1 << (32 - prefix)) - 1) == x:
            return "is its subnet's broadcast address"
        return None
    if x in (0, 1) or raw[0] == 0xFF or (raw[0] == 0xFE and raw[1] & 0xC0 == 0x80):
        return "is not a unicast address an instance may own"
    return None


_AF4, _AF6 = socket.AF_INET, socket.AF_INET6
_pton, _ntop = socket.inet_pton, socket.inet_ntop


def _own_address(text: str) -> tuple[Addr | None, str | None]:
    """parse_cidr and _unicast_problem in one pass (the builder's hot path): (the address or None when
    it is not one, the problem or None)."""
    ip, sep, plen = text.partition("/")
    if not sep or not plen.isascii() or not plen.isdigit() or len(plen) > 3:
        return None, None
    prefix = int(plen)
    if ":" in ip:
        fam, af, bits = 6, _AF6, 128
    else:
        fam, af, bits = 4, _AF4, 32
    if prefix > bits:
        return None, None
    try:
        raw = _pton(af, ip)
    except (OSError, ValueError):
        return None, None
    shift = bits - prefix
    net = (int.from_bytes(raw, "big") >> shift << shift).to_bytes(bits // 8, "big")
    return (fam, _ntop(af, raw), f"{_ntop(af, net)}/{prefix}", raw), _problem(fam, prefix, raw)


def _check_one(i: int, n: NicPolicy, bridges: frozenset[str] | None) -> list[Addr]:
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
    out: list[Addr] = []
    for j, a in enumerate(n.addresses):
        addr, problem = _own_address(a) if isinstance(a, str) else (None, None)
        if addr is None:
            raise PolicyError(f"{where}.addresses[{j}]: {str(a)[:60]!r} is not an address in CIDR form")
        if problem is not None:
            raise PolicyError(f"{where}.addresses[{j}]: {a} {problem}")
        out.append(addr)
    if n.policy != "EGRESS" and not n.guarded:
        raise PolicyError(
            f"{where}: policy {n.policy} needs a MAC and IPAM addresses (a policy that cannot be expressed)"
        )
    return out


def check_nics(nics: Sequence[NicPolicy], bridges: frozenset[str] | None = None) -> list[list[Addr]]:
    """Refuse a set of NIC policies the builder cannot express faithfully: a bad field, a `bc*` bridge
    (DLV-NFT-22), a guarded policy without a MAC or addresses (DLV-NFT-05), a NIC listed twice, two
    instances whose taps collide (`instancenames.tap_collision`), or an address two NICs claim (DLV-NFT-18:
    an address is bound to exactly one tap). `bridges`: the only
    bridges allowed (root's `[helper] instance_bridges`); None: any. Each NIC's parsed addresses."""
    return [c[0] for c in checked_nics(nics, bridges).items]


# What the rules say of one NIC (build_checked): the quoted tap; the PRIVATE sets' elements (dst4, dst6,
# src4, src6); when guarded (else ""), its `macs` element; its bind4 and bind6 elements, its own
# addresses (v4, v6 with the link-local) and its na_bind6 elements.
_Fragments = tuple[
    str,
    list[str],
    list[str],
    list[str],
    list[str],
    str,
    list[str],
    list[str],
    list[str],
    list[str],
    list[str],
]
# One NIC as check_nics accepted it, with what the rules need of it, computed once: its parsed addresses,
# when guarded its EUI-64 link-local (bytes and text), its tap, the addresses it claims (check_nics'
# "bound to one tap") and its fragments. A plain tuple: 1,000 NICs are checked per load.
_Checked = tuple[list[Addr], bytes | None, str, str, list[str], _Fragments]


@frozen
class CheckedNics:
    """NIC policies check_nics accepted, with what the check parsed (build_checked uses it: a caller that
    must refuse before it reads the host's addresses checks once, not twice)."""

    nics: tuple[NicPolicy, ...]
    items: tuple[_Checked, ...]


class NicMemo:
    """What checking each NIC of the last load found, for the next load: a reload of the same instances
    (a changed policy among 1,000, the integrity check's reload) checks and parses each unchanged NIC
    again only for what depends on the others (listed twice, an address claimed twice) and on the
    allowed bridges. The check of one NIC is a pure function of its NicPolicy, the key. Holds the last
    load's NICs only (at most MAX_NIC_POLICIES). One per loader, used under its lock."""

    def __init__(self) -> None:
        self.last: dict[NicPolicy, _Checked] = {}


def checked_nics(
    nics: Sequence[NicPolicy], bridges: frozenset[str] | None = None, memo: NicMemo | None = None
) -> CheckedNics:
    """check_nics, keeping what it parsed for build_checked; raises PolicyError. With `memo`, NICs the
    last accepted load checked are taken from it, and the memo then holds this load's NICs."""
    return CheckedNics(tuple(nics), tuple(_checked(nics, bridges, memo)))


def _check_new(i: int, n: NicPolicy, bridges: frozenset[str] | None) -> _Checked:
    addrs = _check_one(i, n, bridges)
    ll: bytes | None = None
    ll_text = ""
    claims: list[str] = []
    if n.mac:
        claims = [x[1] for x in addrs]
        if addrs:  # guarded: a MAC and addresses
            ll = _ll_bytes(n.mac)
            ll_text = socket.inet_ntop(socket.AF_INET6, ll)
            claims.append(ll_text)
    tap = n.tap
    return addrs, ll, ll_text, tap, claims, _fragments(n, tap, addrs, ll, ll_text)


def _fragments(n: NicPolicy, tap: str, addrs: list[Addr], ll: bytes | None, ll_text: str) -> _Fragments:
    t = f'"{tap}"'
    v4, v6, s4, s6 = _split(addrs)
    dst4: list[str] = []
    dst6: list[str] = []
    src4: list[str] = []
    src6: list[str] = []
    if n.policy == "PRIVATE":
        dst4 = [f"{t} . {x}" for x in [*s4, "255.255.255.255"]]
        dst6 = [f"{t} . {x}" for x in [*s6, "ff02::/16"]]
        src4 = [f"{t} . {x}" for x in s4]
        src6 = [f"{t} . {x}" for x in s6]
    if ll is None:  # not guarded
        return t, dst4, dst6, src4, src6, "", [], [], [], [], []
    own6 = [*v6, ll_text]
    na = [f"{t} . 0x{a[3].hex()}" for a in addrs if a[0] == 6]
    na.append(f"{t} . 0x{ll.hex()}")
    return (
        t,
        dst4,
        dst6,
        src4,
        src6,
        f"{t} . {n.mac}",
        [f"{t} . {a}" for a in v4],
        [f"{t} . {a}" for a in own6],
        v4,
        own6,
        na,
    )


def _checked(
    nics: Sequence[NicPolicy], bridges: frozenset[str] | None, memo: NicMemo | None = None
) -> list[_Checked]:
    if len(nics) > MAX_NIC_POLICIES:
        raise PolicyError(f"nics: {len(nics)} NICs, at most {MAX_NIC_POLICIES}")
    seen: dict[tuple[str, int], int] = {}
    owner: dict[str, int] = {}
    tap_of: dict[str, tuple[str, int]] = {}  # tap -> (instance, nics index): one instance per tap
    out: list[_Checked] = []
    known = memo.last if memo is not None else {}
    for i, n in enumerate(nics):
        try:
            # True == 1 and hashes alike: an index must be an int to be taken from the memo
            hit = known.get(n) if type(n.index) is int else None
        except TypeError:  # a field of a type no NicPolicy may have: _check_one names it
            hit = None
        if hit is None:
            c = _check_new(i, n, bridges)
        else:
            c = hit
            if bridges is not None and n.bridge not in bridges:  # _check_one's rule and message
                raise PolicyError(f"nics[{i}].bridge: {n.bridge!r} is not one of the instance bridges")
        key = (n.instance, n.index)
        if key in seen:
            raise PolicyError(f"nics[{i}]: {n.instance} NIC {n.index} is listed twice (nics[{seen[key]}])")
        seen[key] = i
        first = tap_of.setdefault(c[3], (n.instance, i))
        if first[0] != n.instance:
            # Two instances' NICs on one tap: each would pass the other's guard (its MAC, addresses).
            raise PolicyError(f"nics[{i}].instance: {tap_collision(n.instance, first[0])} (nics[{first[1]}])")
        for a in c[4]:
            if owner.setdefault(a, i) != i:
                raise PolicyError(f"nics[{i}]: address {a} is claimed by nics[{owner[a]}] too")
        out.append(c)
    if memo is not None:
        try:
            memo.last = dict(zip(nics, out, strict=True))
        except TypeError:  # an unhashable field: nothing kept
            memo.last = {}
    return out


def _split(addrs: Sequence[Addr]) -> tuple[list[str], list[str], list[str], list[str]]:
    """(own v4, own v6, v4 subnets, v6 subnets) of a NIC's parsed addresses."""
    v4: list[str] = []
    v6: list[str] = []
    s4: set[str] = set()
    s6: set[str] = set()
    for fam, ip, net, _raw in addrs:
        if fam == 4:
            v4.append(ip)
            s4.add(net)
        else:
            v6.append(ip)
            s6.add(net)
    return v4, v6, sorted(s4), sorted(s6)


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
    return "0x" + socket.inet_pton(socket.AF_INET6, address).hex()


def _set(items: Iterable[str]) -> str:
    return "{ " + ", ".join(items) + " }"


def _elements(items: Sequence[str]) -> str:
    return f"elements = {_set(items)}; " if items else ""


def build_ruleset(
    nics: Sequence[NicPolicy],
    host: HostAddresses,
    bridges: frozenset[str] | None = None,
    memo: NicMemo | None = None,
) -> str:
    """The `nft -f` text replacing the three tables (checks `nics` first, as check_nics with `bridges`
    does; PolicyError when they cannot be expressed). Deterministic: the same input gives the same bytes
    on the node and in the helper.

    Per-tap facts live in named sets keyed by the tap's name (`ifname . address`), so the number of
    rules is fixed and a host of 1,000 instances loads and lists sets, not thousands of rules and
    anonymous sets."""
    return build_checked(checked_nics(nics, bridges, memo), host)


def build_checked(accepted: CheckedNics, host: HostAddresses) -> str:
    """build_ruleset of NIC policies checked_nics accepted."""
    return render_ruleset(nic_sets(accepted), host)


def _named(name: str, kind: str, items: Sequence[str], interval: bool = False) -> str:
    flags = "flags interval; " if interval else ""
    return f"\tset {name} {{ {kind}; {flags}{_elements(sorted(items))}}}\n"


def nic_sets(accepted: CheckedNics) -> tuple[str, str]:
    """The named sets that depend on the NICs alone, as text (before and after `na_host6`): a loader can
    make them while it reads the host's addresses, then render_ruleset."""
    nics, checked = accepted.nics, accepted.items
    taps = [c[3] for c in checked]
    order = sorted(range(len(nics)), key=lambda k: (taps[k], nics[k].instance))
    bind4: list[str] = []  # tap . its own IPv4 (the addresses bound to it, DLV-NFT-16)
    bind6: list[str] = []  # tap . its own IPv6, its EUI-64 link-local included
    macs: list[str] = []
    na_own: list[str] = []
    guarded: list[str] = []
    private: list[str] = []
    none: list[str] = []
    ssh: list[str] = []
    priv_dst4: list[str] = []  # tap . its subnets, and the broadcast address
    priv_dst6: list[str] = []  # tap . its subnets, and link-scope multicast
    priv_src4: list[str] = []  # tap . its subnets
    priv_src6: list[str] = []
    own4: set[str] = set()  # every tap's own addresses (bound4, bound6)
    own6: set[str] = set()
    for k in order:
        n = nics[k]
        t, dst4, dst6, src4, src6, mac, b4, b6, o4, o6, na = checked[k][5]
        if n.ssh_from_host_only:
            ssh.append(t)
        if n.policy == "PRIVATE":
            private.append(t)
            priv_dst4 += dst4
            priv_dst6 += dst6
            priv_src4 += src4
            priv_src6 += src6
        elif n.policy == "NONE":
            none.append(t)
        if not mac:  # not guarded
            continue
        guarded.append(t)
        macs.append(mac)
        bind4 += b4
        bind6 += b6
        own4.update(o4)
        own6.update(o6)
        na_own += na
    bound4 = sorted(own4)
    bound6 = sorted(own6)
    before = "".join(
        (
            _named("bound4", "type ipv4_addr", bound4),
            _named("bound6", "type ipv6_addr", bound6),
            _named("bind4", "type ifname . ipv4_addr", bind4),
            _named("bind6", "type ifname . ipv6_addr", bind6),
            _named("macs", "type ifname . ether_addr", macs),
        )
    )
    after = "".join(
        (
            _named("na_bound6", f"typeof {_TADDR}", [_hex6(a) for a in bound6]),
            _named("na_bind6", f"typeof iifname . {_TADDR}", na_own),
            _named("guarded", "type ifname", guarded),
            _named("private", "type ifname", private),
            _named("none", "type ifname", none),
            _named("ssh", "type ifname", ssh),
            _named("priv_dst4", "type ifname . ipv4_addr", priv_dst4, interval=True),
            _named("priv_dst6", "type ifname . ipv6_addr", priv_dst6, interval=True),
            _named("priv_src4", "type ifname . ipv4_addr", priv_src4, interval=True),
            _named("priv_src6", "type ifname . ipv6_addr", priv_src6, interval=True),
        )
    )
    return before, after


def render_ruleset(sets: tuple[str, str], host: HostAddresses) -> str:
    """The whole text: nic_sets' sets, the host's own, and the chains."""
    out: list[str] = []
    w = out.append
    for fam, name in TABLES:
        w(f"table {fam} {name}\ndelete table {fam} {name}\n")
    host4 = sorted({str(ipaddress.IPv4Address(a)) for a in host.v4})
    host6 = sorted({str(ipaddress.IPv6Address(a)) for a in host.v6})
    w("table bridge bcd_instances {\n")
    w(_named("host4", "type ipv4_addr", host4))
    w(_named("host6", "type ipv6_addr", host6))
    w(sets[0])
    w(_named("na_host6", f"typeof {_TADDR}", [_hex6(a) for a in host6]))
    w(sets[1])
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
    # the anti-spoofing guard of every tap whose NIC has a MAC and addresses (DLV-NFT-13..15)
    d("iifname @guarded iifname . ether saddr != @macs", "mac")
    d("iifname @guarded ether type != { ip, ip6, arp }", "ethertype")
    # own addresses, plus 0.0.0.0 and :: (DHCP, duplicate address detection)
    d(f"iifname @guarded ether type ip ip saddr != {_ANY4} iifname . ip saddr != @bind4", "ip4")
    d("iifname @guarded ether type ip6 ip6 saddr != :: iifname . ip6 saddr != @bind6", "ip6")
    d(f"iifname @guarded {_NA} iifname . {_TADDR} != @na_bind6", "na")
    d("iifname @guarded ether type arp iifname . arp saddr ether != @macs", "arp-mac")
    d(f"iifname @guarded ether type arp arp saddr ip != {_ANY4} iifname . arp saddr ip != @bind4", "arp")
    _chain_rules(w, pre)
    # forward (port to port), input (to the host) and output (the host into a tap): the tcp/22 drops
    # of ssh_from_host_only ahead of everything (DLV-NFT-32), then the policies
    fwd: list[str] = []
    inp: list[str] = []
    outp: list[str] = []
    f, i, o = _drop(fwd), _drop(inp), _drop(outp)
    f("oifname @ssh tcp dport 22", "ssh-fwd")
    o("oifname @ssh ether type ip tcp dport 22" + (" ip saddr != @host4" if host4 else ""), "ssh4")
    o("oifname @ssh ether type ip6 tcp dport 22" + (" ip6 saddr != @host6" if host6 else ""), "ssh6")
    f("iifname @private ether type ip iifname . ip daddr != @priv_dst4", "private4")
    f("iifname @private ether type ip6 iifname . ip6 daddr != @priv_dst6", "private6")
    f("oifname @private ether type ip oifname . ip saddr != @priv_src4", "private4-in")
    f("oifname @private ether type ip6 oifname . ip6 saddr != @priv_src6", "private6-in")
    i("iifname @private ether type ip ip daddr != @host4 iifname . ip daddr != @priv_dst4", "private4-host")
    i(
        "iifname @private ether type ip6 ip6 daddr != @host6 iifname . ip6 daddr != @priv_dst6",
        "private6-host",
    )
    o("oifname @private ether type ip ip saddr != @host4 oifname . ip saddr != @priv_src4", "private4-out")
    o("oifname @private ether type ip6 ip6 saddr != @host6 oifname . ip6 saddr != @priv_src6", "private6-out")
    f("iifname @none", "none-fwd")
    f("oifname @none", "none-fwd-in")
    i("iifname @none ether type ip ip daddr != @host4 ip daddr != 255.255.255.255", "none4")
    i("iifname @none ether type ip6 ip6 daddr != @host6 ip6 daddr != ff02::/16", "none6")
    o("oifname @none ether type ip ip saddr != @host4", "none4-out")
    o("oifname @none ether type ip6 ip6 saddr != @host6", "none6-out")
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
            elif "set" in x and "interval" not in x["set"].get("flags", []):
                # interval sets are listed as nft normalises them (merged ranges): the digest covers them
                elements += len(x["set"].get("elem", []))
    return rules, elements


def ruleset_counts(text: str) -> tuple[int, int]:
    """(rules, set elements) of a ruleset `build_ruleset` made (see listing_counts)."""
    rules = elements = 0
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("set ") and "flags interval" not in s:
            m = re.search(r"elements = \{ (.*) \}", s)
            if m:
                elements += len(m.group(1).split(", "))
        elif s and not s.startswith(("table", "delete", "chain", "type ", "}", "set ")):
            rules += 1
    return rules, elements


def load_argv(text: str) -> tuple[list[str], str]:
    """(`nft -f FILE` argv, FILE): the text staged in a new 0600 file (mkstemp: O_EXCL, a random name),
    since nft reads a file ~25% faster than the same text on its stdin. The caller unlinks FILE."""
    import os
    import tempfile

    fd, path = tempfile.mkstemp(prefix="bcd-nft-", suffix=".nft")
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    return ["nft", "-f", path], path


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
