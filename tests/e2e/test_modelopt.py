"""ModelOpt FP8 and NVFP4 checkpoints served end to end (issue #15): the tiny Llama of
tests/fixtures/make_tiny_modelopt.py through `tessera serve` with the real
--quantization flag, its greedy 32-token continuations equal to the torch emulation's,
the load line reporting the quantized weights' resident bytes, and a --quantization
that disagrees with the checkpoint refused at start with a clear message."""
import json
import re
from pathlib import Path

import openai
import pytest
import requests

from conftest import LAUNCHER, free_port, http_status, wait_until
from test_hf_model import completion_text

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "tiny-modelopt"
GOLDEN = json.loads((FIX / "golden.json").read_text())


def serve(spawn, variant, *extra):
    port = free_port()
    proc = spawn([LAUNCHER, "serve", FIX / variant, "--host", "127.0.0.1", "--port", port,
                  "--served-model-name", "tiny", "--kv-cache-memory-bytes", "64M", *extra])
    base = f"http://127.0.0.1:{port}"

    def ready():
        assert proc.p.poll() is None, proc.output()
        return http_status(base + "/health") == 200
    wait_until(ready, timeout=60, interval=0.1, what=f"tiny-modelopt/{variant} served")
    return proc, base


def weight_gauge(base):
    def gauge():
        text = requests.get(base + "/metrics", timeout=5).text
        return re.search(r'^tessera:worker_weight_bytes\{worker="[^"]+"\} ([0-9.e+]+)$', text, re.M)
    return float(wait_until(gauge, timeout=10, what="tessera:worker_weight_bytes").group(1))


# --dtype float32 throughout: the emulation's math has a float32 lm_head and a float32 KV
# cache (--kv-cache-dtype auto is the model's dtype, bfloat16 under --dtype auto on a CPU
# with AVX512_BF16: test_dtype_auto below).
@pytest.mark.parametrize("variant,method,extra", [
    ("fp8", "modelopt", []), ("nvfp4", "modelopt_fp4", []), ("fp8", "fp8", []),
    ("fp8", "modelopt", ["-pp", "2"]),                            # each stage loads its layers' weights as stored
    ("fp8", "modelopt", ["-tp", "2"]),                            # each rank its rows / K slices of the fp8 bytes
    ("fp8", "modelopt", ["-tp", "2", "-pp", "2"]),
])
def test_greedy_matches_emulation(spawn, variant, method, extra):
    proc, base = serve(spawn, variant, "--quantization", method, "--dtype", "float32", *extra)
    client = openai.OpenAI(base_url=base + "/v1", api_key="none")
    want_all = GOLDEN["variants"][variant]["greedy"]
    for prompt, want in zip(GOLDEN["prompts"], want_all):
        r = client.completions.create(model="tiny", prompt=prompt["ids"], temperature=0, max_tokens=len(want),
                                      extra_body={"ignore_eos": True, "skip_special_tokens": False})
        assert r.choices[0].text == completion_text(base, want), prompt["text"]
        assert r.usage.completion_tokens == 32
    out = proc.output()
    assert f"quantization: {'modelopt_fp4' if variant == 'nvfp4' else 'modelopt'} (ModelOpt " \
           f"{variant.upper()}" in out, out
    # memory truth: 14 quantized linears (73728 weights) kept as stored, the 7 bf16
    # tensors widened to float32 (test_quant_modelopt.c has the arithmetic)
    if not extra:
        want = 228608 if variant == "fp8" else 196352
        resident = float(re.search(r"([0-9.]+) MB resident", out).group(1))
        assert resident == pytest.approx(want / 1e6, abs=0.05), out
        assert weight_gauge(base) == want       # and /metrics says the same, exactly, per worker
    assert "KV cache dtype f32 (--kv-cache-dtype auto)" in out, out


