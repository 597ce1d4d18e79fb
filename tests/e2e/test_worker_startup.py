"""The worker's start-up as an operator sees it: the loading progress, the KV capacity
lines (vLLM's wording), the scheduler defaults, and a KV budget too small for one block.

The defaults checked here are vLLM's for the CPU backend as Tessera documents them
(docs/configuration.md): --block-size 16, --max-num-seqs 256, --max-num-batched-tokens
2048, --kv-cache-memory 4 GiB capped by half the free RAM, prefix caching on, async
scheduling off."""
import json
import re
import signal
import struct
from pathlib import Path

import pytest

from conftest import LAUNCHER, ROUTER, SANITIZED, WORKER, free_port, free_port_pair, gpu_present, wait_until

KV_DEFAULT_BYTES = 4 << 30
START_S = 240 if SANITIZED else 60


def mem_free_bytes():
    """MemFree of /proc/meminfo: what sysconf(_SC_AVPHYS_PAGES) counts."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemFree:"):
                return int(line.split()[1]) * 1024
    return 0


def test_startup_lines_and_defaults(spawn, demo_model):
    free_bytes_before = mem_free_bytes()
    w = spawn([WORKER, demo_model, "--listen", f"tcp://127.0.0.1:{free_port_pair()}"])
    wait_until(lambda: "engine up" in w.output() or w.p.poll() is not None, START_S, what="engine up")
    out = w.output()
    assert "engine up" in out, out
    if not gpu_present():       # --device auto says why it took the CPU
        assert re.search(r"device: cpu \(--device auto: (no CUDA device|this build has no CUDA backend)\)", out), out

    # Progress while loading: tensors and bytes so far, percent and rate; the last at 100%.
    progress = re.findall(r"loading weights: (\d+)/(\d+) tensors, ([\d.]+)/([\d.]+) MB \((\d+)%\), ([\d.]+) MB/s",
                          out)
    assert progress, out
    done, total, mb, total_mb, pct, rate = progress[-1]
    assert done == total and mb == total_mb and pct == "100" and float(rate) > 0, progress[-1]
    assert [int(p[0]) for p in progress] == sorted(int(p[0]) for p in progress)
    loaded = re.search(r"loaded (\d+) tensors \(([\d.]+) MB in the file, [\d.]+ MB as float32, ([\d.]+) MB resident\) "
                       r"in [\d.]+ s, ([\d.]+) MB/s", out)
    assert loaded and loaded.group(1) == total and loaded.group(2) == total_mb and float(loaded.group(4)) > 0, out
    # --dtype auto keeps the GGUF blocks (Q4_1, Q8_0) as they are: resident = the file's tensor bytes.
    assert loaded.group(3) == total_mb, out

    # Capacity: our line and vLLM V1's, consistent with each other and with the default budget.
    blocks = re.search(r"# KV blocks: (\d+) \(block size 16, ([\d.]+)x concurrency at max_model_len (\d+)\)", out)
    assert blocks, out
    n_blocks, max_model_len = int(blocks.group(1)), int(blocks.group(3))
    vllm_line = re.search(r"CPU KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) tokens per "
                          r"request: ([\d.]+)x", out)
    assert vllm_line, out
    assert int(vllm_line.group(1).replace(",", "")) == n_blocks * 16
    assert vllm_line.group(2) == f"{max_model_len:,}" and max_model_len == 8192    # SmolLM2's context
    assert vllm_line.group(3) == f"{n_blocks * 16 / max_model_len:.2f}" == blocks.group(2)
    # --dtype auto: bfloat16 where the CPU has AVX512_BF16 or AMX-BF16, else float32.
    kernels = re.search(r"kernels: cpu-fast, isa (\w+), \d+ threads?, dtype (\w+) \(--dtype auto\)", out)
    assert kernels, out
    isa, dtype = kernels.groups()
    assert dtype == ("bfloat16" if isa in ("avx512_bf16", "amx_bf16") else "float32"), kernels.group(0)
    with open("/proc/cpuinfo") as f:
        flags = f.read()
    assert (isa in ("avx512_bf16", "amx_bf16")) == (" avx512_bf16" in flags or " amx_bf16" in flags), isa
    # --kv-cache-dtype auto is the model's dtype, as vLLM.  SmolLM2: 30 layers x 3 KV heads x
    # 64 x (K and V) x 16 tokens x 4 bytes (float32) = 737,280 bytes a block, 368,640 in bfloat16.
    kv = re.search(r"KV cache dtype (\w+) \(--kv-cache-dtype auto\): (\d+) bytes per block", out)
    assert kv and kv.group(1) == {"bfloat16": "bf16", "float32": "f32"}[dtype], out
    block_bytes = 737280 if dtype == "float32" else 368640
    assert int(kv.group(2)) == block_bytes, kv.group(0)
    # 4 GiB unless half the free RAM (read after loading) is less: then fewer blocks.
    if free_bytes_before / 2 > KV_DEFAULT_BYTES + (1 << 30):   # a margin for what loading takes
        assert n_blocks == KV_DEFAULT_BYTES // block_bytes, n_blocks
    else:
        assert 0 < n_blocks <= KV_DEFAULT_BYTES // block_bytes, n_blocks

    up = re.search(r"engine up: (\d+) KV blocks of (\d+) tokens, max_model_len (\d+), max_num_seqs (\d+), "
                   r"max_num_batched_tokens (\d+), prefix caching (\w+), async scheduling (\w+)", out)
    assert up, out
    assert up.groups() == (str(n_blocks), "16", str(max_model_len), "256", "2048", "on", "off"), up.groups()

    w.p.send_signal(signal.SIGTERM)
    assert w.wait(timeout=60) == 0


def test_kv_budget_below_one_block_exits_before_binding(spawn, demo_model):
    """vLLM refuses to start when no cache block fits ("No available memory for the
    cache blocks"); so does the worker, naming the flag, before any socket is bound."""
    w = spawn([WORKER, demo_model, "--listen", f"tcp://127.0.0.1:{free_port_pair()}",
               "--kv-cache-memory", "100000"])
    assert w.wait(timeout=START_S) == 2
    out = w.output()
    assert "no available memory for the cache blocks" in out and "--kv-cache-memory" in out, out
    # The KV dtype of --kv-cache-dtype auto is the model's: bfloat16 on a CPU with bf16
    # dot products (test_startup_lines_and_defaults checks that rule), else float32.
    with open("/proc/cpuinfo") as f:
        flags = f.read()
    bf16 = " avx512_bf16" in flags or " amx_bf16" in flags
    want = "368640 bytes (KV cache dtype bf16)" if bf16 else "737280 bytes (KV cache dtype f32)"
    assert want in out and "listening on" not in out, out
    # With --dtype float32, auto is float32 on any CPU.
    w = spawn([WORKER, demo_model, "--listen", f"tcp://127.0.0.1:{free_port_pair()}",
               "--kv-cache-memory", "100000", "--dtype", "float32"])
    assert w.wait(timeout=START_S) == 2
    assert "737280 bytes (KV cache dtype f32)" in w.output(), w.output()


# Values vLLM has but Tessera cannot honour yet (docs/configuration.md, "Flag status"):
# the process exits 2 at once with one line naming the flag, the value and what works,
# before the model is loaded or a socket bound.  `tessera serve` refuses before starting
# a child, and the router refuses them too (one YAML file serves every process).
REFUSED = [
    (["--kv-cache-dtype", "fp8_inc"],
     "argument --kv-cache-dtype: 'fp8_inc' is not supported yet: the KV cache is float32, bfloat16, fp8 e4m3 or "
     "fp8 e5m2 (supported: auto, bfloat16, fp8, fp8_e4m3, fp8_e5m2)"),
    (["--quantization", "awq"],
     "argument --quantization: 'awq' is not supported (supported: modelopt, modelopt_fp4, fp8, or leave it unset "
     "to use the checkpoint's)"),
    # a parser the router does not have (the five it has are accepted: issue #17)
    (["--tool-call-parser", "mistral"],
     "invalid tool call parser: mistral (chose from { hermes,llama3_json,llama4_pythonic,pythonic,qwen3_coder })"),
]


@pytest.mark.parametrize("args,message", REFUSED, ids=[r[0][0].lstrip("-") + "-" + r[0][1] for r in REFUSED])
@pytest.mark.parametrize("binary", ["worker", "serve", "router"])
def test_unsupported_flag_values_exit_2(spawn, demo_model, binary, args, message):
    if binary == "worker":
        argv = [WORKER, demo_model, "--listen", f"tcp://127.0.0.1:{free_port_pair()}"]
        prog = "tessera-worker"
    elif binary == "serve":
        argv = [LAUNCHER, "serve", demo_model, "--port", free_port()]
        prog = "tessera serve"
    else:
        argv = [ROUTER, "--port", free_port()]
        prog = "tessera-router"
    p = spawn(argv + args)
    assert p.wait(timeout=30) == 2
    out = p.output()
    assert f"{prog}: error: {message}\n" in out, out
    assert "loading weights" not in out and "listening on" not in out, out


def test_device_flag(spawn, demo_model):
    """--device (issue #16): auto picks the GPU when there is one and says why when it
    does not; cuda without a device (or a build without CUDA) exits 2 naming the cause
    before any socket is bound; cpu is the CPU whatever the machine has."""
    w = spawn([WORKER, demo_model, "--listen", f"tcp://127.0.0.1:{free_port_pair()}", "--device", "cuda"])
    if gpu_present():
        wait_until(lambda: "engine up" in w.output() or w.p.poll() is not None, START_S, what="engine up")
        assert "device: cuda (GPU 0)" in w.output() and "GPU KV cache size: " in w.output(), w.output()
        w.p.send_signal(signal.SIGTERM)
        assert w.wait(timeout=60) == 0
    else:
        assert w.wait(timeout=START_S) == 2
        out = w.output()
        assert re.search(r"cannot load model .*: --device cuda: (no CUDA device \(the driver reports none\)|this build "
                         r"has no CUDA backend \(nvcc was not found\))", out), out
        assert "loading weights" not in out and "listening on" not in out, out
    w = spawn([WORKER, demo_model, "--listen", f"tcp://127.0.0.1:{free_port_pair()}", "--device", "cpu"])
    wait_until(lambda: "engine up" in w.output() or w.p.poll() is not None, START_S, what="engine up")
    out = w.output()
    assert "device: cpu (--device cpu)" in out and "CPU KV cache size: " in out, out
    w.p.send_signal(signal.SIGTERM)
    assert w.wait(timeout=60) == 0


def test_load_format_must_match_the_model(spawn, demo_model):
    w = spawn([WORKER, demo_model, "--listen", f"tcp://127.0.0.1:{free_port_pair()}", "--load-format", "safetensors"])
    assert w.wait(timeout=START_S) == 2
    out = w.output()
    assert (f"argument --load-format: 'safetensors' does not match {demo_model}, which is a GGUF file "
            "(supported here: auto, gguf)") in out, out


@pytest.mark.parametrize("value, message", [
    ('{"custom_ops": ["none"]}', "--compilation-config: key 'custom_ops' is not implemented"),
    ('{"cudagraph_mode": "PIECEWISE"}', "--compilation-config: cudagraph_mode PIECEWISE is not implemented"),
    ('{"cudagraph_capture_sizes": [0]}', "--compilation-config: cudagraph_capture_sizes[0] is not a positive integer"),
    ("3", "--compilation-config: expected a JSON object"),
])
def test_compilation_config_refused(spawn, demo_model, value, message):
    """vLLM's --compilation-config: what Tessera does not implement is refused at start-up
    (exit 2, one line naming the key), on any backend, not accepted and ignored."""
    w = spawn([WORKER, demo_model, "--listen", f"tcp://127.0.0.1:{free_port_pair()}",
               "--compilation-config", value])
    assert w.wait(timeout=START_S) == 2
    assert message in w.output(), w.output()


def test_compilation_config_accepted_on_the_cpu(spawn, demo_model):
    """The keys Tessera reads are accepted on the CPU backend, which never captures graphs
    (logged), and torch.compile's level has no effect by design (logged too)."""
    w = spawn([WORKER, demo_model, "--listen", f"tcp://127.0.0.1:{free_port_pair()}", "--compilation-config",
               '{"cudagraph_capture_sizes": [1, 2, 4], "cudagraph_mode": "FULL_DECODE_ONLY", "level": 3}',
               "--max-seq-len-to-capture", "4096"])
    wait_until(lambda: "engine up" in w.output() or w.p.poll() is not None, START_S, what="engine up")
    out = w.output()
    assert "engine up" in out, out
    assert "--compilation-config: level and mode have no effect by design" in out, out
    assert "--enforce-eager and --compilation-config have no effect by design: the CPU backend never captures" in out
    w.p.send_signal(signal.SIGTERM)
    assert w.wait(timeout=60) == 0


def test_noop_flags_are_logged_and_the_worker_serves(spawn, demo_model):
    """Accepted flags that change nothing on the CPU backend, by design: one line each at
    start-up with the reason; the worker starts as usual, with the other in-effect flags."""
    w = spawn([WORKER, demo_model, "--listen", f"tcp://127.0.0.1:{free_port_pair()}", "--enforce-eager",
               "--swap-space", "8", "--trust-remote-code", "--gpu-memory-utilization", "0.5",
               "--distributed-executor-backend", "uni", "--load-format", "gguf",
               "--long-prefill-token-threshold", "64", "--tokenizer", demo_model])
    wait_until(lambda: "engine up" in w.output() or w.p.poll() is not None, START_S, what="engine up")
    out = w.output()
    assert "engine up" in out, out
    for line in ("--enforce-eager and --compilation-config have no effect by design: the CPU backend never captures graphs",
                 "--swap-space has no effect by design: preempted requests are recomputed",
                 "--trust-remote-code has no effect by design",
                 "--gpu-memory-utilization has no effect by design on the CPU backend",
                 "--distributed-executor-backend has no effect by design"):
        assert line in out, (line, out)
    w.p.send_signal(signal.SIGTERM)
    assert w.wait(timeout=60) == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_resident_bytes_follow_the_dtype(spawn, dtype):
    """The load line's resident figure is what the weights take as held: under --dtype
    bfloat16 every matmul weight (q/k/v/o, gate/up/down, lm_head) at 2 bytes and the
    embedding and norms at 4.  It used to be the float32 count whatever the dtype (538 MB
    for SmolLM2 held in 269 MB of bf16), and ModelInfo's weight_bytes with it."""
    model = Path(__file__).resolve().parents[1] / "fixtures" / "tiny-llama3-hf" / "f32"
    want = 0
    for f in sorted(model.glob("*.safetensors")):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        for name, t in header.items():
            if name == "__metadata__":
                continue
            n = 1
            for d in t["shape"]:
                n *= d
            linear = name.endswith("_proj.weight") or name == "lm_head.weight"
            want += n * (2 if linear and dtype == "bfloat16" else 4)
    w = spawn([WORKER, model, "--listen", f"tcp://127.0.0.1:{free_port_pair()}", "--dtype", dtype])
    wait_until(lambda: "engine up" in w.output() or w.p.poll() is not None, START_S, what="engine up")
    out = w.output()
    resident = re.search(r"([\d.]+) MB resident\)", out)
    assert resident, out
    assert float(resident.group(1)) == pytest.approx(want / 1e6, abs=0.051), (want, out)
