"""A Hugging Face safetensors checkpoint served end to end: the tiny random Llama with
llama3 rope scaling that tests/fixtures/make_tiny_llama_hf.py builds with transformers
(f32 in three shards, and bf16), with transformers' greedy continuations as goldens."""
import json
from pathlib import Path

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


@pytest.mark.parametrize("variant", ["f32", "bf16"])
def test_greedy_matches_transformers(spawn, variant):
    port = free_port()
    proc = spawn([LAUNCHER, "serve", FIX / variant, "--host", "127.0.0.1", "--port", port,
                  "--served-model-name", "tiny", "--kv-cache-memory-bytes", "64M",
                  "--dtype", "float32"])   # the goldens are float32 math (auto may pick bf16)
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
