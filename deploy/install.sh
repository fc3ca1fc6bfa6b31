#!/usr/bin/env bash
# Install bcd on a host: the unprivileged `bcd` account, its directories, root's config.toml and
# the systemd units (bcd-helper.service as root, bcd-node.service as `bcd`). See docs/deploy.md.
#
# The programs themselves (/usr/bin/bcd and /usr/bin/bcd-helper) come from the package or wheel
# install; this script lays out what they need, with the ownership and modes the seeds require:
#   /etc/bcd                 root:bcd  0750   (only root can write; the node reads through its group)
#   /etc/bcd/config.toml     root:bcd  0640   (root's config: regular file, root-owned, not writable
#                                              by group or others, in root-only directories)
#   /var/lib/bcd             bcd:bcd   0700   (data_dir: journal.db, identity.json 0600)
#   /var/lib/bcd-hostconfig  root:root 0700   (root's records: join-response.pb, helper-intent.json)
#   /var/log/bcd-helper      root:root 0700   (the helper's audit log)
# Re-running it is safe: an existing config.toml is kept (its ownership and mode are put right),
# and an account left in the root-equivalent `libvirt` group by an older install is taken out.
#
# Usage: install.sh [--root DIR] [--join-signing-key-pin sha256/...] [--command-root-sha256 HEX,...]
#                   [--control-plane HOST:PORT] [--host-units-external] [--allowed-clusters LIST]
#                   [--no-helper] [--no-enable]
set -euo pipefail

ROOT=/
PIN=""
ROOTS=""
CONTROL_PLANE=""
HOST_UNITS=true
CLUSTERS=""
HELPER=true
ENABLE=true
ACCOUNT=bcd
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

die() { echo "install.sh: $*" >&2; exit 2; }

while [ $# -gt 0 ]; do
  case "$1" in
    --root) ROOT="${2:?--root needs a directory}"; shift 2 ;;
    --join-signing-key-pin) PIN="${2:?}"; shift 2 ;;
    --command-root-sha256) ROOTS="${2:?}"; shift 2 ;;
    --control-plane) CONTROL_PLANE="${2:?}"; shift 2 ;;
    --host-units-external) HOST_UNITS=false; shift ;;
    --allowed-clusters) CLUSTERS="${2:?}"; shift 2 ;;
    --no-helper) HELPER=false; shift ;;
    --no-enable) ENABLE=false; shift ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
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
case "$PIN" in ""|sha256/*) ;; *) die "--join-signing-key-pin must look like sha256/<base64>" ;; esac

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
if [ ! -e "$config" ]; then
  tmp="$(mktemp "$(P /etc/bcd)/.config.toml.XXXXXX")"
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
  mv "$tmp" "$config"
  sync "$(P /etc/bcd)"
  echo "install.sh: wrote $config"
else
  echo "install.sh: kept the existing $config"
fi
# Whatever was there: root owns it, the node's group reads it, no one else writes it.
chown "0:$gid" "$config"
chmod 0640 "$config"
[ -n "$PIN" ] || grep -q '^join_signing_key_pin' "$config" ||
  echo "install.sh: warning: no join_signing_key_pin in $config; give --join-signing-key-pin (the install's out-of-band pin)" >&2

# --- systemd units ---------------------------------------------------------------------------------
units=(bcd-node.service)
$HELPER && units+=(bcd-helper.service)
mkdir -p "$(P /etc/systemd/system)"
for u in "${units[@]}"; do
  install -m 0644 -o 0 -g 0 "$HERE/$u" "$(P "/etc/systemd/system/$u")"
done
if $ENABLE && [ "$ROOT" = "" ] && [ -d /run/systemd/system ]; then
  systemctl daemon-reload
  systemctl enable --now "${units[@]}"
elif $ENABLE; then
  echo "install.sh: systemd is not running here (or --root was given): enable ${units[*]} yourself"
fi
for prog in /usr/bin/bcd /usr/bin/bcd-helper; do
  [ -x "$(P "$prog")" ] || echo "install.sh: note: $prog is not installed yet (the units run it)" >&2
done
echo "install.sh: done"
