"""ModelOpt FP8 and NVFP4 Llama 4 (issue #15: nvidia/Llama-4-Scout-17B-16E-Instruct-FP8 /
-FP4's layouts) through the real worker and `tessera serve`: the tiny Llama 4 of
tests/fixtures/tiny-llama4-modelopt (make_tiny_llama4_modelopt.py; FP8 with the experts
in BMM stacks under the nested names, NVFP4 with one linear per expert under the bare
names) must give the torch emulation's greedy 32 tokens alone, all prompts at once and
over two pipeline stages; the load line and /metrics report the quantized bytes; the
checkpoint's fp8 KV scales are found under the nested names; and broken checkpoints are
refused at start naming the file and the tensor."""
import json
import re
import struct

import pytest
import requests

from conftest import LAUNCHER, REPO, WORKER, free_port, free_port_pair, http_status, wait_until
from engine_client import EngineWorker
from test_hf_model import completion_text

FIX = REPO / "tests" / "fixtures" / "tiny-llama4-modelopt"
GOLDEN = json.loads((FIX / "golden.json").read_text())
PROMPTS = [p["ids"] for p in GOLDEN["prompts"]]
# what the unit test (test_llama4.c check_modelopt) adds up: the quantized elements and
# the float32 rest (embedding, lm_head, norms, routers)
QUANT_ELEMS = 4 * (64 * 64 * 2 + 32 * 64 * 2) + 2 * 3 * 96 * 64 + 2 * 3 * 32 * 64 + 2 * 4 * 3 * 32 * 64
FLOAT_ELEMS = 2 * 300 * 64 + 9 * 64 + 2 * 4 * 64


def resident_bytes(variant, bf16):
    """With bf16, lm_head and the routers (the float32 matrices) at 2 bytes, and the
    embedding too (the checkpoint's BF16 table kept as stored); the norms stay float32."""
    q = QUANT_ELEMS if variant == "fp8" else QUANT_ELEMS // 16 * 9
    return q + 4 * FLOAT_ELEMS - (2 * (2 * 300 * 64 + 2 * 4 * 64) if bf16 else 0)


@pytest.mark.parametrize("variant,extra", [("fp8", []), ("nvfp4", []), ("fp8", ["-pp", "2"]),
                                           ("nvfp4", ["-pp", "2"]),
                                           ("fp8", ["-tp", "2"]),   # each rank its columns of every expert
                                           # each rank its experts whole (the stack's one scale pair: the
                                           # same activation scale as without expert parallelism)
                                           ("fp8", ["-tp", "2", "--enable-expert-parallel"])])
def test_greedy_matches_emulation(spawn, variant, extra):
    """Each prompt alone, then all at once (one batch through the quantized experts):
    every continuation the emulation's, token for token.  --dtype float32: the emulation
    runs the unquantized router and lm_head in float32."""
    w = EngineWorker(spawn, FIX / variant, "--dtype", "float32", *extra)
    greedy_alone_and_batched(w, PROMPTS, GOLDEN["variants"][variant]["greedy"])
    w.close()


def greedy_alone_and_batched(w, prompts, want):
    """Each prompt alone on worker w, then all at once: every continuation want's."""
    for i, (p, g) in enumerate(zip(prompts, want)):
        assert w.run(f"alone{i}", p, len(g)).tokens == g, f"prompt {i}"
    with w.paused():
        for i, (p, g) in enumerate(zip(prompts, want)):
            w.submit(f"batch{i}", p, len(g))
    got = w.collect([f"batch{i}" for i in range(len(prompts))])
    assert [got[f"batch{i}"].tokens for i in range(len(prompts))] == want


@pytest.mark.parametrize("variant", ["fp8", "nvfp4"])
def test_bf16_keeps_the_quantized_weights(spawn, variant):
    """--dtype bfloat16 -pp 2: the router and lm_head become bf16 (no longer the
    emulation's float32 math), the quantized weights stay as stored (resident bytes),
    and every request in a batch is bitwise itself alone (tokens and logprobs)."""
    w = EngineWorker(spawn, FIX / variant, "--dtype", "bfloat16", "-pp", "2")
    alone = [w.run(f"alone{i}", p, 24, logprobs=2) for i, p in enumerate(PROMPTS)]
    with w.paused():
        for i, p in enumerate(PROMPTS):
            w.submit(f"batch{i}", p, 24, logprobs=2)
    got = w.collect([f"batch{i}" for i in range(len(PROMPTS))])
    for i, a in enumerate(alone):
        b = got[f"batch{i}"]
        assert len(a.tokens) == 24 and a.tokens == b.tokens, i
        assert [(x.logprob, x.top_ids, x.top_logprobs) for x in a.logprobs] == \
            [(y.logprob, y.top_ids, y.top_logprobs) for y in b.logprobs], i
    w.close()
    out = w.proc.output()
    loaded = re.search(r"loaded \d+ tensors \(.*?([0-9.]+) MB resident\)", out)
    assert loaded and float(loaded.group(1)) == pytest.approx(resident_bytes(variant, True) / 1e6, abs=0.05), out


