#!/usr/bin/env bash
# Install bcd on a host: the unprivileged `bcd` account, its directories, root's config.toml and
# the systemd units (bcd-helper.service as root, bcd-node.service as `bcd`). See docs/deploy.md.
#
# The programs themselves (/usr/bin/bcd and /usr/bin/bcd-helper) come from the bcd-node and
# bcd-helper packages (make deb; the package carries this script as /usr/share/bcd/install.sh); this
# script lays out what they need, with the ownership and modes the seeds require:
#   /etc/bcd                 root:bcd  0750   (only root can write; the node reads through its group)
#   /etc/bcd/config.toml     root:bcd  0640   (root's config: regular file, root-owned, not writable
#                                              by group or others, in root-only directories)
#   /var/lib/bcd             bcd:bcd   0700   (data_dir: journal.db, identity.json 0600)
#   /var/lib/bcd-hostconfig  root:root 0700   (root's records: join-response.pb, helper-intent.json)
#   /var/log/bcd-helper      root:root 0700   (the helper's audit log)
# Every value it writes is checked first (the control-plane address, the pin, the root hashes, the
# clusters), with the rules of docs/config.md. Re-running it is safe: an existing config.toml is kept
# (its ownership and mode are put right), and an account left in the root-equivalent `libvirt` group
# by an older install is taken out. Where libvirt is installed (and the helper is), QEMU's user joins
# the node's group and qemu.conf gets dynamic_ownership = 0. A re-run whose flags say something else
# than the kept config prints each difference and exits 3, unless --replace (then the kept one becomes
# config.toml.old).
#
# Usage: install.sh [--root DIR] [--join-signing-key-pin sha256/...] [--command-root-sha256 HEX,...]
#                   [--control-plane HOST:PORT] [--host-units-external] [--allowed-clusters LIST]
#                   [--no-helper] [--no-enable] [--replace]
if [ -z "${BASH_VERSION:-}" ]; then echo "install.sh: run it with bash (bash $0 ...), not sh" >&2; exit 2; fi
# (that line is sh: `sh install.sh`, dash, would otherwise stop at `set -o pipefail` with its own message)
set -euo pipefail

ROOT=/
PIN=""
ROOTS=""
CONTROL_PLANE=""
HOST_UNITS=true
CLUSTERS=""
HELPER=true
ENABLE=true
REPLACE=false
GIVEN=""  # the managed keys the flags name, for the comparison with a kept config
ACCOUNT=bcd
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

die() { echo "install.sh: $*" >&2; exit 2; }

# A flag that takes a value must have one: one line and exit 2, like every other refusal here.
value() { [ $# -ge 2 ] && [ -n "$2" ] || die "$1 needs a value (see install.sh --help)"; }

while [ $# -gt 0 ]; do
  case "$1" in
    --root) value "$@"; ROOT="$2"; shift 2 ;;
    --join-signing-key-pin) value "$@"; PIN="$2"; GIVEN+=" pin"; shift 2 ;;
    --command-root-sha256) value "$@"; ROOTS="$2"; GIVEN+=" roots"; shift 2 ;;
    --control-plane) value "$@"; CONTROL_PLANE="$2"; GIVEN+=" control_plane"; shift 2 ;;
    --host-units-external) HOST_UNITS=false; GIVEN+=" units"; shift ;;
    --allowed-clusters) value "$@"; CLUSTERS="$2"; GIVEN+=" clusters"; shift 2 ;;
    --no-helper) HELPER=false; GIVEN+=" helper"; shift ;;
    --no-enable) ENABLE=false; shift ;;
    --replace) REPLACE=true; shift ;;
    # The header comment, up to its first non-comment line: the usage stays in one place.
    -h|--help) sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;;
    *) die "unknown argument $1" ;;
  esac
done

