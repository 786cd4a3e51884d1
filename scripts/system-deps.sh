#!/usr/bin/env sh
# The shared libraries the Mooncake CPU build links against (even over TCP), and iproute2 for the
# emulated-link testbed. Installed with apt-get when missing and we are root; otherwise one clear
# line says what to run. Also Debian's python3-venv when $PY (the interpreter `make` builds the
# venv with) has no ensurepip: a fresh Debian python3 cannot make a venv without it. And g++ for the
# C++ CPU attention kernel (kvpipe/model/cpu/kernels): optional, kvpipe falls back to torch
# without it, so a non-root user missing only g++ gets a note, not a failure.
# Called by `make setup` (and so by `make run` and `make test`).
set -eu
# ldconfig and ip live in the sbin directories, which a user's (or make's) PATH may lack
PATH="$PATH:/usr/sbin:/sbin"
PY="${PY:-python3}"
LIBS="libibverbs.so.1 librdmacm.so.1 libnuma.so.1"
PKGS="libibverbs1 librdmacm1 libnuma1 iproute2"
missing=""
if ! "$PY" -c "import ensurepip" >/dev/null 2>&1; then
  missing="$missing ensurepip"
  PKGS="$PKGS python3-venv"
fi
for lib in $LIBS; do
  ldconfig -p 2>/dev/null | grep -q "$lib" || missing="$missing $lib"
done
command -v ip >/dev/null 2>&1 || missing="$missing ip"
nocxx=""
if ! command -v "${CXX:-g++}" >/dev/null 2>&1; then
  nocxx=" g++"
  PKGS="$PKGS g++"
fi
[ -z "$missing$nocxx" ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "kvpipe setup: installing$missing$nocxx (apt-get install $PKGS)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq --no-install-recommends $PKGS >/dev/null 2>&1 || {
    apt-get update -qq && apt-get install -y -qq --no-install-recommends $PKGS >/dev/null; }
  exit 0
fi
if [ -z "$missing" ]; then
  echo "kvpipe setup: no C++ compiler, so decode attention runs the slower torch path; for the kernel run: sudo apt-get install g++" >&2
  exit 0
fi
echo "kvpipe setup: missing$missing$nocxx; run: sudo apt-get install $PKGS" >&2
exit 1