@pytest.mark.parametrize("variant", ["fp8", "nvfp4"])
def test_dtype_auto(spawn, variant):
    """--dtype auto (unset): where it holds bfloat16 (a CPU with AVX512_BF16) the lm_head
    (300 x 64) is 2 bytes a weight, not 4, the quantized weights stay as stored, and the
    KV cache is the model's dtype as in vLLM; the text is no longer the float32
    emulation's, so only its length is asserted."""
    proc, base = serve(spawn, variant)
    client = openai.OpenAI(base_url=base + "/v1", api_key="none")
    r = client.completions.create(model="tiny", prompt=GOLDEN["prompts"][0]["ids"], temperature=0, max_tokens=32,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 32
    out = proc.output()
    bf16 = "dtype bfloat16 (--dtype auto)" in out
    assert bf16 or "dtype float32 (--dtype auto)" in out, out
    want = (228608 if variant == "fp8" else 196352) - (300 * 64 * 2 if bf16 else 0)
    resident = float(re.search(r"([0-9.]+) MB resident", out).group(1))
    assert resident == pytest.approx(want / 1e6, abs=0.05), out
    assert weight_gauge(base) == want
    assert f"KV cache dtype {'bf16' if bf16 else 'f32'} (--kv-cache-dtype auto)" in out, out


def test_tensor_parallel_weights_split(spawn):
    """-tp 2 on the FP8 checkpoint: the ranks together hold more than one copy (the
    embedding, lm_head rows and norms are whole or split differently) but well under
    two: each rank kept only its share of the fp8 linears."""
    _, base1 = serve(spawn, "fp8", "--dtype", "float32")
    _, base2 = serve(spawn, "fp8", "--dtype", "float32", "-tp", "2")
    one, two = weight_gauge(base1), weight_gauge(base2)
    assert one < two < 1.5 * one, (one, two)


def test_tensor_parallel_nvfp4_refused(spawn):
    """The tiny NVFP4 checkpoint's o_proj has 64 columns: at -tp 2 a rank's canonical K
    slice is 8 columns, half an NVFP4 block; refused at start naming the tensor."""
    proc = spawn([LAUNCHER, "serve", FIX / "nvfp4", "--host", "127.0.0.1", "--port", free_port(),
                  "--kv-cache-memory-bytes", "64M", "-tp", "2", "--dtype", "float32"])
    assert proc.p.wait(timeout=60) != 0
    out = proc.output()
    assert "tensor parallelism: o_proj of layer 0 is nvfp4, whose blocks of 16 elements the canonical split's " \
        "8 columns per slice would cut (4 slices a rank)" in out, out


@pytest.mark.parametrize("variant,flag,message", [
    ("fp8", "modelopt_fp4", "says quant_algo FP8 (use --quantization modelopt, or leave it unset)"),
    ("nvfp4", "modelopt", "says quant_algo NVFP4 (use --quantization modelopt_fp4, or leave it unset)"),
    ("nvfp4", "fp8", "says quant_algo NVFP4"),
])
def test_flag_must_match_the_checkpoint(spawn, variant, flag, message):
    proc = spawn([LAUNCHER, "serve", FIX / variant, "--host", "127.0.0.1", "--port", free_port(),
                  "--kv-cache-memory-bytes", "64M", "--quantization", flag])
    assert proc.p.wait(timeout=60) != 0
    out = proc.output()
    assert f"argument --quantization: '{flag}' does not match the checkpoint" in out and message in out, out
    assert "loaded " not in out and "worker exited with status 2" in out, out    # refused before any weight


def test_unquantized_checkpoint_refuses_the_flag(spawn):
    model = FIX.parent / "tiny-llama3-hf" / "bf16"
    proc = spawn([LAUNCHER, "serve", model, "--host", "127.0.0.1", "--port", free_port(),
                  "--kv-cache-memory-bytes", "64M", "--quantization", "modelopt"])
    assert proc.p.wait(timeout=60) != 0
    out = proc.output()
    assert "announces no quantization" in out and "quantizing an unquantized checkpoint at load is not supported" \
        in out, out
