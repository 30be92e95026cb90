#!/usr/bin/env bash
# CPython versions this machine's Debian does not carry (3.14, 3.15), from a cached, minimal
# Debian unstable chroot, for tools/test_matrix.py, which runs the whole suite there. Needs
# root (debootstrap, mount, chroot).
#
#   tools/provision_pythons.sh               create the chroot, or reuse it when complete
#   tools/provision_pythons.sh run CMD...    run CMD inside it, in this repo, as root
#   tools/provision_pythons.sh path          print where the chroot lives
#
# Environment:
#   SPANPROF_CHROOT          where the chroot lives (default /var/cache/spanprof-chroot-v2)
#   SPANPROF_DEBIAN_MIRROR   Debian mirror (default http://deb.debian.org/debian)
#
# The chroot counts as complete only when its marker file holds this script's recipe (suite
# and package list): change PACKAGES and the next call rebuilds it. It is built beside the
# cache and moved into place at the end, so an interrupted build never looks complete.
#
# `run` mounts /proc, /dev, the host's resolv.conf and CA bundle (pip reaches PyPI through
# them) and the repo at its own path, so paths (and the repo's .venv-* folders) mean the same
# inside and out. The mounts live in a private mount namespace (unshare): they vanish with
# the command even if it is killed, and the trap unmounts them on every ordinary exit.
set -euo pipefail

# The default path carries the recipe's version: worktrees still on an older recipe keep their
# own chroot instead of rebuilding a shared one back and forth.
CHROOT="${SPANPROF_CHROOT:-/var/cache/spanprof-chroot-v2}"
MIRROR="${SPANPROF_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
SUITE=unstable
VERSIONS=(3.14 3.15)
# Debian's names (checked with the chroot's apt-cache): pythonX.Y-venv brings ensurepip,
# pythonX.Y-dev the headers; gcc and libc6-dev build spanprof's C extensions in each venv.
# Debian packages no free-threaded (3.14t) build, so the matrix finds none here.
# The whole suite runs here, and under CI a test whose component is missing fails: the same
# system components as .ci/run installs on the host (unstable's versions, not the host's).
PACKAGES=(
  gcc libc6-dev
  libcrypt-dev      # crypt.h: pip builds uwsgi from source (tests/test_e2e_gunicorn.py)
  prometheus        # tests/test_e2e_prometheus.py
  docker-compose    # tests/test_compose.py validates offline
  chromium fonts-dejavu-core  # tests/test_local_browser.py, tests/test_e2e_breach.py
  golang-go         # go tool pprof: tests/test_memory_push.py
)
for v in "${VERSIONS[@]}"; do PACKAGES+=("python$v" "python$v-venv" "python$v-dev"); done
RECIPE="spanprof-chroot v2 suite=$SUITE packages=${PACKAGES[*]}"
MARKER=.spanprof-chroot
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
SELF="$REPO/tools/provision_pythons.sh"

die() {
  echo "provision_pythons: $*" >&2
  exit 1
}

complete() {
  [ -f "$1/$MARKER" ] && [ "$(cat "$1/$MARKER")" = "$RECIPE" ]
}

# Refuse to delete a tree that something is mounted in (a mount made outside `run`).
remove_tree() {
  if grep -q " $1/" /proc/self/mountinfo; then
    die "$1 has mounts inside; unmount them first"
  fi
  rm -rf --one-file-system "$1"
}

