#!/usr/bin/env bash
# Run the router under valgrind (memcheck) over a short e2e pass and fail on any invalid
# access or definite leak (docs/testing.md "valgrind").
#
#   scripts/valgrind.sh            uses build/ and the demo model (scripts/fetch-model.sh)
#   TESSERA_BUILD=DIR MODEL=FILE scripts/valgrind.sh
#
# The worker is the normal build (memcheck would make the model ~50x slower and the
# worker has its ASan e2e pass); the router is the one under test.  The pass: /health,
# /v1/models, /metrics, three completions, a chat completion, a stream, a client that
# disconnects mid-stream, bad JSON, a bad value, an unknown path, malformed HTTP, a
# tokenize, then SIGTERM: the router must exit 0 with no memcheck error.
# Exit status: 0 clean, 1 a memcheck error or a failed request, 2 setup trouble.
set -uo pipefail
cd "$(dirname "$0")/.."

BUILD=${TESSERA_BUILD:-build}
MODEL=${MODEL:-.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf}
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
LOG_DIR=$(mktemp -d /tmp/tessera-valgrind.XXXXXX)
VG_LOG="$LOG_DIR/router.valgrind.log"
# OpenSSL 3 loads its config once per process (EVP_MD_fetch -> OPENSSL_init_crypto ->
# CONF_modules_load_file_ex) and keeps a block valgrind calls definitely lost; it does
# not grow.  Everything else counts.
SUPP="$LOG_DIR/tessera.supp"
cat >"$SUPP" <<'SUPPEOF'
{
   openssl3-config-load-once
   Memcheck:Leak
   match-leak-kinds: definite
   fun:malloc
   ...
   fun:CONF_modules_load_file_ex
}
SUPPEOF

for f in "$BUILD/router/tessera-router" "$BUILD/worker/tessera-worker" "$MODEL"; do
        [ -e "$f" ] || { echo "valgrind.sh: $f is missing (build, scripts/fetch-model.sh)" >&2; exit 2; }
done
command -v valgrind >/dev/null || { echo "valgrind.sh: valgrind is not installed (apt-get install valgrind)" >&2; exit 2; }

# Below the ephemeral range (scripts/free_port.py): the router connects before the
# worker binds, and its connection's source port must not be the worker's.
read -r WPORT HPORT < <("$PY" -c 'import sys; sys.path.insert(0, sys.argv[1]); from free_port import free_port; print(free_port(2), free_port())' scripts)
worker_pid= router_pid=
cleanup() {
        [ -n "$router_pid" ] && kill -KILL "$router_pid" 2>/dev/null
        [ -n "$worker_pid" ] && kill -TERM "$worker_pid" 2>/dev/null
        wait 2>/dev/null
}
trap cleanup EXIT

# The worker binds WPORT and WPORT+1 (its Status socket).  A 1 s Status interval: the
# router declares a worker down after 3 missed intervals, and memcheck plus a loaded
# machine can stall it past the default 3 x 100 ms.
"$BUILD/worker/tessera-worker" "$MODEL" --listen "tcp://127.0.0.1:$WPORT" --status-interval-ms 1000 >"$LOG_DIR/worker.log" 2>&1 &
worker_pid=$!
valgrind --tool=memcheck --leak-check=full --show-leak-kinds=definite --errors-for-leak-kinds=definite \
        --error-exitcode=99 --track-origins=yes --num-callers=30 --suppressions="$SUPP" --log-file="$VG_LOG" \
        "$BUILD/router/tessera-router" --host 127.0.0.1 --port "$HPORT" --worker "tcp://127.0.0.1:$WPORT" \
        >"$LOG_DIR/router.log" 2>&1 &
router_pid=$!

"$PY" - "$HPORT" <<'PYEOF'
import json, socket, sys, time, urllib.request, urllib.error

base = f"http://127.0.0.1:{sys.argv[1]}"

def call(path, body=None, want=200, raw=False):
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            status, text = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read()
    if status != want:
        sys.exit(f"valgrind.sh: {path} -> {status}, wanted {want}: {text[:300]!r}")
    return text

deadline = time.monotonic() + 180
while True:   # memcheck starts slowly; the worker loads the model
    try:
        call("/v1/completions", {"prompt": "Hi", "max_tokens": 1})
        break
    except (urllib.error.URLError, ConnectionError, SystemExit):
        if time.monotonic() > deadline:
            sys.exit("valgrind.sh: the router never answered a completion")
        time.sleep(0.5)
call("/health")
call("/v1/models")
call("/metrics")
for p in ("The capital of France is", "1, 2, 3,", "Hello"):
    call("/v1/completions", {"prompt": p, "max_tokens": 4, "temperature": 0})
call("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
out = call("/v1/completions", {"prompt": "Once upon", "max_tokens": 4, "stream": True,
                               "stream_options": {"include_usage": True}})
assert out.rstrip().endswith(b"data: [DONE]"), out[-200:]
call("/v1/completions", b'{"prompt": ', want=400)
call("/v1/completions", {"prompt": "x", "temperature": -1}, want=400)
call("/v1/nope", {"x": 1}, want=404)
call("/tokenize", {"prompt": "Hello world"})
# A client that goes away mid-stream, and malformed HTTP on a raw socket.
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
body = json.dumps({"prompt": "Tell me", "max_tokens": 64, "stream": True, "ignore_eos": True}).encode()
s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: h\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
          % len(body) + body)
s.recv(100)
s.close()
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
s.sendall(b"POST /x HTTP/1.1\r\nContent-Length: zz\r\n\r\n")
assert s.recv(100).startswith(b"HTTP/1.1 400")
s.close()
call("/v1/completions", {"prompt": "after", "max_tokens": 2})
print("valgrind.sh: e2e pass done")
PYEOF
pass_rc=$?

kill -TERM "$router_pid" 2>/dev/null
rc=0
wait "$router_pid" || rc=$?
router_pid=
echo "valgrind.sh: router exit status $rc (99 = memcheck error); log $VG_LOG"
grep -E "ERROR SUMMARY|definitely lost|indirectly lost|Invalid (read|write|free)" "$VG_LOG" | sed 's/^==[0-9]*== //'
if [ "$pass_rc" -ne 0 ] || [ "$rc" -ne 0 ] || grep -qE "Invalid (read|write|free)|definitely lost: [1-9]" "$VG_LOG"; then
        echo "valgrind.sh: FAILED" >&2
        exit 1
fi
echo "valgrind.sh: clean"