[ "$(id -u)" -eq 0 ] || die "must run as root"
case "$ROOT" in /*) ;; *) die "--root must be an absolute path" ;; esac
ROOT="${ROOT%/}"
P() { echo "${ROOT}$1"; }  # a host path under --root

# Values written into TOML strings must not be able to break out of them.
for v in "$PIN" "$ROOTS" "$CONTROL_PLANE" "$CLUSTERS"; do
  case "$v" in *[\"\\$'\n']*) die "a value contains a quote, a backslash or a newline: $v" ;; esac
done
# The checks below need Python 3.11 (tomllib). The packages depend on python3.11 only, which does not
# bring /usr/bin/python3 with it: take python3 where it is 3.11 or later, else python3.11.
PY=""
for candidate in python3 python3.11; do
  if command -v "$candidate" >/dev/null && "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    PY="$candidate"
    break
  fi
done
[ -n "$PY" ] || die "Python 3.11 or later is needed (python3 or python3.11 on PATH; apt-get install python3.11)"
# The units come from the packages (/lib/systemd/system) or from beside this script (a checkout).
units=(bcd-node.service)
$HELPER && units+=(bcd-helper.service)
for u in "${units[@]}"; do
  [ -e "$(P "/lib/systemd/system/$u")" ] || [ -e "$HERE/$u" ] || {
    hint=""
    [ "$u" = bcd-helper.service ] && hint=" (or --no-helper, for a node without the root helper)"
    die "$u: not installed by a package (dpkg -i ${u%.service}_VERSION_ARCH.deb) and not beside this script$hint"
  }
done
# Each value against its rule in docs/config.md, before anything is written.
"$PY" - "$PIN" "$ROOTS" "$CONTROL_PLANE" "$CLUSTERS" <<'PY' || exit 2
import base64, ipaddress, re, sys
pin, roots, address, clusters = sys.argv[1:]
DNS = re.compile(r"(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?")

def host_port(text, port_required):
    m = re.fullmatch(r"(\[[^\]]*\]|[^:\[\]]+)(?::(\d{1,5}))?", text)
    if m is None:
        return "must be host:port (an IPv6 address in brackets)"
    host, port = m.group(1), m.group(2)
    if host.startswith("["):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return f"{host} is not an IPv6 address"
    elif re.fullmatch(r"[0-9.]+", host):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            return f"{host} is not an IPv4 address"
    elif not DNS.fullmatch(host):
        return f"{host} is not a DNS name"
    if port is None:
        return "must name a port (host:port)" if port_required else None
    if not 1 <= int(port) <= 65535:
        return f"has port {port} outside 1-65535"
    return None

def hexes(text, what):
    items = text.split(",")
    if not 1 <= len(items) <= 16:
        return f"{what}: 1 to 16 comma-separated SHA-256s"
    for h in items:
        if not re.fullmatch(r"[0-9a-f]{64}", h):
            return f"{what}: {h!r} is not 64 lowercase hex digits (a SHA-256)"
    if len(set(items)) != len(items):
        return f"{what}: a hash is repeated"
    return None

errors = []
if pin:
    b64 = pin[len("sha256/"):] if pin.startswith("sha256/") else ""
    ok = len(b64) == 44 and re.fullmatch(r"[A-Za-z0-9+/]{43}=", b64) is not None
    if ok:
        try:
            ok = base64.b64encode(base64.b64decode(b64, validate=True)).decode() == b64
        except ValueError:
            ok = False
    if not ok:
        errors.append(f"--join-signing-key-pin: must be sha256/ and 44 characters of canonical base64 (a SHA-256), got {pin!r}")
if roots and (e := hexes(roots, "--command-root-sha256")):
    errors.append(e)
if address and (e := host_port(address, True)):
    errors.append(f"--control-plane: {e}, got {address!r}")
for c in clusters.split(",") if clusters else []:
    server, sep, h = c.partition("#sha256:")
    rule = "must be https://<host>[:<port>]#sha256:<64 hex digits>"
    if not sep or not server.startswith("https://"):
        errors.append(f"--allowed-clusters: {c!r} {rule}")
    elif (e := host_port(server[len("https://"):], False)) or not re.fullmatch(r"[0-9a-f]{64}", h):
        errors.append(f"--allowed-clusters: {c!r} {rule}")
for e in errors:
    print(f"install.sh: {e}", file=sys.stderr)
sys.exit(1 if errors else 0)
PY

# --- the account -----------------------------------------------------------------------------------
mkdir -p "$(P /etc)"
touch "$(P /etc/passwd)" "$(P /etc/group)"
prefix=()
[ "$ROOT" = "" ] || prefix=(--prefix "$ROOT")
if ! grep -q "^${ACCOUNT}:" "$(P /etc/group)"; then
  groupadd "${prefix[@]}" --system "$ACCOUNT"
fi
if ! grep -q "^${ACCOUNT}:" "$(P /etc/passwd)"; then
  useradd "${prefix[@]}" --system --gid "$ACCOUNT" --home-dir /var/lib/bcd --no-create-home \
    --shell /usr/sbin/nologin --comment "bcd node agent" "$ACCOUNT"
fi
uid="$(awk -F: -v u="$ACCOUNT" '$1 == u { print $3 }' "$(P /etc/passwd)")"
gid="$(awk -F: -v g="$ACCOUNT" '$1 == g { print $3 }' "$(P /etc/group)")"
[ -n "$uid" ] && [ -n "$gid" ] || die "could not read the $ACCOUNT account back"
# The node never belongs to the root-equivalent libvirt group: the helper drives libvirt for it.
if grep -Eq "^libvirt:[^:]*:[^:]*:(.*,)?${ACCOUNT}(,|$)" "$(P /etc/group)"; then
  if [ "$ROOT" = "" ]; then
    gpasswd --delete "$ACCOUNT" libvirt >/dev/null  # /etc/group and /etc/gshadow alike
  else
    # Under --root (an image being built, the tests) gpasswd cannot chroot: edit the files.
    for f in "$(P /etc/group)" "$(P /etc/gshadow)"; do
      [ -e "$f" ] || continue
      awk -F: -v OFS=: -v u="$ACCOUNT" '$1 == "libvirt" {
          n = split($NF, m, ","); out = ""
          for (i = 1; i <= n; i++) if (m[i] != u && m[i] != "") out = out (out == "" ? "" : ",") m[i]
          $NF = out
        } { print }' "$f" >"$f.bcd-tmp" && chmod --reference="$f" "$f.bcd-tmp" && mv "$f.bcd-tmp" "$f"
    done
  fi
  echo "install.sh: removed $ACCOUNT from the libvirt group"
fi

# --- libvirt under the helper (DLV-HLP-13, Q-DLV-HLP-01 in docs/instances.md) -----------------------------
# libvirt runs QEMU as its own user and, with dynamic ownership, relabels a domain's files; under the
# helper it must not (root stages every definition and hands QEMU its disks), and QEMU's user reaches
# what it opens itself (a direct-boot kernel, its initrd) through the node's group instead: 0640 files
# in group-searchable directories, never world access. Only where libvirt is installed.
qemu_conf="$(P /etc/libvirt/qemu.conf)"
LIBVIRT_RESTART=false
if $HELPER && [ -f "$qemu_conf" ] && [ ! -L "$qemu_conf" ]; then
  # QEMU's user: qemu.conf's own `user = "..."`, else the distribution's default account.
  qemu_user="$(sed -n 's/^[[:space:]]*user[[:space:]]*=[[:space:]]*"\([^"]*\)".*/\1/p' "$qemu_conf" | tail -n 1)"
  if [ -z "$qemu_user" ]; then
    for candidate in libvirt-qemu qemu; do
      if grep -q "^${candidate}:" "$(P /etc/passwd)"; then qemu_user="$candidate"; break; fi
    done
  fi
  case "$qemu_user" in
    "") echo "install.sh: warning: $qemu_conf names no QEMU user and neither libvirt-qemu nor qemu exists: QEMU's user not added to group $ACCOUNT" >&2 ;;
    root | +0 | 0) echo "install.sh: warning: $qemu_conf runs QEMU as root: not added to group $ACCOUNT (run it as its own user)" >&2 ;;
    +* | *[!A-Za-z0-9_.-]*) echo "install.sh: warning: QEMU's user ${qemu_user@Q} in $qemu_conf: add it to group $ACCOUNT yourself" >&2 ;;
    *)
      members="$(awk -F: -v g="$ACCOUNT" '$1 == g { print $4 }' "$(P /etc/group)")"
      if ! grep -q "^${qemu_user}:" "$(P /etc/passwd)"; then
        echo "install.sh: warning: QEMU's user $qemu_user (from $qemu_conf) has no account here: not added to group $ACCOUNT" >&2
      elif [[ ",$members," != *",$qemu_user,"* ]]; then
        if [ "$ROOT" = "" ]; then
          gpasswd --add "$qemu_user" "$ACCOUNT" >/dev/null  # /etc/group and /etc/gshadow alike
        else
          for f in "$(P /etc/group)" "$(P /etc/gshadow)"; do
            [ -e "$f" ] || continue
            awk -F: -v OFS=: -v g="$ACCOUNT" -v u="$qemu_user" '$1 == g {
                if (NF < 4) $4 = ""
                $NF = ($NF == "" ? u : $NF "," u)
              } { print }' "$f" >"$f.bcd-tmp" && chmod --reference="$f" "$f.bcd-tmp" && mv "$f.bcd-tmp" "$f"
          done
        fi
        echo "install.sh: added QEMU's user $qemu_user to group $ACCOUNT"
        LIBVIRT_RESTART=true
      fi
      ;;
  esac
  # dynamic_ownership = 0: the last active setting wins in libvirt's reader, so every active line is
  # rewritten, and one is appended when there is none (the shipped file has it commented out).
  if grep -Eq '^[[:space:]]*dynamic_ownership[[:space:]]*=' "$qemu_conf"; then
    if grep -Ev '^[[:space:]]*dynamic_ownership[[:space:]]*=[[:space:]]*0[[:space:]]*$' "$qemu_conf" |
      grep -Eq '^[[:space:]]*dynamic_ownership[[:space:]]*='; then
      sed -E 's/^[[:space:]]*dynamic_ownership[[:space:]]*=.*/dynamic_ownership = 0/' "$qemu_conf" >"$qemu_conf.bcd-tmp"
      chmod --reference="$qemu_conf" "$qemu_conf.bcd-tmp" && chown --reference="$qemu_conf" "$qemu_conf.bcd-tmp"
      mv "$qemu_conf.bcd-tmp" "$qemu_conf"
      echo "install.sh: set dynamic_ownership = 0 in $qemu_conf"
      LIBVIRT_RESTART=true
    fi
  else
    printf '\n# bcd (install.sh): under bcd-helper root stages every domain; QEMU reaches its files\n# through group %s (docs/instances.md, Q-DLV-HLP-01).\ndynamic_ownership = 0\n' \
      "$ACCOUNT" >>"$qemu_conf"
    echo "install.sh: set dynamic_ownership = 0 in $qemu_conf"
    LIBVIRT_RESTART=true
  fi