# Inside a private mount namespace: mount, chroot, run, unmount.
inside() {
  local root="$1" repo="$2"
  shift 2
  MOUNTED=()  # global: the EXIT trap runs after this function has returned
  cleanup() {
    local i
    for ((i = ${#MOUNTED[@]} - 1; i >= 0; i--)); do
      umount -R "${MOUNTED[$i]}" 2>/dev/null || umount -l "${MOUNTED[$i]}" || true
    done
  }
  trap cleanup EXIT
  bind() {  # bind SOURCE TARGET [mount options]
    [ -e "$1" ] || return 0
    if [ -d "$1" ]; then mkdir -p "$2"; elif [ ! -f "$2" ]; then return 0; fi
    mount --rbind "$1" "$2"
    MOUNTED+=("$2")
    if [ $# -gt 2 ]; then mount -o "remount,bind,$3" "$2"; fi
  }
  mount -t proc proc "$root/proc"
  MOUNTED+=("$root/proc")
  bind /dev "$root/dev"
  bind /etc/resolv.conf "$root/etc/resolv.conf" ro
  bind /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt" ro
  bind "$repo" "$root$repo"
  # A clean environment: the host's PATH, pip configuration and temp dirs name host paths.
  local env=(PATH=/usr/local/bin:/usr/bin:/bin HOME=/root LANG=C.UTF-8
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt PIP_DISABLE_PIP_VERSION_CHECK=1)
  local name
  for name in CI PIP_DEFAULT_TIMEOUT PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_TRUSTED_HOST \
    http_proxy https_proxy no_proxy HTTP_PROXY HTTPS_PROXY NO_PROXY DEBIAN_FRONTEND; do
    if [ -n "${!name:-}" ]; then env+=("$name=${!name}"); fi
  done
  local rc=0
  # shellcheck disable=SC2016  # $1 and $@ expand in the inner shell
  chroot "$root" /usr/bin/env -i "${env[@]}" /bin/sh -c 'cd "$1" && shift && exec "$@"' sh \
    "$repo" "$@" || rc=$?
  return "$rc"
}

run() {
  [ "$(id -u)" -eq 0 ] || die "run needs root (mount, chroot)"
  complete "$CHROOT" || die "no complete chroot at $CHROOT: run $SELF first"
  exec unshare --mount --propagation private -- "$SELF" _inside "$CHROOT" "$REPO" "$@"
}

provision() {
  if complete "$CHROOT"; then
    echo "provision_pythons: reusing $CHROOT"
    return 0
  fi
  [ "$(id -u)" -eq 0 ] || die "building the chroot needs root"
  if ! command -v debootstrap >/dev/null 2>&1; then
    command -v apt-get >/dev/null 2>&1 || die "needs debootstrap (a Debian package)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap \
      || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends debootstrap; }
  fi
  local new="$CHROOT.new" started=$SECONDS
  mkdir -p "$(dirname "$CHROOT")"
  remove_tree "$new"
  echo "provision_pythons: debootstrap $SUITE into $new" >&2
  # In a private mount namespace too: the /proc and /sys debootstrap mounts die with it.
  unshare --mount --propagation private -- \
    debootstrap --variant=minbase "$SUITE" "$new" "$MIRROR" >"$new.log" 2>&1 \
    || { tail -20 "$new.log" >&2; die "debootstrap failed (log: $new.log)"; }
  # unstable's Release file can outlive its Valid-Until on a mirror that lags; the packages are
  # still signed. No docs, man pages or translations: less to unpack.
  cat >"$new/etc/apt/apt.conf.d/99spanprof" <<'EOF'
Acquire::Check-Valid-Until "false";
Acquire::Languages "none";
APT::Install-Recommends "false";
EOF
  printf 'path-exclude=/usr/share/%s/*\n' doc man info locale >"$new/etc/dpkg/dpkg.cfg.d/01nodoc"
  # debootstrap leaves the package lists it installed from: try them first, refresh on a miss.
  local install="apt-get install -y -qq ${PACKAGES[*]} && apt-get clean"
  unshare --mount --propagation private -- "$SELF" _inside "$new" "$REPO" /bin/sh -c \
    "export DEBIAN_FRONTEND=noninteractive; ($install) || (apt-get update -qq && $install)" \
    >>"$new.log" 2>&1 || { tail -20 "$new.log" >&2; die "apt-get install failed (log: $new.log)"; }
  # Each interpreter runs and has ensurepip (for venv) and its headers.
  local check='import ensurepip, os, sysconfig, sys
assert os.path.exists(os.path.join(sysconfig.get_path("include"), "Python.h")), "no Python.h"
print(sys.version)'
  for v in "${VERSIONS[@]}"; do
    unshare --mount --propagation private -- "$SELF" _inside "$new" "$REPO" \
      "python$v" -c "$check" || die "python$v in $new is incomplete"
  done
  echo "$RECIPE" >"$new/$MARKER"
  remove_tree "$CHROOT"
  mv "$new" "$CHROOT"
  mv "$new.log" "$CHROOT.log"
  echo "provision_pythons: built $CHROOT in $((SECONDS - started)) s"
}

locked() {  # locked shared|exclusive FUNCTION ARGS...: one builder, or any number of runners
  local mode="$1"
  shift
  mkdir -p "$(dirname "$CHROOT")"
  exec 9>>"$CHROOT.lock"
  flock "--$mode" 9
  "$@"
}

case "${1:-provision}" in
  provision) locked exclusive provision ;;
  run)
    shift
    [ $# -gt 0 ] || die "usage: $0 run CMD..."
    locked shared run "$@"
    ;;
  path) echo "$CHROOT" ;;
  _inside)
    shift
    inside "$@"
    ;;
  *) die "usage: $0 [provision | run CMD... | path]" ;;
esac
