#!/usr/bin/env bash
# scripts/gpu-check.sh BIN OUT TOKENIZER_DIR - the GPU checks of issue #16, on a machine
# with an NVIDIA GPU, python3 with torch + transformers, and Tessera's binaries in BIN
# (a build tree, or one folder holding them all).  Writes logs and results under OUT;
# prints a summary line per step.  TOKENIZER_DIR: tests/fixtures/make_gpu_model.py
# tokenizer's output (the random model is made here from it).
#
#   1. the GPU suite: every test_cuda_* program (test_cuda_fpmm: the fp8 / NVFP4 matmul), test_comm_nccl (NCCL_DEBUG=INFO),
#      `tessera-doctor --nccl on` (its NCCL half over the GPUs here), test_ops' and test_mamba's CUDA columns, and
#      test_cuda_forward (tiny fixture vs transformers) again with TSR_GPU_MODEL set to
#      a random SmolLM2-shaped model (CUDA vs the CPU backend);
#   2. compute-sanitizer memcheck of test_cuda_forward on the tiny fixture;
#   3. tessera-bench-engine --kernels cuda on the random model (decode batches, prefill),
#      eager then with --graphs (each decode batch through a CUDA graph);
#   4. tessera serve --device cuda of the random model: a chat completion through the
#      router, then tessera bench serve (random 1k/1k, --ignore-eos) at concurrency 1,
#      32 and 256 (GPU_CHECK_QUICK=1: fewer prompts); then the same server flags with
#      GPU_CHECK_EAGER_TOO=1 once more with --enforce-eager (graphs vs eager, same call).
# Each step has its own time limit; a failed step is reported and the next one runs.
# Knobs (environment): GPU_CHECK_LOGPROBS=1 adds a c=256 run with 5 logprobs a token;
# GPU_CHECK_SKIP_SUITE=1 skips the tiny-fixture suite and memcheck
# (step 1's first half, step 2); GPU_CHECK_DEVICE (cuda) is what step 4 serves on;
# GPU_CHECK_LEN (1024) the random input and output lengths; GPU_CHECK_MODEL_DIR a
# model folder to use (made when it has no config.json); GPU_CHECK_EAGER_TOO=1 serves a
# second time with --enforce-eager (CUDA graphs against none, in the same call);
# GPU_CHECK_MAX_MODEL_LEN (4096) the servers' --max-model-len; GPU_CHECK_FP8=1 serves and
# benchmarks the model once more as a ModelOpt FP8 checkpoint (made here from the same seed);
# GPU_CHECK_LLAMA4=1 serves and benchmarks the Llama 4 bench model (Scout's structure at 768
# wide, tiny-hf's 300-token vocabulary, written as a BF16 checkpoint by
# tests/fixtures/make_bench_models.py): Llama 4's
# device path (tsr_llama4_to_backend).  GPU_CHECK_NEMOTRON_H=1 the same for the NemotronH
# bench model (Nano's structure at 768 wide: tsr_nemotron_h_to_backend, the Mamba mixer's
# CUDA kernels).
set -u
BIN=${1:?usage: gpu-check.sh BIN OUT TOKENIZER_DIR}
OUT=${2:?usage: gpu-check.sh BIN OUT TOKENIZER_DIR}
TOK=${3:?usage: gpu-check.sh BIN OUT TOKENIZER_DIR}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export TSR_SOURCE_ROOT=$ROOT
mkdir -p "$OUT"
MODEL=${GPU_CHECK_MODEL_DIR:-/tmp/tessera-gpu-model}
PORT=${GPU_CHECK_PORT:-18700}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
LEN=${GPU_CHECK_LEN:-1024}
SUITE=$([ -n "${GPU_CHECK_SKIP_SUITE:-}" ] && echo no || echo yes)

bin() {         # the path of program $1 under BIN (flat or a build tree)
        local p
        for p in "$BIN/$1" "$BIN"/*/"$1" "$BIN"/tests/*/"$1"; do
                [ -x "$p" ] && { echo "$p"; return 0; }
        done
        echo "gpu-check: $1 not found under $BIN" >&2
        return 1
}

step() {        # step NAME SECONDS CMD...: run with a limit, log to OUT/NAME.log
        local name=$1 limit=$2 rc t0=$SECONDS
        shift 2
        timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
        rc=$?
        echo "gpu-check: $name: exit $rc ($((SECONDS - t0)) s)"
        return $rc
}

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"

