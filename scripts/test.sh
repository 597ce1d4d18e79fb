#!/usr/bin/env bash
# README command 2: install, build, and run every test suite:
#   unit   cmocka tests of common/, proto framing, worker loaders, router HTTP (build/)
#   asan   the same unit tests built with -fsanitize=address,undefined (build-asan/)
#   gpu    CUDA kernels vs the CPU reference (skipped without a device)
#   fuzz   libFuzzer targets (clang, ASan+UBSan) for TSR_FUZZ_SECONDS (15) each
#   e2e    pytest: real tessera processes on loopback, the official openai SDK
#   e2e-asan  the process-level e2e tests again with the ASan+UBSan binaries
#   valgrind  the router under memcheck over a short e2e pass (scripts/valgrind.sh, ~30 s)
# Ends with one line "N passed, N failed[, N skipped]" summing all suites; exits
# non-zero if anything failed.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"

WERROR=true ./scripts/setup.sh || { echo "0 passed, 1 failed"; exit 1; }
BUILD_DIR=build-asan WERROR=true MESON_ARGS="-Db_sanitize=address,undefined -Db_lundef=false -Dcuda=disabled" \
    ./scripts/setup.sh || { echo "0 passed, 1 failed"; exit 1; }
CC=clang BUILD_DIR=build-fuzz WERROR=false \
    MESON_ARGS="-Dfuzz=true -Db_sanitize=address,undefined -Db_lundef=false -Dcuda=disabled" \
    ./scripts/setup.sh || { echo "0 passed, 1 failed"; exit 1; }
./scripts/fetch-model.sh >/dev/null || echo "test: demo model not fetched; e2e tests that need it will skip"
./scripts/fetch-vocab.sh >/dev/null || echo "test: real vocabularies not fetched; their tokenizer tests will skip"

# Python test tools in a virtual environment, re-installed only when the pins change.
if [ ! -x .venv/bin/python ] || ! cmp -s tests/requirements.txt .venv/requirements.installed; then
    python3 -m venv .venv
    .venv/bin/python -m pip install --quiet --disable-pip-version-check -r tests/requirements.txt
    cp tests/requirements.txt .venv/requirements.installed
fi

RESULTS="$ROOT/build/test-results"
rm -rf "$RESULTS" && mkdir -p "$RESULTS"

echo "== unit + gpu (build/)"
meson test -C build --suite unit --suite gpu --print-errorlogs --num-processes 2 \
    --logbase unit >"$RESULTS/unit.log" 2>&1
tail -n 12 "$RESULTS/unit.log"

echo "== unit under ASan+UBSan (build-asan/)"
# TSR_SANITIZED: the slowest model tests (SmolLM2 greedy decoding) run a shorter
# version under the sanitizers; the full version runs in build/ above.
TSR_SANITIZED=1 ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    meson test -C build-asan --suite unit --print-errorlogs --num-processes 2 \
    --logbase asan >"$RESULTS/asan.log" 2>&1
tail -n 12 "$RESULTS/asan.log"

echo "== fuzz (build-fuzz/, ${TSR_FUZZ_SECONDS:-15} s per target)"
meson test -C build-fuzz --suite fuzz --print-errorlogs --num-processes 2 \
    --logbase fuzz >"$RESULTS/fuzz.log" 2>&1
tail -n 12 "$RESULTS/fuzz.log"

echo "== e2e (pytest)"
TESSERA_BUILD="$ROOT/build" .venv/bin/python -m pytest tests/e2e -q -p no:cacheprovider \
    --junitxml="$RESULTS/e2e.xml" 2>&1 | tee "$RESULTS/e2e.log" | tail -n 25

echo "== e2e under ASan+UBSan (build-asan/: skeleton and wire tests)"
TESSERA_BUILD="$ROOT/build-asan" ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
    UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    .venv/bin/python -m pytest tests/e2e/test_skeleton.py tests/e2e/test_worker_wire.py -q -p no:cacheprovider \
    --junitxml="$RESULTS/e2e-asan.xml" 2>&1 | tee "$RESULTS/e2e-asan.log" | tail -n 5

echo "== valgrind (router under memcheck: scripts/valgrind.sh)"
# One JUnit case for the summary line: failed on any memcheck error or failed request.
vg_case='<testcase classname="valgrind" name="router_memcheck"/>'
if ! ./scripts/valgrind.sh >"$RESULTS/valgrind.log" 2>&1; then
    vg_case='<testcase classname="valgrind" name="router_memcheck"><failure message="see valgrind.log"/></testcase>'
fi
tail -n 6 "$RESULTS/valgrind.log"
echo "<testsuite name=\"valgrind\">$vg_case</testsuite>" >"$RESULTS/valgrind.xml"

.venv/bin/python tests/summarize.py \
    "unit=build/meson-logs/unit.json" \
    "asan=build-asan/meson-logs/asan.json" \
    "fuzz=build-fuzz/meson-logs/fuzz.json" \
    "e2e=$RESULTS/e2e.xml" \
    "e2e-asan=$RESULTS/e2e-asan.xml" \
    "valgrind=$RESULTS/valgrind.xml"
