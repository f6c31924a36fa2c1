#!/usr/bin/env bash
# What the build and the C++ tests need beyond Python packages: a C++ compiler, and for `make test` CMake,
# Ninja and GoogleTest. Run as root on a machine with apt-get, it installs whatever is missing; otherwise it
# stops at once with one line naming the packages to install.
#   tools/system_deps.sh build      # the compiler (make demo, make build)
#   tools/system_deps.sh test       # the compiler, CMake, Ninja, GoogleTest (make test)
set -uo pipefail
need=${1:-test}
missing=()
command -v "${CXX:-c++}" >/dev/null 2>&1 || command -v g++ >/dev/null 2>&1 || missing+=(g++)

has_gtest() {
  local dir lib
  for dir in /usr/include /usr/local/include ${GTEST_ROOT:+$GTEST_ROOT/include}; do
    [ -f "$dir/gtest/gtest.h" ] || continue
    for lib in /usr/lib /usr/lib64 /usr/lib/*-linux-gnu /usr/local/lib /usr/local/lib64 ${GTEST_ROOT:+$GTEST_ROOT/lib}; do
      compgen -G "$lib/libgtest.*" >/dev/null && return 0
    done
  done
  return 1
}

if [ "$need" = test ]; then
  command -v cmake >/dev/null 2>&1 || missing+=(cmake)
  command -v ninja >/dev/null 2>&1 || missing+=(ninja-build)
  has_gtest || missing+=(libgtest-dev)
fi
[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing ${missing[*]} with apt-get"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null && exit 0
  echo "apt-get could not install ${missing[*]}" >&2
  exit 1
fi
echo "missing system packages: ${missing[*]} (e.g. sudo apt-get install ${missing[*]}), then run make again" >&2
exit 1
