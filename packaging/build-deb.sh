#!/usr/bin/env bash
# Build the two Debian packages, bcd-helper and bcd-node, with dpkg-deb (docs/deploy.md "Packages").
#
# Each carries its own virtual environment under /opt/bcd/ (bcd-helper: bcd-shared, bcd-helper and their
# few libraries, no trio, no grpclib; bcd-node: bcd-shared, bcd-agent and theirs), built here from the
# wheels in dist/ (make dist) and the wheels of their dependencies (pinned by constraints.txt), so
# nothing is downloaded when the package is installed. The venvs run the system's python3.11; the
# simulated host (devhost/, bcd-simhost) is in neither.
#
# Usage: packaging/build-deb.sh [OUT]   (OUT defaults to dist/; run from the repository root after make dist)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-dist}"
PY_SYS=/usr/bin/python3.11          # the interpreter the packaged venvs run (Debian 12's python3)
DEV_PIP=.venv/bin/pip               # builds and installs; never shipped
VERSION="$(.venv/bin/python -c 'from bcd_shared.version import VERSION; print(VERSION)')"
ARCH="$(dpkg --print-architecture)"
WORK=build/deb
WHEELS="$WORK/wheels"

die() { echo "build-deb.sh: $*" >&2; exit 1; }
[ -x "$PY_SYS" ] || die "$PY_SYS is missing (apt-get install python3.11 python3-venv)"
for d in shared helper agent; do
  ls dist/bcd_${d}-"$VERSION"-py3-none-any.whl >/dev/null 2>&1 || die "dist/ has no bcd-$d $VERSION wheel: run make dist"
done
[ "$("$PY_SYS" -c 'import sys; print(sys.version_info[:2] == (3, 11))')" = True ] || die "$PY_SYS is not 3.11"

rm -rf "$WORK"
mkdir -p "$WHEELS" "$OUT"
# Every wheel the two venvs need, resolved against the pins; bcd's own from dist/ only.
"$DEV_PIP" wheel -q -c constraints.txt -w "$WHEELS" --find-links dist \
  "bcd-helper==$VERSION" "bcd-agent==$VERSION"

# build_pkg NAME VENV_NAME REQUIREMENT PROGRAM UNIT DESCRIPTION
build_pkg() {
  local name="$1" venv="$2" req="$3" prog="$4" unit="$5" desc="$6"
  local stage="$WORK/$name"
  local prefix="/opt/bcd/$venv"
  mkdir -p "$stage$prefix" "$stage/usr/bin" "$stage/lib/systemd/system" "$stage/DEBIAN"
  "$PY_SYS" -m venv --without-pip "$stage$prefix"
  # The dev pip installs into that interpreter's venv, from the wheels above only.
  "$DEV_PIP" --python "$stage$prefix/bin/python" install -q --no-index --find-links "$WHEELS" \
    --no-compile --no-warn-script-location -c constraints.txt "$req"
  # The venv as it will be found: its own paths under /opt/bcd, not the staging directory.
  rm -f "$stage$prefix"/bin/activate* "$stage$prefix"/bin/Activate.ps1
  for f in "$stage$prefix"/bin/* "$stage$prefix/pyvenv.cfg"; do
    [ -L "$f" ] && continue
    if grep -Iq . "$f"; then sed -i "s#$PWD/$stage##g" "$f"; fi
  done
  for link in python python3 python3.11; do ln -sfn "$PY_SYS" "$stage$prefix/bin/$link"; done
  ! grep -rIl "$PWD/$stage" "$stage$prefix" || die "$name: the staging path is still written in the files above"
  # Byte-code compiled now, under the installed paths (tracebacks name /opt/bcd/...).
  "$PY_SYS" -m compileall -q -j 0 -s "$stage" -p / "$stage$prefix/lib" >/dev/null
  if [ "$name" = bcd-node ]; then
    # /usr/bin/bcd -> /usr/lib/bcd/bcd, the path self-update flips (docs/daemon.md "Where it runs"): here a
    # regular file running the venv's bcd, which root keeps as the `initial` release at the first swap.
    mkdir -p "$stage/usr/lib/bcd"
    printf '%s\n' "#!$prefix/bin/python3" \
      "# bcd-node's packaged release: the venv's bcd. Self-update replaces this file with a link to" \
      "# /usr/lib/bcd/releases/<version>/bcd (docs/daemon.md); installing the package puts it back." \
      "import sys" "" "from bcd_agent.cli import main" "" "sys.exit(main())" >"$stage/usr/lib/bcd/bcd"
    chmod 0755 "$stage/usr/lib/bcd/bcd"
    ln -s /usr/lib/bcd/bcd "$stage/usr/bin/$prog"
  else
    ln -s "$prefix/bin/$prog" "$stage/usr/bin/$prog"
  fi
  install -m 0644 "deploy/$unit" "$stage/lib/systemd/system/$unit"
  if [ "$name" = bcd-node ]; then
    mkdir -p "$stage/usr/share/bcd"
    install -m 0755 deploy/install.sh "$stage/usr/share/bcd/install.sh"
  fi
  # The units' Documentation= points here: the pages an operator needs on the host, offline.
  local docs="README.md docs/deploy.md docs/operations.md docs/config.md"
  if [ "$name" = bcd-helper ]; then docs="$docs docs/helper.md docs/helper-rpc.md"; else docs="$docs docs/daemon.md"; fi
  mkdir -p "$stage/usr/share/doc/$name"
  for doc in $docs; do install -m 0644 "$doc" "$stage/usr/share/doc/$name/"; done
  for script in postinst prerm postrm; do
    install -m 0755 "packaging/debian/$name.$script" "$stage/DEBIAN/$script"
  done
  local size
  size="$(du -sk --exclude=DEBIAN "$stage" | cut -f1)"
  {
    echo "Package: $name"
    echo "Version: $VERSION"
    echo "Architecture: $ARCH"
    echo "Maintainer: bcd developers <bcd@example.com>"
    echo "Installed-Size: $size"
    # bcd-node: python3 too, the interpreter a self-update's release runs on (#!/usr/bin/python3).
    if [ "$name" = bcd-node ]; then echo "Depends: python3.11, python3 (>= 3.11), passwd"; else echo "Depends: python3.11, passwd"; fi
    [ "$name" = bcd-node ] && echo "Recommends: bcd-helper (= $VERSION)"
    echo "Section: admin"
    echo "Priority: optional"
    echo "Description: $desc"
  } >"$stage/DEBIAN/control"
  find "$stage" -type d -exec chmod 0755 {} +
  dpkg-deb --root-owner-group -Zgzip --build "$stage" "$OUT/${name}_${VERSION}_${ARCH}.deb" >/dev/null
  echo "build-deb.sh: $OUT/${name}_${VERSION}_${ARCH}.deb"
}

build_pkg bcd-helper helper "bcd-helper==$VERSION" bcd-helper bcd-helper.service \
  "bcd's root helper: a narrow Unix-socket RPC that re-validates and performs bcd's privileged steps"
build_pkg bcd-node node "bcd-agent==$VERSION" bcd bcd-node.service \
  "bcd node agent: converges signed NodeSpecs on GPU and VM hosts (unprivileged)"
