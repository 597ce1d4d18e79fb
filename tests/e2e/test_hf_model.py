"""A Hugging Face safetensors checkpoint served end to end: the tiny random Llama with
llama3 rope scaling that tests/fixtures/make_tiny_llama_hf.py builds with transformers
(f32 in three shards, and bf16), with transformers' greedy continuations as goldens."""
import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import requests

from conftest import LAUNCHER, free_port, http_status, wait_until

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "tiny-llama3-hf"
GOLDEN = json.loads((FIX / "golden.json").read_text())


def completion_text(base, ids):
    """What vLLM returns as a completion's text for these ids: /detokenize (the full
    decode) of the longest prefix whose decode does not end in U+FFFD.  A generation
    cut inside a multi-byte character drops its bytes; the detokenize endpoint keeps
    the replacement characters (common/tokenizer.h, tsr_detok)."""
    for k in range(len(ids), -1, -1):
        text = requests.post(base + "/detokenize", json={"tokens": ids[:k]}, timeout=5).json()["prompt"]
        if not text.endswith("\ufffd"):
            return text
    return ""


# The device path too: TESSERA_KERNELS=devlike serves where a GPU would be taken, with the
# weights and KV cache uploaded and decode on captured graphs replayed through the
# reference kernels (or eagerly): the serving logic the GPU suite relies on, run in CI.
PATHS = {"cpu": ([], None), "devlike": ([], "devlike"), "devlike-eager": (["--enforce-eager"], "devlike")}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("variant", ["f32", "bf16"])
def test_greedy_matches_transformers(spawn, variant, path):
    port = free_port()
    extra, kernels = PATHS[path]
    proc = spawn([LAUNCHER, "serve", FIX / variant, "--host", "127.0.0.1", "--port", port,
                  "--served-model-name", "tiny", "--kv-cache-memory-bytes", "64M",
                  "--dtype", "float32", *extra],   # the goldens are float32 math (auto may pick bf16)
                 env=dict(os.environ, TESSERA_KERNELS=kernels) if kernels else None)
    base = f"http://127.0.0.1:{port}"

    def ready():
        assert proc.p.poll() is None, proc.output()
        return http_status(base + "/health") == 200 and \
            requests.post(base + "/tokenize", json={"prompt": "x"}, timeout=5).status_code == 200
    wait_until(ready, timeout=60, interval=0.1, what="tiny HF model served")
    info = requests.get(base + "/v1/models", timeout=5).json()["data"][0]
    assert info["root"] == str(FIX / variant) and info["max_model_len"] == 256
    for prompt, want in zip(GOLDEN["prompts"], GOLDEN["variants"][variant]["greedy"]):
        r = requests.post(base + "/v1/completions", json={"model": "tiny", "prompt": prompt["ids"], "temperature": 0,
                                                          "max_tokens": len(want), "ignore_eos": True,
                                                          "skip_special_tokens": False}, timeout=60).json()
        assert r["choices"][0]["text"] == completion_text(base, want), prompt["text"]
    log = proc.output()
    if kernels:
        assert "device: cpu-devlike (TESSERA_KERNELS=devlike" in log and "kernels: cpu-devlike" in log, log[-3000:]
        assert ("Graph capturing finished" in log) == (not extra), log[-3000:]


def serve_tiny(spawn, model):
    """`tessera serve` of a tiny-model folder as "tiny" in float32: (proc, base URL)
    once /health is 200."""
    port = free_port()
    proc = spawn([LAUNCHER, "serve", model, "--host", "127.0.0.1", "--port", port, "--served-model-name", "tiny",
                  "--kv-cache-memory-bytes", "64M", "--dtype", "float32"])
    base = f"http://127.0.0.1:{port}"

    def ready():
        assert proc.p.poll() is None, proc.output()
        return http_status(base + "/health") == 200
    wait_until(ready, timeout=60, interval=0.1, what=f"{model.name} served")
    return proc, base


