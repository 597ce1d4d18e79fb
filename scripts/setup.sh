#!/usr/bin/env bash
# Install Tessera's build dependencies from Debian (only what is missing), then
# configure and build into build/.  Safe to re-run.  clang and libclang-rt-14-dev are
# for the libFuzzer targets (tests/fuzz).
#   WERROR=true  treat warnings as errors (the test command and CI set it)
#   BUILD_DIR    build folder (default: build)
#   MESON_ARGS   extra `meson setup` arguments, space-separated (first configure only)
#   BUILDTYPE    meson build type (default: debugoptimized; first configure only)
#   DEPS_ONLY=1  install the packages, build xgrammar, and stop (deploy/Containerfile: a cached layer)
#   TEST_TOOLS=0 leave out the tools only the deploy tests need
# xgrammar (structured outputs, grammar/) is built once from its pinned PyPI sdist into
# .cache/xgrammar/<version>/ (static C++ core only, no Python); later runs reuse it.
set -euo pipefail
cd "$(dirname "$0")/.."

PKGS=(build-essential pkg-config meson ninja-build python3 python3-venv
      libuv1-dev node-llhttp libzmq3-dev libprotobuf-c-dev protobuf-c-compiler
      libjansson-dev libyaml-dev libpcre2-dev libcmocka-dev libxxhash-dev libsystemd-dev
      libssl-dev clang libclang-rt-14-dev libcurl4-openssl-dev valgrind
      cmake python3-pip)
# Tools of the deploy tests, not of the build (deploy/Containerfile sets TEST_TOOLS=0):
# systemd (systemd-analyze for test_systemd.py; systemd itself, which test_systemd_boot.py
# boots in a namespace with util-linux's unshare/nsenter), buildah + debootstrap
# (test_container.py builds the image), prometheus (test_grafana.py scrapes a running
# server), iproute2 (test_doctor.py puts two "nodes" in network namespaces).
[ "${TEST_TOOLS:-1}" = 1 ] && PKGS+=(systemd util-linux buildah debootstrap prometheus iproute2)
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

# xgrammar's C++ core: the sdist carries the sources; its build dependencies are for the
# Python wheel, so only the library target is built, with cmake + ninja.  -O2 without
# LTO (the sdist's defaults are -O3 -flto=auto): about half the build time on CI's
# 90-minute budget, and the mask fill stays in microseconds (docs/benchmarks.md).
XGR_VERSION=0.2.8
XGR_SHA=8305646fd2b319d6c3003f51a1665e54cbbe9cba1fb636bc41d0b46434ccbb80
XGR_DIR=.cache/xgrammar
XGR_PREFIX="$XGR_DIR/$XGR_VERSION"
build_xgrammar() {
    [ -f "$XGR_PREFIX/lib/libxgrammar.a" ] && [ -f "$XGR_PREFIX/include/xgrammar/xgrammar.h" ] && return 0
    local sdist="$XGR_DIR/xgrammar-$XGR_VERSION.tar.gz" py=python3 work t0
    [ -x .venv/bin/python ] && py=.venv/bin/python
    mkdir -p "$XGR_DIR"
    if ! echo "$XGR_SHA  $sdist" | sha256sum -c --status 2>/dev/null; then
        rm -f "$sdist"
        # TESSERA_PIP_CERT: a CA bundle for pip where HTTPS goes through an intercepting
        # proxy and the system store lacks its CA (the container build, see Containerfile);
        # as PIP_CERT, so the build-dependency pip that reads the sdist's metadata has it too.
        ${TESSERA_PIP_CERT:+env PIP_CERT="$TESSERA_PIP_CERT"} "$py" -m pip download --quiet --no-deps \
            --disable-pip-version-check --no-binary xgrammar "xgrammar==$XGR_VERSION" -d "$XGR_DIR" >&2 ||
            { echo "setup: pip download xgrammar failed" >&2; return 1; }
        echo "$XGR_SHA  $sdist" | sha256sum -c --status ||
            { echo "setup: $sdist is not the pinned sha256 $XGR_SHA" >&2; return 1; }
    fi
    echo "setup: building xgrammar $XGR_VERSION's C++ core (once; several minutes)"
    t0=$(date +%s)
    work=$(mktemp -d "$XGR_DIR/build.XXXXXX")
    tar xzf "$sdist" -C "$work"
    local src="$work/xgrammar-$XGR_VERSION"
    # A config.cmake in the build folder wins over the sdist's (which turns the Python
    # bindings on).
    mkdir -p "$src/build"
    printf 'set(XGRAMMAR_BUILD_PYTHON_BINDINGS OFF)\nset(XGRAMMAR_BUILD_CXX_TESTS OFF)\n' >"$src/build/config.cmake"
    cmake -S "$src" -B "$src/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_CXX_FLAGS="-fno-lto -Wno-error" -DCMAKE_CXX_FLAGS_RELEASE="-O2 -DNDEBUG" \
        -DCMAKE_INSTALL_PREFIX="$PWD/$work/prefix" >/dev/null &&
        ninja -C "$src/build" xgrammar >/dev/null &&
        cmake --install "$src/build" >/dev/null &&
        cp -r "$src/3rdparty/picojson" "$work/prefix/include/" ||
        { echo "setup: building xgrammar failed (kept in $work)" >&2; return 1; }
    rm -rf "$XGR_PREFIX" && mv "$work/prefix" "$XGR_PREFIX" && rm -rf "$work"
    echo "setup: xgrammar built in $(( $(date +%s) - t0 )) s into $XGR_PREFIX"
}
build_xgrammar || exit 1
[ "${DEPS_ONLY:-0}" = 1 ] && exit 0

BUILD_DIR="${BUILD_DIR:-build}"
WERROR="${WERROR:-false}"
read -r -a extra_args <<< "${MESON_ARGS:-}"
# grammar/ is C++ (xgrammar): with CC=clang (the fuzz build) the C++ side must be clang's
# too, or the sanitizer runtimes of the two compilers meet at link time.
[ "${CC:-}" = clang ] && export CXX="${CXX:-clang++}"
if [ ! -f "$BUILD_DIR/build.ninja" ]; then
    # CC (e.g. CC=clang for the fuzz build) is honoured by meson at setup time.
    meson setup "$BUILD_DIR" --buildtype="${BUILDTYPE:-debugoptimized}" -Dwerror="$WERROR" "${extra_args[@]}" >/dev/null
else
    meson configure "$BUILD_DIR" -Dwerror="$WERROR" >/dev/null
fi
meson compile -C "$BUILD_DIR" >/dev/null
echo "setup: built $BUILD_DIR/ (tessera, tessera-router, tessera-worker)"
