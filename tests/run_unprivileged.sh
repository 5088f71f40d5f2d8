#!/usr/bin/env bash
# Run pytest as an unprivileged user (nobody) from a root shell, e.g.
#     bash tests/run_unprivileged.sh tests/tools/test_sandbox_attacks.py -k "not unprivileged_caller"
# The project's interpreter often lives under /root (mode 0700), which nobody cannot enter: in a
# private mount namespace a tmpfs covers /root and only the interpreter's installation is bound back.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" != 0 ]; then exec .venv/bin/python -m pytest -p no:cacheprovider -q "$@"; fi
PREFIX="$(dirname "$(dirname "$(readlink -f .venv/bin/python)")")"
exec unshare --mount --propagation private bash -c '
  set -e
  prefix=$1; shift
  if [ "${prefix#/root/}" != "$prefix" ]; then
    stage=$(mktemp -d); mount --bind "$prefix" "$stage"
    mount -t tmpfs -o mode=755 stlr-root /root
    mkdir -p "$prefix"; mount --move "$stage" "$prefix"
  fi
  home=$(mktemp -d); chown 65534:65534 "$home"
  exec setpriv --reuid=65534 --regid=65534 --clear-groups env -i PATH=/usr/bin:/bin HOME="$home" \
    PYTHONDONTWRITEBYTECODE=1 STLR_SANDBOX_ISOLATION="${STLR_SANDBOX_ISOLATION:-auto}" .venv/bin/python -m pytest -p no:cacheprovider -q "$@"
' stlr-unprivileged "$PREFIX" "$@"