fi

# --- directories -----------------------------------------------------------------------------------
mkdirp() {  # path owner group mode
  mkdir -p "$(P "$1")"
  chown "$2:$3" "$(P "$1")"
  chmod "$4" "$(P "$1")"
}
mkdirp /etc/bcd 0 "$gid" 0750
mkdirp /var/lib/bcd "$uid" "$gid" 0700
if $HELPER; then
  mkdirp /var/lib/bcd-hostconfig 0 0 0700
  mkdirp /var/log/bcd-helper 0 0 0700
fi

# --- root's config.toml ----------------------------------------------------------------------------
config="$(P /etc/bcd/config.toml)"
if [ -L "$config" ]; then
  die "$config is a symlink: root's config must be a regular file"
fi
tmp="$(mktemp "$(P /etc/bcd)/.config.toml.XXXXXX")"
trap 'rm -f "$tmp"' EXIT
{
  echo "# bcd's config (docs/config.md). Root's copy: root:bcd 0640 in /etc/bcd 0750."
  echo 'data_dir = "/var/lib/bcd"'
  [ -z "$PIN" ] || echo "join_signing_key_pin = \"$PIN\""
  [ -z "$ROOTS" ] || echo "command_root_sha256 = \"$ROOTS\""
  if [ -n "$CONTROL_PLANE" ]; then
    printf '\n[control_plane]\naddress = "%s"\n' "$CONTROL_PLANE"
  fi
  if $HELPER; then
    printf '\n[helper]\nsocket = "/run/bcd/helper.sock"\nnode_user = "%s"\n' "$ACCOUNT"
  fi
  printf '\n[host]\nunits = %s\n' "$HOST_UNITS"
  if [ -n "$CLUSTERS" ]; then
    printf '\n[kubernetes]\nallowed_clusters = "%s"\n' "$CLUSTERS"
  fi
} >"$tmp"
chown "0:$gid" "$tmp"
chmod 0640 "$tmp"
sync "$tmp"
if [ ! -e "$config" ]; then
  mv "$tmp" "$config"
  sync "$(P /etc/bcd)"
  echo "install.sh: wrote $config"
