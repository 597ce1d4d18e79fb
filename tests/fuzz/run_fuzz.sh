#!/usr/bin/env bash
# run_fuzz.sh BINARY SEED_CORPUS REGRESSIONS WORK_DIR [libFuzzer args...]
#
# One fuzz target, bounded in time, as the meson test in suite 'fuzz' runs it
# (tests/fuzz/meson.build) and as scripts/fuzz.sh runs it for long campaigns:
#   1. replay every file in REGRESSIONS (inputs that once broke something; each must
#      now pass), so a fixed bug stays fixed;
#   2. fuzz for $TSR_FUZZ_SECONDS (default 15) seconds.  WORK_DIR/corpus comes first on
#      the command line, so libFuzzer writes the inputs it finds there and only reads
#      SEED_CORPUS: the committed seeds are never written to, and the work corpus grows
#      from one run to the next.  Crash, leak and timeout inputs land in WORK_DIR.
# Prints libFuzzer's final stats and one summary line; exits non-zero on any finding.
set -uo pipefail

if [ $# -lt 4 ]; then
        echo "usage: $0 BINARY SEED_CORPUS REGRESSIONS WORK_DIR [libFuzzer args...]" >&2
        exit 2
fi
bin=$1 seeds=$2 regress=$3 work=$4
shift 4
secs=${TSR_FUZZ_SECONDS:-15}
name=$(basename "$bin")

mkdir -p "$work/corpus" "$work/artifacts"
log="$work/last-run.log"

if [ -d "$regress" ] && [ -n "$(ls -A "$regress" 2>/dev/null)" ]; then
        # libFuzzer runs each file given by name once and exits non-zero on the first
        # that fails; -runs=1 keeps it from fuzzing afterwards.
        if ! "$bin" -runs=1 -timeout=10 -rss_limit_mb=2048 "$regress"/* >"$work/regressions.log" 2>&1; then
                tail -n 60 "$work/regressions.log"
                echo "$name: a regression input fails again (see $work/regressions.log)"
                exit 1
        fi
        echo "$name: $(ls -A "$regress" | wc -l) regression inputs pass"
fi

stamp="$work/run-started"
touch "$stamp"
# libFuzzer stops itself at -max_total_time; the outer timeout only catches a hang in
# libFuzzer itself (e.g. a merge of a huge work corpus), so it is generous.
timeout --kill-after=10 $((secs + 300)) "$bin" \
        -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
        -artifact_prefix="$work/artifacts/" "$@" "$work/corpus" "$seeds" >"$log" 2>&1
rc=$?

# The stats block libFuzzer prints at exit, and its last status line.
grep -E '^stat::' "$log"
status=$(grep -E '^#[0-9]+' "$log" | tail -n 1)
runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
new=$(find "$work/artifacts" -type f -newer "$stamp")
# A time-out that its input does not repeat was the machine (a stalled VM, a loaded
# core), not the input: a harness's cost for one input is the same on every run, so a
# real one repeats.  Each time-out input is replayed alone three times with half the
# limit; only when all of them run through is the run passed, and it says so.
if [ $rc -ne 0 ] && [ -n "$new" ] && ! grep -qv '/timeout-[^/]*$' <<<"$new"; then
        repeated=
        for f in $new; do
                for k in 1 2 3; do
                        timeout 60 "$bin" -runs=1 -timeout=5 -rss_limit_mb=2048 "$f" >"$work/replay.log" 2>&1 ||
                                repeated="$repeated $(basename "$f")"
                done
        done
        if [ -z "$repeated" ]; then
                tail -n 20 "$log"
                for f in $new; do
                        echo "input (base64) $(basename "$f"): $(base64 -w0 "$f" | head -c 2800)"
                done
                echo "$name: a time-out that did not repeat: its input ran through 3 times alone in under 5 s" \
                        "(the machine stalled); ${runs:-?} runs in ${secs} s"
                exit 0
        fi
fi
if [ $rc -ne 0 ]; then
        tail -n 80 "$log"
        # A CI run keeps only its summary: the input itself, when small, so that it can be
        # replayed (base64 -d) and committed under REGRESSIONS without the machine.
        for f in $new; do
                [ "$(stat -c %s "$f")" -le 2048 ] && echo "input (base64) $(basename "$f"): $(base64 -w0 "$f")"
        done
        echo "$name: FINDING (exit $rc) after ${runs:-?} runs; input saved under $work/artifacts/, log $log"
        exit 1
fi
echo "$name: ${runs:-?} runs in ${secs} s, no finding; last: ${status:-none}"