@pytest.mark.parametrize("variant,method", [("fp8", "modelopt"), ("nvfp4", "modelopt_fp4")])
def test_served_with_the_flag(spawn, variant, method):
    """`tessera serve` with the seed's --quantization: greedy completions equal to the
    emulation's, the quantized weights' resident bytes in the load line and /metrics."""
    port = free_port()
    proc = spawn([LAUNCHER, "serve", FIX / variant, "--host", "127.0.0.1", "--port", port, "--served-model-name",
                  "tiny", "--kv-cache-memory-bytes", "64M", "--quantization", method, "--dtype", "float32"])
    base = f"http://127.0.0.1:{port}"

    def ready():
        assert proc.p.poll() is None, proc.output()
        return http_status(base + "/health") == 200
    wait_until(ready, timeout=60, interval=0.1, what=f"tiny-llama4-modelopt/{variant} served")
    for p, want in zip(PROMPTS, GOLDEN["variants"][variant]["greedy"]):
        r = requests.post(base + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": p, "max_tokens": len(want), "temperature": 0, "ignore_eos": True,
            "skip_special_tokens": False}).json()
        assert r["choices"][0]["text"] == completion_text(base, want), r
    out = proc.output()
    assert f"quantization: {method} (ModelOpt {variant.upper()}" in out, out
    want_bytes = resident_bytes(variant, False)
    assert float(re.search(r"([0-9.]+) MB resident", out).group(1)) == pytest.approx(want_bytes / 1e6, abs=0.05)

    def gauge():
        text = requests.get(base + "/metrics", timeout=5).text
        return re.search(r'^tessera:worker_weight_bytes\{worker="[^"]+"\} ([0-9.e+]+)$', text, re.M)
    assert float(wait_until(gauge, timeout=10, what="tessera:worker_weight_bytes").group(1)) == want_bytes


def test_fp8_kv_scales_found_under_the_nested_names(spawn):
    """--kv-cache-dtype fp8 on the nested FP8 folder: every layer's k_scale / v_scale
    is read from language_model.model.layers.<l>.self_attn (not the 1.0 fallback), and
    the model serves."""
    w = EngineWorker(spawn, FIX / "fp8", "--dtype", "float32", "--kv-cache-dtype", "fp8")
    r = w.run("kv", PROMPTS[1], 8)
    assert len(r.tokens) == 8 and r.finish == "length"
    w.close()
    out = w.proc.output()
    assert "KV cache fp8_e4m3: k_scale / v_scale of 4 of 4 layers from" in out, out
    assert "Using KV cache scaling factor 1.0" not in out, out


WIDE = REPO / "tests" / "fixtures" / "wide-llama4-nvfp4"


@pytest.mark.parametrize("flags", [["-tp", "2"], ["-tp", "2", "--enable-expert-parallel"],
                                   ["-tp", "4", "--enable-expert-parallel"], ["-tp", "2", "-pp", "2"]],
                         ids=["tp2", "tp2-expert-parallel", "tp4-expert-parallel", "tp2-pp2"])
def test_nvfp4_tensor_and_expert_parallel(spawn, flags):
    """ModelOpt NVFP4 Llama 4 split over ranks: the wide fixture (make_wide_llama4_nvfp4.py,
    every row-parallel quantized linear's K whole NVFP4 blocks per canonical slice) at
    -tp 2 (each rank its rows / K columns of every linear and expert), with
    --enable-expert-parallel at -tp 2 and 4 (each rank its experts whole, their inputs
    quantized with the max input_scale over all four, as vLLM's global-scale NVFP4 MoE)
    and over two pipeline stages: each prompt alone, then all at once, gives the W4A4
    emulation's greedy tokens, 32 per prompt."""
    golden = json.loads((WIDE / "golden.json").read_text())
    w = EngineWorker(spawn, WIDE / "nvfp4", "--dtype", "float32", *flags)
    greedy_alone_and_batched(w, [p["ids"] for p in golden["prompts"]], golden["variants"]["nvfp4"]["greedy"])
    w.close()


