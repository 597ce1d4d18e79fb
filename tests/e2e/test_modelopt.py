"""ModelOpt FP8 and NVFP4 checkpoints served end to end (issue #15): the tiny Llama of
tests/fixtures/make_tiny_modelopt.py through `tessera serve` with the real
--quantization flag, its greedy 32-token continuations equal to the torch emulation's,
the load line reporting the quantized weights' resident bytes, and a --quantization
that disagrees with the checkpoint refused at start with a clear message."""
import json
import random
import re
import shutil
import struct
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
    and the embedding table (300 x 64 each, BF16 in the file, kept as stored) are 2 bytes
    a weight, not 4, the quantized weights stay as stored, and the
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
    want = (228608 if variant == "fp8" else 196352) - (2 * 300 * 64 * 2 if bf16 else 0)
    resident = float(re.search(r"([0-9.]+) MB resident", out).group(1))
    assert resident == pytest.approx(want / 1e6, abs=0.05), out
    assert weight_gauge(base) == want
    assert f"KV cache dtype {'bf16' if bf16 else 'f32'} (--kv-cache-dtype auto)" in out, out


def test_tensor_parallel_weights_split(spawn):
    """-tp 2 on the FP8 checkpoint: the ranks together hold more than one copy (the
    norms are whole on every rank) but well under two: each rank kept only its share
    of the fp8 linears, and of the embedding's and lm_head's vocabulary rows."""
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


def write_wide_nvfp4(out, dim=256, hidden=512, layers=2):
    """A random NVFP4 Llama wide enough for the canonical split (o_proj's 256 columns are
    32 a slice at -tp 1, 16 at -tp 2 and 4: whole NVFP4 blocks), in ModelOpt's layout:
    packed e2m1 codes (U8, two a byte), an e4m3 scale per 16 (F8_E4M3), weight_scale_2
    and input_scale per linear; the embedding, norms and lm_head (excluded) float32.  The
    tiny fixture's tokenizer and vocabulary (300)."""
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(FIX / "nvfp4" / name, out / name)
    config = json.loads((FIX / "nvfp4" / "config.json").read_text())
    config.update(hidden_size=dim, intermediate_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=dim // 4)
    config["quantization_config"].pop("kv_cache_scheme", None)
    (out / "config.json").write_text(json.dumps(config))
    quant = json.loads((FIX / "nvfp4" / "hf_quant_config.json").read_text())
    quant["quantization"].pop("kv_cache_quant_algo", None)
    (out / "hf_quant_config.json").write_text(json.dumps(quant))
    rng = random.Random(5)
    tensors = {}

    def f32(name, values, shape):
        tensors[name] = ("F32", shape, struct.pack(f"<{len(values)}f", *values))

    def linear(name, rows, cols):
        tensors[name + ".weight"] = ("U8", [rows, cols // 2], rng.randbytes(rows * cols // 2))
        # e4m3 0x30 .. 0x3f: 0.5 .. 0.94, finite and positive
        tensors[name + ".weight_scale"] = ("F8_E4M3", [rows, cols // 16],
                                           bytes(0x30 + rng.randrange(16) for _ in range(rows * cols // 16)))
        f32(name + ".weight_scale_2", [0.02], [])
        f32(name + ".input_scale", [0.05], [])

    vocab = config["vocab_size"]
    f32("model.embed_tokens.weight", [rng.uniform(-1, 1) for _ in range(vocab * dim)], [vocab, dim])
    f32("lm_head.weight", [rng.uniform(-0.1, 0.1) for _ in range(vocab * dim)], [vocab, dim])
    f32("model.norm.weight", [1.0] * dim, [dim])
    for layer in range(layers):
        pre = f"model.layers.{layer}."
        f32(pre + "input_layernorm.weight", [1.0] * dim, [dim])
        f32(pre + "post_attention_layernorm.weight", [1.0] * dim, [dim])
        for proj, rows, cols in (("self_attn.q_proj", dim, dim), ("self_attn.k_proj", dim // 2, dim),
                                 ("self_attn.v_proj", dim // 2, dim), ("self_attn.o_proj", dim, dim),
                                 ("mlp.gate_proj", hidden, dim), ("mlp.up_proj", hidden, dim),
                                 ("mlp.down_proj", dim, hidden)):
            linear(pre + proj, rows, cols)
    header, offset = {}, 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(out / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for _, _, data in tensors.values():
            f.write(data)


def test_tensor_parallel_nvfp4_bitwise(spawn, tmp_path):
    """An NVFP4 Llama whose K slices are whole blocks, served at -tp 1, 2 and 4 (4 > the
    2 KV heads: replicated) with --dtype float32 (the canonical split at every -tp): the
    greedy tokens and every top-5 logprob the same, to the last bit of the JSON float."""
    model = tmp_path / "nvfp4-wide"
    write_wide_nvfp4(model)
    prompts = [[1, 17, 42, 99, 123, 7], [1, 250, 3, 3, 64]]
    answers = {}
    for tp in ("1", "2", "4"):
        proc = spawn([LAUNCHER, "serve", model, "--host", "127.0.0.1", "--port", port := free_port(),
                      "--served-model-name", "tiny", "--kv-cache-memory-bytes", "64M", "--dtype", "float32",
                      "-tp", tp])
        base = f"http://127.0.0.1:{port}"

        def ready():
            assert proc.p.poll() is None, proc.output()
            return http_status(base + "/health") == 200
        wait_until(ready, timeout=60, interval=0.1, what=f"nvfp4 -tp {tp} served")
        got = []
        for ids in prompts:
            r = requests.post(base + "/v1/completions", json={
                "model": "tiny", "prompt": ids, "max_tokens": 12, "temperature": 0, "logprobs": 5,
                "ignore_eos": True}, timeout=60).json()
            got.append((r["choices"][0]["logprobs"]["tokens"], r["choices"][0]["logprobs"]["top_logprobs"]))
        out = proc.output()
        assert "quantization: modelopt_fp4 (ModelOpt NVFP4" in out, out
        if tp != "1":
            assert f"tensor parallel rank 0 of {tp}" in out, out
        proc.kill_group()
        answers[tp] = got
    assert answers["1"] == answers["2"] == answers["4"]
    assert len(set(answers["1"][0][0])) > 1      # not one token repeated: real logits


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