# 1. the GPU suite
if [ $SUITE = yes ]; then
        for t in test_cuda_rmsnorm test_cuda_add_rmsnorm test_cuda_layer test_cuda_fpmm test_cuda_forward; do
                p=$(bin $t) && step "$t" 300 "$p"
        done
        # the NCCL comm backend's first real run (groups up to the GPUs present)
        p=$(bin test_comm_nccl) && NCCL_DEBUG=${NCCL_DEBUG:-INFO} step test_comm_nccl 240 "$p"
        grep -E "^group|never comes|^OK|^FAIL|NCCL version" "$OUT/test_comm_nccl.log" | head -12
        # tessera doctor's NCCL half (every GPU here one rank; --nccl on: even with one GPU)
        p=$(bin tessera-doctor) && step doctor_nccl 120 "$p" --nccl on --json "$OUT/doctor.json"
        grep -E "^nccl|^doctor|^warning" "$OUT/doctor_nccl.log" | head -12
        p=$(bin test_ops) && step test_ops 300 "$p"
        grep -E "cuda|FAIL|PASSED|SKIPPED" "$OUT/test_ops.log" | tail -5
        # NemotronH's ops on the device: the Mamba mixer against the float64 oracle, relu_sq
        # and round_bf16 bitwise their definitions (test_mamba's CUDA case)
        p=$(bin test_mamba) && step test_mamba 120 "$p"
        grep -E "cuda|FAIL|PASSED|SKIPPED|ERROR" "$OUT/test_mamba.log" | tail -9
        grep -E "max \||FAIL|OK \(" "$OUT/test_cuda_forward.log"
        grep -E "fpmm on cuda|FAIL|OK \(" "$OUT/test_cuda_fpmm.log" | head -8
fi
[ -f "$MODEL/config.json" ] ||
        step make_model 300 python3 "$ROOT/tests/fixtures/make_gpu_model.py" model "$TOK" "$MODEL" --shape smollm2
cat "$OUT/make_model.log" 2>/dev/null | tail -2
p=$(bin test_cuda_forward) && TSR_GPU_MODEL=$MODEL step test_cuda_forward_big 300 "$p"
grep -E "max \||FAIL|OK \(" "$OUT/test_cuda_forward_big.log" 2>/dev/null

# 2. memcheck (the tiny fixture only: the sanitizer slows every access)
if [ $SUITE = yes ] && command -v compute-sanitizer > /dev/null; then
        p=$(bin test_cuda_forward) && step memcheck 240 compute-sanitizer --tool memcheck --error-exitcode 3 "$p"
        grep -E "ERROR SUMMARY|Invalid" "$OUT/memcheck.log" | head -5
fi

# 3. the engine in-process
[ "$DEVICE" = cuda ] && p=$(bin tessera-bench-engine) && step bench_engine 240 "$p" "$MODEL" --kernels cuda --dtypes bfloat16,float32 \
        --batches 1,8,32,64,256 --steps 32 --prefill 1024 --repeat 2 --no-bandwidth
cat "$OUT/bench_engine.log" 2>/dev/null
[ "$DEVICE" = cuda ] && p=$(bin tessera-bench-engine) && step bench_engine_graphs 240 "$p" "$MODEL" --kernels cuda \
        --dtypes bfloat16 --batches 1,8,32,64,256 --steps 32 --prefill 1024 --repeat 2 --no-bandwidth --graphs
cat "$OUT/bench_engine_graphs.log" 2>/dev/null

