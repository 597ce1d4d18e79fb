#!/usr/bin/env bash
# Fuzz the parsers with libFuzzer (docs/fuzzing.md).
#
#   scripts/fuzz.sh                    every target for $TSR_FUZZ_SECONDS (15) s each, as
#                                      the test command runs them (meson test --suite fuzz)
#   scripts/fuzz.sh TARGET SECONDS [libFuzzer args...]
#                                      one target for as long as asked: a campaign.  TARGET
#                                      is wire, gguf, config_yaml, model_meta, http,
#                                      safetensors, tokenizer or template; extra
#                                      arguments go to libFuzzer (e.g. -jobs=2 -workers=2)
#
# Builds build-fuzz/ with clang, -fsanitize=fuzzer on the targets and ASan+UBSan on the
# whole tree.  Needs Debian's clang and libclang-rt-14-dev (the libFuzzer runtime).
# Inputs a run finds go to build-fuzz/tests/fuzz/work-TARGET/corpus (kept between
# runs), crashes to work-TARGET/artifacts/; the committed seeds in tests/fuzz/corpus/
# are only read.
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD=build-fuzz
TARGETS="wire gguf config_yaml model_meta http safetensors tokenizer template"

for pkg in clang libclang-rt-14-dev; do
        if ! dpkg -s "$pkg" >/dev/null 2>&1; then
                echo "fuzz: the Debian package $pkg is missing (apt-get install clang libclang-rt-14-dev)" >&2
                exit 1
        fi
done

if [ ! -f "$BUILD/build.ninja" ]; then
        CC=clang meson setup "$BUILD" -Dfuzz=true -Db_sanitize=address,undefined -Db_lundef=false \
                -Dcuda=disabled >"$BUILD.setup.log" 2>&1 || {
                cat "$BUILD.setup.log" >&2
                exit 1
        }
        rm -f "$BUILD.setup.log"
fi

if [ $# -eq 0 ]; then
        exec meson test -C "$BUILD" --suite fuzz --print-errorlogs
fi

target=$1
secs=${2:?usage: scripts/fuzz.sh [TARGET SECONDS [libFuzzer args...]]}
shift 2
case " $TARGETS " in
*" $target "*) ;;
*)
        echo "fuzz: unknown target '$target' (one of: $TARGETS)" >&2
        exit 2
        ;;
esac
# Several campaigns may start at once (one per core): one ninja at a time in the folder.
flock "$BUILD/.fuzz-build.lock" ninja -C "$BUILD" "tests/fuzz/fuzz_$target" >/dev/null
TSR_FUZZ_SECONDS=$secs UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 ASAN_OPTIONS=detect_leaks=1 \
        exec tests/fuzz/run_fuzz.sh "$BUILD/tests/fuzz/fuzz_$target" "tests/fuzz/corpus/$target" \
        "tests/fuzz/regressions/$target" "$BUILD/tests/fuzz/work-$target" "$@"
