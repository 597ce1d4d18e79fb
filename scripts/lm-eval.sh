#!/usr/bin/env bash
# Run EleutherAI's lm-evaluation-harness (PyPI lm-eval, unchanged) against Tessera and,
# as the reference, against transformers on the same GGUF weights; then compare the two
# sample by sample.  docs/accuracy.md has the results and what they mean.
#
#   scripts/lm-eval.sh tessera   # starts `tessera serve` on a free port, runs lm-eval's
#                                # local-completions model against it, stops the server
#   scripts/lm-eval.sh chat      # same, lm-eval's local-chat-completions with
#                                # --apply_chat_template (generation tasks only)
#   scripts/lm-eval.sh hf        # lm-eval's hf model: transformers, float32, CPU
#   scripts/lm-eval.sh compare   # tests/lm_eval/compare.py on the tessera and hf outputs
#
# Environment (defaults in brackets):
#   MODEL      GGUF file [.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf]
#   TASKS      lm-eval tasks [gsm8k_local,gsm8k_mc_local,gsm8k_ppl_local], defined in
#              tests/lm_eval/ over ../shared/fixtures/gsm8k/test.jsonl
#   LIMIT      documents per task [10]
#   CONCURRENT requests in flight (lm-eval num_concurrent) [8]
#   OUT        where results and samples go [/tmp/tessera-lm-eval]
#   VENV       the Python environment, created when missing [/tmp/lmeval-venv]
#   BUILD      Tessera build folder [build]
# Extra arguments go to lm_eval, e.g. scripts/lm-eval.sh tessera --num_fewshot 0.
#
# Nothing is downloaded at run time except the PyPI packages when VENV is created: the
# data set is the fixture file and the tokenizer is written from the GGUF by
# transformers (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE are set).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"

MODE="${1:-}"
[ $# -gt 0 ] && shift
MODEL="$(realpath "${MODEL:-.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf}")"
TASKS="${TASKS:-gsm8k_local,gsm8k_mc_local,gsm8k_ppl_local}"
LIMIT="${LIMIT:-10}"
CONCURRENT="${CONCURRENT:-8}"
OUT="${OUT:-/tmp/tessera-lm-eval}"
VENV="${VENV:-/tmp/lmeval-venv}"
BUILD="${BUILD:-build}"
SERVED_NAME="$(basename "$MODEL" .gguf)"
LM_EVAL_VERSION=0.4.13

export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

usage() {
        sed -n '2,26p' "$0" | sed 's/^# \{0,1\}//'
        exit 2
}

if [ ! -f ../shared/fixtures/gsm8k/test.jsonl ] && [ "$MODE" != compare ]; then
        echo "lm-eval.sh: ../shared/fixtures/gsm8k/test.jsonl is missing (the tasks read it)" >&2
        exit 1
fi

# The hf mode needs torch as well (lm-eval's [hf] extra); the server modes only need the
# API client and a tokenizer.
ensure_venv() {
        local extras="api"
        [ "$1" = hf ] && extras="api,hf"
        if [ ! -x "$VENV/bin/lm_eval" ]; then
                python3 -m venv "$VENV"
                "$VENV/bin/pip" install -q "lm-eval[$extras]==$LM_EVAL_VERSION" transformers gguf
        elif [ "$1" = hf ] && ! "$VENV/bin/python" -c 'import torch, accelerate' 2>/dev/null; then
                "$VENV/bin/pip" install -q "lm-eval[$extras]==$LM_EVAL_VERSION"
        fi
}

# lm-eval's huggingface tokenizer backend loads a tokenizer folder by name; write one
# from the GGUF's own vocabulary so that both backends tokenize requests identically.
TOKENIZER="$OUT/tokenizer-$SERVED_NAME"
ensure_tokenizer() {
        [ -f "$TOKENIZER/tokenizer.json" ] && return
        mkdir -p "$OUT"
        "$VENV/bin/python" - "$MODEL" "$TOKENIZER" <<'EOF'
import os, sys
from transformers import AutoTokenizer
gguf, out = sys.argv[1], sys.argv[2]
AutoTokenizer.from_pretrained(os.path.dirname(gguf),
                              gguf_file=os.path.basename(gguf)).save_pretrained(out)
EOF
}

SERVER_PID=""
stop_server() {
        if [ -n "$SERVER_PID" ]; then
                kill -TERM "$SERVER_PID" 2>/dev/null || true
                wait "$SERVER_PID" 2>/dev/null || true
                SERVER_PID=""
        fi
}
trap stop_server EXIT

start_server() {
        PORT="$("$VENV/bin/python" scripts/free_port.py)"
        mkdir -p "$OUT"
        # --status-interval-ms 1000: the router declares a worker down after 3 missed
        # Status intervals, and on a loaded machine the default 300 ms window is missed
        # by a router that was merely descheduled (docs/accuracy.md, "Problems found"),
        # failing every request in flight.
        "$BUILD/deploy/tessera" serve "$MODEL" --served-model-name "$SERVED_NAME" \
                --host 127.0.0.1 --port "$PORT" --status-interval-ms 1000 > "$OUT/serve.log" 2>&1 &
        SERVER_PID=$!
        for _ in $(seq 300); do
                if curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; then
                        return
                fi
                if ! kill -0 "$SERVER_PID" 2>/dev/null; then
                        echo "lm-eval.sh: tessera serve exited; see $OUT/serve.log" >&2
                        exit 1
                fi
                sleep 1
        done
        echo "lm-eval.sh: tessera serve not healthy after 300 s; see $OUT/serve.log" >&2
        exit 1
}

run_lm_eval() {
        local name="$1"
        shift
        echo "lm-eval.sh: $name: lm_eval $*" >&2
        /usr/bin/env time -f "lm-eval.sh: $name: wall %e s" \
                "$VENV/bin/lm_eval" "$@" --include_path "$REPO/tests/lm_eval" \
                --limit "$LIMIT" --log_samples --output_path "$OUT/$name"
}

case "$MODE" in
tessera)
        ensure_venv server
        ensure_tokenizer
        start_server
        run_lm_eval tessera --model local-completions --tasks "$TASKS" \
                --model_args "model=$SERVED_NAME,base_url=http://127.0.0.1:$PORT/v1/completions,tokenizer_backend=huggingface,tokenizer=$TOKENIZER,num_concurrent=$CONCURRENT,max_length=2048,timeout=1200" \
                "$@"
        ;;
chat)
        ensure_venv server
        start_server
        # Chat completions give no prompt log-probabilities, so lm-eval runs only
        # generation tasks this way.
        run_lm_eval chat --model local-chat-completions --tasks "${CHAT_TASKS:-gsm8k_local}" \
                --apply_chat_template \
                --model_args "model=$SERVED_NAME,base_url=http://127.0.0.1:$PORT/v1/chat/completions,num_concurrent=$CONCURRENT,timeout=1200" \
                "$@"
        ;;
hf)
        ensure_venv hf
        ensure_tokenizer
        # One torch thread and batch size 1: padding-free, like one request at a time,
        # and light on a shared machine.
        OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" run_lm_eval hf --model hf --tasks "$TASKS" \
                --batch_size 1 \
                --model_args "pretrained=$(dirname "$MODEL"),gguf_file=$(basename "$MODEL"),tokenizer=$TOKENIZER,dtype=float32,max_length=2048" --device cpu \
                "$@"
        ;;
compare)
        ensure_venv server
        "$VENV/bin/python" tests/lm_eval/compare.py "$OUT/tessera" "$OUT/hf" "$@"
        ;;
*)
        usage
        ;;
esac