# 4. served over HTTP: with the default flags (CUDA graphs on CUDA), then with
# GPU_CHECK_EAGER_TOO=1 the same with --enforce-eager (an A/B in one call)
p=$(bin tessera) || exit 1
B=$(bin tessera-bench)
n1=8 n32=128 n256=512
[ -n "${GPU_CHECK_QUICK:-}" ] && n1=4 n32=64 n256=256
serve_and_bench() {     # serve_and_bench LABEL EXTRA-FLAGS...
        local label=$1
        shift
        "$p" serve "$SERVE_MODEL" --device "$DEVICE" --host 127.0.0.1 --port "$PORT" --served-model-name smollm2-random \
                --max-model-len "${GPU_CHECK_MAX_MODEL_LEN:-4096}" "$@" > "$OUT/serve$label.log" 2>&1 &
        SERVE=$!
        for _ in $(seq 1 240); do
                env -u LD_LIBRARY_PATH curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
                sleep 0.5
        done
        grep -E "device|kernels|KV cache|Available|loaded|CUDA graphs|Graph capturing" "$OUT/serve$label.log" | head -14
        env -u LD_LIBRARY_PATH curl -s "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' \
                -d '{"model": "smollm2-random", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16,
                     "temperature": 0}' | tee "$OUT/chat$label.json"
        echo
        for c in 1 32 256; do
                n=$([ $c = 1 ] && echo $n1 || ([ $c = 32 ] && echo $n32 || echo $n256))
                step "bench_serve$label""_c$c" 240 "$B" serve --base-url "http://127.0.0.1:$PORT" --model smollm2-random \
                        --tokenizer "$SERVE_MODEL" --dataset-name random --random-input-len "$LEN" --random-output-len "$LEN" \
                        --ignore-eos --num-prompts "$n" --max-concurrency "$c" --temperature 0 --save-result \
                        --result-dir "$OUT" --result-filename "bench$label""_c$c.json"
                grep -E "Successful|throughput|TTFT|TPOT|ITL" "$OUT/bench_serve$label""_c$c.log" | head -12
        done
        # GPU_CHECK_LOGPROBS=1: c=256 again with 5 logprobs a token, answered on the device
        # (worker/model/answer.c: 172 bytes a row back instead of the row)
        if [ -n "${GPU_CHECK_LOGPROBS:-}" ]; then
                step "bench_serve$label""_lp_c256" 240 "$B" serve --base-url "http://127.0.0.1:$PORT" \
                        --model smollm2-random --tokenizer "$SERVE_MODEL" --dataset-name random --random-input-len "$LEN" \
                        --random-output-len "$LEN" --ignore-eos --num-prompts "$n256" --max-concurrency 256 \
                        --temperature 0 --logprobs 5 --save-result --result-dir "$OUT" \
                        --result-filename "bench$label""_lp_c256.json"
                grep -E "Successful|throughput|TTFT|TPOT|ITL" "$OUT/bench_serve$label""_lp_c256.log" | head -12
        fi
        kill -TERM $SERVE
        wait $SERVE
        echo "gpu-check: serve$label exit $?"
        grep -E "CUDA graphs:|logits rows answered on the device" "$OUT/serve$label.log"
}
SERVE_MODEL=$MODEL
serve_and_bench ""
if [ -n "${GPU_CHECK_EAGER_TOO:-}" ] && [ "$DEVICE" = cuda ]; then
        serve_and_bench _eager --enforce-eager
fi
# GPU_CHECK_FP8=1: the same random model exported as a ModelOpt FP8 checkpoint, served the
# same way (fp8 linears through kernels/cuda/fpmm.cu: cuBLASLt's FP8 GEMM where it applies)
if [ -n "${GPU_CHECK_FP8:-}" ]; then
        [ -f "$MODEL-fp8/config.json" ] || step make_model_fp8 300 python3 "$ROOT/tests/fixtures/make_gpu_model.py" \
                model "$TOK" "$MODEL-fp8" --shape smollm2 --modelopt fp8
        tail -1 "$OUT/make_model_fp8.log" 2>/dev/null
        SERVE_MODEL=$MODEL-fp8
        serve_and_bench _fp8
fi
# GPU_CHECK_LLAMA4=1: Llama 4 on the device (issue #16: bitwise the CPU on cpu-devlike in the
# unit suite, its first GPU run here), served and benchmarked the same way
if [ -n "${GPU_CHECK_LLAMA4:-}" ] && [ "$DEVICE" = cuda ]; then
        [ -f "$MODEL-llama4/config.json" ] || step make_model_llama4 300 python3 "$ROOT/tests/fixtures/make_bench_models.py" \
                llama4 "$MODEL-llama4" --dtype bfloat16 --vocab 300     # its tokenizer's: served ids decode
        tail -1 "$OUT/make_model_llama4.log" 2>/dev/null
        SERVE_MODEL=$MODEL-llama4
        serve_and_bench _llama4
fi
# GPU_CHECK_NEMOTRON_H=1: NemotronH on the device (bitwise the CPU on cpu-devlike in the unit
# suite; the GPU suite's cuda_forward section 8 and the mamba test's CUDA case), served
if [ -n "${GPU_CHECK_NEMOTRON_H:-}" ] && [ "$DEVICE" = cuda ]; then
        [ -f "$MODEL-nemotron_h/config.json" ] || step make_model_nemotron_h 300 python3 \
                "$ROOT/tests/fixtures/make_bench_models.py" nemotron_h "$MODEL-nemotron_h" --dtype bfloat16 --vocab 300
        tail -1 "$OUT/make_model_nemotron_h.log" 2>/dev/null
        SERVE_MODEL=$MODEL-nemotron_h
        serve_and_bench _nemotron_h
fi