else
  # The keys the flags name, kept vs asked: each difference on its own line.
  differences="$("$PY" - "$config" "$tmp" "$GIVEN" <<'PY'
import sys, tomllib
kept_path, new_path, given = sys.argv[1], sys.argv[2], sys.argv[3].split()
KEYS = {
    "pin": [("join_signing_key_pin",)],
    "roots": [("command_root_sha256",)],
    "control_plane": [("control_plane", "address")],
    "units": [("host", "units")],
    "clusters": [("kubernetes", "allowed_clusters")],
    "helper": [("helper", "socket"), ("helper", "node_user")],
}
def get(doc, path):
    for part in path:
        if not isinstance(doc, dict) or part not in doc:
            return None
        doc = doc[part]
    return doc
try:
    with open(kept_path, "rb") as f:
        kept = tomllib.load(f)
except (OSError, tomllib.TOMLDecodeError) as e:
    print(f"the kept config cannot be read: {e}")
    sys.exit(0)
with open(new_path, "rb") as f:
    new = tomllib.load(f)
for name in given:
    for path in KEYS[name]:
        a, b = get(kept, path), get(new, path)
        if a != b:
            show = lambda v: "(none)" if v is None else repr(v)
            print(f"{'.'.join(path)}: kept {show(a)}, the flags give {show(b)}")