def write_safetensors(path, header, data):
    """A safetensors file: u64 LE header length, the JSON header, the data."""
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def f16_pair(dst):
    """Two checkpoints from the f32 fixture with the same weight values: every tensor
    rounded to float16 and stored as F16 in one, widened back and stored as F32 in the
    other.  float16 -> float32 is exact, so a loader that reads F16 right gives the
    same float32 weights from both, hence bitwise the same outputs."""
    out = {}
    for dtype in ("F16", "F32"):
        d = dst / dtype.lower()
        shutil.copytree(FIX / "f32", d)
        for shard in sorted(d.glob("*.safetensors")):
            blob = shard.read_bytes()
            n = struct.unpack("<Q", blob[:8])[0]
            header, body = json.loads(blob[8:8 + n]), blob[8 + n:]
            new_header, parts, offset = {}, [], 0
            for name, t in header.items():
                if name == "__metadata__":
                    new_header[name] = t
                    continue
                assert t["dtype"] == "F32"
                a, b = t["data_offsets"]
                x = np.frombuffer(body[a:b], dtype="<f4").astype("<f2")
                raw = (x if dtype == "F16" else x.astype("<f4")).tobytes()
                new_header[name] = {"dtype": dtype, "shape": t["shape"], "data_offsets": [offset, offset + len(raw)]}
                parts.append(raw)
                offset += len(raw)
            write_safetensors(shard, new_header, b"".join(parts))
        out[dtype] = d
    return out


def test_f16_checkpoint_loads_exact_values(spawn, tmp_path):
    """F16 safetensors (the dtype of many real checkpoints) load to exactly the values
    an F32 file holds: greedy tokens and their logprobs bitwise equal."""
    pair = f16_pair(tmp_path)
    results = {}
    for dtype, model in pair.items():
        proc, base = serve_tiny(spawn, model)
        results[dtype] = []
        for prompt in GOLDEN["prompts"]:
            r = requests.post(base + "/v1/completions", json={"model": "tiny", "prompt": prompt["ids"],
                                                              "temperature": 0, "max_tokens": 8, "ignore_eos": True,
                                                              "logprobs": 3}, timeout=60)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            results[dtype].append((choice["text"], choice["logprobs"]["token_logprobs"],
                                   choice["logprobs"]["top_logprobs"]))
        proc.p.terminate()
        assert proc.wait(timeout=60) == 0
    assert results["F16"] == results["F32"]
    assert any(lp != 0.0 for _, lps, _ in results["F16"] for lp in lps)   # real numbers were compared


def test_extra_eos_id_is_a_stop_reason(spawn, tmp_path):
    """generation_config.json listing more EOS ids than the tokenizer's own (Llama 3's
    [128001, 128008, 128009] with eos_token <|eot_id|>): as vLLM, finishing on one of the
    others is finish_reason "stop" with that id as stop_reason, and ignore_eos runs past
    it.  Here the tiny model's greedy third token (129 for the first golden prompt) is
    made an extra EOS id."""
    model = tmp_path / "extra-eos"
    shutil.copytree(FIX / "f32", model)
    prompt = GOLDEN["prompts"][0]["ids"]
    greedy = GOLDEN["variants"]["f32"]["greedy"][0]
    extra = greedy[2]
    assert extra not in greedy[:2]
    gen = json.loads((model / "generation_config.json").read_text())
    gen["eos_token_id"] = [2, extra]
    (model / "generation_config.json").write_text(json.dumps(gen))

    _, base = serve_tiny(spawn, model)
    body = {"model": "tiny", "prompt": prompt, "temperature": 0, "max_tokens": 16}
    r = requests.post(base + "/v1/completions", json=body, timeout=60).json()
    assert r["choices"][0]["finish_reason"] == "stop" and r["choices"][0]["stop_reason"] == extra, r
    assert r["usage"]["completion_tokens"] == 3, r
    r = requests.post(base + "/v1/completions", json=dict(body, ignore_eos=True), timeout=60).json()
    assert r["choices"][0]["finish_reason"] == "length" and r["choices"][0]["stop_reason"] is None, r
    assert r["usage"]["completion_tokens"] == 16, r