# ---- broken checkpoints: a rewritten copy of a variant ----------------------------------------

def read_st(path):
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    hdr = json.loads(raw[8:8 + n])
    meta = hdr.pop("__metadata__", None)
    data = raw[8 + n:]
    return meta, {k: (v["dtype"], v["shape"], data[v["data_offsets"][0]:v["data_offsets"][1]]) for k, v in hdr.items()}


def write_st(path, meta, tensors):
    hdr, blobs, off = {}, [], 0
    if meta:
        hdr["__metadata__"] = meta
    for k, (dt, shape, b) in tensors.items():
        hdr[k] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(hdr).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def broken(tmp_path, variant, edit, config=None, fixture=FIX):
    d = tmp_path / variant
    d.mkdir()
    for f in (fixture / variant).iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            (d / f.name).symlink_to(f)
    meta, t = read_st(fixture / variant / "model.safetensors")
    edit(t)
    write_st(d / "model.safetensors", meta, t)
    cfg = json.loads((fixture / variant / "config.json").read_text())
    if config:
        config(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def refused(spawn, model, *flags):
    p = spawn([WORKER, model, "--listen", f"tcp://127.0.0.1:{free_port_pair()}", "--dtype", "float32", *flags])
    assert p.wait(timeout=60) == 2
    out = p.output()
    assert "listening on" not in out and "loaded " not in out, out
    return out


L1 = "language_model.model.layers.1.feed_forward.experts."


def drop_stack_input_scale(t):
    del t[L1 + "gate_up_proj_input_scale"]


def down_stack_in_bf16(t):
    dt, shape, b = t.pop(L1 + "down_proj")
    t[L1 + "down_proj"] = ("BF16", shape, bytes(2 * len(b)))
    del t[L1 + "down_proj_weight_scale"], t[L1 + "down_proj_input_scale"]


def expert2_down_in_bf16(t):
    k = "model.layers.3.feed_forward.experts.2.down_proj."
    t[k + "weight"] = ("BF16", [64, 32], bytes(2 * 64 * 32))
    for s in ("weight_scale", "weight_scale_2", "input_scale"):
        del t[k + s]


def announce_nvfp4(cfg):
    cfg["quantization_config"].update(quant_algo="NVFP4", group_size=16)


@pytest.mark.parametrize("variant,edit,config,message", [
    ("fp8", drop_stack_input_scale, None,
     f"tensor '{L1}gate_up_proj_input_scale' missing (a quantized weight needs its input_scale)"),
    ("fp8", down_stack_in_bf16, None,
     f"tensor '{L1}gate_up_proj' is F8_E4M3 but experts.down_proj is not: a MoE layer's expert stacks must be "
     "quantized both or neither"),
    ("nvfp4", expert2_down_in_bf16, None,
     "tensor 'model.layers.3.feed_forward.experts.2.down_proj.weight' is not quantized but expert 0's gate_proj is "
     "nvfp4: a MoE layer's experts must be quantized all or none"),
    ("fp8", lambda t: None, announce_nvfp4,
     "tensor 'language_model.model.layers.0.self_attn.q_proj.weight': dtype F8_E4M3, which does not match the "
     "announced quant_algo (NVFP4)"),
], ids=["stack-scale-missing", "stacks-mixed", "experts-mixed", "algo-mismatch"])
def test_broken_checkpoints_refused(spawn, tmp_path, variant, edit, config, message):
    d = broken(tmp_path, variant, edit, config)
    out = refused(spawn, d)
    assert message in out and str(d) in out, out


def test_expert_parallel_reads_every_experts_input_scale(spawn, tmp_path):
    """-tp 2 --enable-expert-parallel on the wide NVFP4 fixture: rank 0 holds experts 0
    and 1 but reads expert 3's input_scale too (the max over all of them is its
    activation scale); without that scalar the worker is refused at start, naming the
    file and the tensor, by rank 0: the ranks load in order and the first's tensors (its
    41 fixed rows) were all read, the second never started."""
    def drop(t):
        del t["model.layers.1.feed_forward.experts.3.down_proj.input_scale"]
    d = broken(tmp_path, "nvfp4", drop, fixture=WIDE)
    out = refused(spawn, d, "-tp", "2", "--enable-expert-parallel")
    assert "tensor 'model.layers.1.feed_forward.experts.3.down_proj.input_scale' missing" in out and str(d) in out, out
    assert out.count("loading weights: 41/41 tensors") == 1, out