PY
)"
  if [ -z "$differences" ]; then
    echo "install.sh: kept the existing $config"
  elif $REPLACE; then
    cp -p "$config" "$config.old"
    mv "$tmp" "$config"
    sync "$(P /etc/bcd)"
    echo "$differences" | sed 's/^/install.sh: replaced: /'
    echo "install.sh: wrote $config (the kept one is $config.old)"
  else
    echo "$differences" | sed 's/^/install.sh: differs: /' >&2
    echo "install.sh: kept $config unchanged; re-run with --replace to write the flags' config" >&2
    exit 3
  fi
fi
# Whatever was there: root owns it, the node's group reads it, no one else writes it.
chown "0:$gid" "$config"
chmod 0640 "$config"
[ -n "$PIN" ] || grep -q '^join_signing_key_pin' "$config" ||
  echo "install.sh: warning: no join_signing_key_pin in $config; give --join-signing-key-pin (the install's out-of-band pin)" >&2

# --- systemd units ---------------------------------------------------------------------------------
mkdir -p "$(P /etc/systemd/system)"
for u in "${units[@]}"; do
  if [ -e "$(P "/lib/systemd/system/$u")" ]; then
    # The package's unit (make deb): a copy in /etc would hide the package's later versions.
    echo "install.sh: $u comes from the package"
    [ ! -e "$(P "/etc/systemd/system/$u")" ] ||
      echo "install.sh: warning: $(P "/etc/systemd/system/$u") (an earlier install from a checkout?) hides the package's unit; remove it unless you mean to keep it" >&2
  else
    install -m 0644 -o 0 -g 0 "$HERE/$u" "$(P "/etc/systemd/system/$u")"
  fi
