#!/usr/bin/env bash
# Install Tessera's build dependencies from Debian (only what is missing), then
# configure and build into build/.  Safe to re-run.  clang and libclang-rt-14-dev are
# for the libFuzzer targets (tests/fuzz).
#   WERROR=true  treat warnings as errors (the test command and CI set it)
#   BUILD_DIR    build folder (default: build)
#   MESON_ARGS   extra `meson setup` arguments, space-separated (first configure only)
#   BUILDTYPE    meson build type (default: debugoptimized; first configure only)
#   DEPS_ONLY=1  install the packages and stop (deploy/Containerfile: a cached layer)
#   TEST_TOOLS=0 leave out the tools only the deploy tests need
set -euo pipefail
cd "$(dirname "$0")/.."

PKGS=(build-essential pkg-config meson ninja-build python3 python3-venv
      libuv1-dev node-llhttp libzmq3-dev libprotobuf-c-dev protobuf-c-compiler
      libjansson-dev libyaml-dev libpcre2-dev libcmocka-dev libxxhash-dev libsystemd-dev
      libssl-dev clang libclang-rt-14-dev libcurl4-openssl-dev valgrind)
# Tools of the deploy tests, not of the build (deploy/Containerfile sets TEST_TOOLS=0):
# systemd-analyze (test_systemd.py), buildah + debootstrap (test_container.py builds the
# image), prometheus (test_grafana.py scrapes a running server).
[ "${TEST_TOOLS:-1}" = 1 ] && PKGS+=(systemd buildah debootstrap prometheus)
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
PKGS+=(libutf8proc-dev)   # tokenizer NFC/NFKC normalizers (common/tokenizer.c)

missing=()
for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "setup: installing ${missing[*]}"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

[ "${DEPS_ONLY:-0}" = 1 ] && exit 0

BUILD_DIR="${BUILD_DIR:-build}"
WERROR="${WERROR:-false}"
read -r -a extra_args <<< "${MESON_ARGS:-}"
if [ ! -f "$BUILD_DIR/build.ninja" ]; then
    # CC (e.g. CC=clang for the fuzz build) is honoured by meson at setup time.
    meson setup "$BUILD_DIR" --buildtype="${BUILDTYPE:-debugoptimized}" -Dwerror="$WERROR" "${extra_args[@]}" >/dev/null
else
    meson configure "$BUILD_DIR" -Dwerror="$WERROR" >/dev/null
fi
meson compile -C "$BUILD_DIR" >/dev/null
echo "setup: built $BUILD_DIR/ (tessera, tessera-router, tessera-worker)"