done
# Each unit is enabled and started only once it is ready, so that neither a boot nor a dependency
# starts it early. The node once joined: a node without identity.json exits 78 at once, and the unit's
# RestartPreventExitStatus=78 leaves it failed. The helper once its audit log has a sealing key the
# operator holds: started without one, it makes a key no one holds (docs/deploy.md: `bcd-helper audit
# init` before the helper's first start). The node also waits for that: it Wants= the helper, so
# starting it (or booting with it enabled) would start the helper too.
sealed=true
if $HELPER && [ ! -e "$(P /var/log/bcd-helper/audit.key)" ] && [ ! -e "$(P /var/log/bcd-helper/audit.log)" ]; then
  sealed=false
fi
joined=true
[ -e "$(P /var/lib/bcd/identity.json)" ] || joined=false
ready=()
$HELPER && $sealed && ready+=(bcd-helper.service)
$joined && $sealed && ready+=(bcd-node.service)
if $ENABLE && [ "$ROOT" = "" ] && [ -d /run/systemd/system ]; then
  systemctl daemon-reload
  [ "${#ready[@]}" -eq 0 ] || systemctl enable --now "${ready[@]}"
elif $ENABLE; then
  echo "install.sh: systemd is not running here (or --root was given): enable ${units[*]} yourself, each once it is ready (below)"
fi
if $ENABLE && ! $sealed; then
  echo "install.sh: bcd-helper.service not enabled or started: its audit log has no sealing key yet." \
    "Next, as root: bcd-helper audit init (keep the verification key it prints off this host)," \
    "then systemctl enable --now bcd-helper.service"
fi
if $ENABLE && ! $joined; then
  echo "install.sh: bcd-node.service not enabled or started: the node has not joined. Next, as root:" \
    "bcd join --token=TOKEN --address HOST:PORT, then systemctl enable --now bcd-node.service"
elif $ENABLE && ! $sealed; then
  echo "install.sh: bcd-node.service not enabled or started: it would start bcd-helper.service (Wants=)" \
    "before its audit log is sealed. After the step above: systemctl enable --now bcd-node.service"
fi
# bcd-node.service's SupplementaryGroups=systemd-journal (the XID watcher reads the kernel log): a host
# without that group cannot start the unit at all (status=216/GROUP).
grep -q '^systemd-journal:' "$(P /etc/group)" ||
  echo "install.sh: warning: no group systemd-journal in $(P /etc/group): bcd-node.service (SupplementaryGroups=systemd-journal) will not start (216/GROUP); install systemd's journald, or drop that line in a drop-in and accept that XID errors go unseen" >&2
if $LIBVIRT_RESTART; then
  echo "install.sh: libvirt reads qemu.conf and QEMU's groups when it starts. Next, as root:" \
    "systemctl restart libvirtd (running domains keep running; new ones start with the change)"
fi
progs=(/usr/bin/bcd)
$HELPER && progs+=(/usr/bin/bcd-helper)
for prog in "${progs[@]}"; do
  [ -x "$(P "$prog")" ] || echo "install.sh: note: $prog is not installed yet (the units run it)" >&2
done
echo "install.sh: done"
