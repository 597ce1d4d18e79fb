"""The device path served end to end without a GPU (issue #16): `tessera serve` with
TESSERA_KERNELS=devlike puts the weights and the KV cache (NemotronH: its state slots
too) on a backend whose memory counts as a device's, as --device auto does on a GPU,
and runs the reference kernels behind it (docs/configuration.md).  The same server with
TESSERA_KERNELS=ref runs the same kernels on the host path.  Every family and stored
format the device path takes, with the request features that reach the worker
(logprobs, seeded sampling with top-k/top-p/min-p, n, penalties, logit_bias, prompt
logprobs, structured output), answer the same text on both, and the same logprobs
within 1e-4: float32 logprobs may differ in their last bits (the device path
normalizes a row with its own kernel), bfloat16 ones agree bitwise today."""
import os
import re
from pathlib import Path

import pytest
import requests

from conftest import LAUNCHER, REPO, free_port, http_status, wait_until

FIX = REPO / "tests" / "fixtures"
# (model folder, flags): each family on the device path, each stored format it takes
CASES = {
    "llama-f32": (FIX / "tiny-llama3-hf" / "f32", ["--dtype", "float32"]),
    "llama-bf16-fp8kv": (FIX / "tiny-llama3-hf" / "bf16", ["--dtype", "bfloat16", "--kv-cache-dtype", "fp8"]),
    "llama-modelopt-fp8": (FIX / "tiny-modelopt" / "fp8", ["--dtype", "float32"]),
    "llama-modelopt-nvfp4": (FIX / "tiny-modelopt" / "nvfp4", ["--dtype", "bfloat16"]),
    "llama4-f32": (FIX / "tiny-llama4", ["--dtype", "float32"]),
    "llama4-modelopt-nvfp4": (FIX / "tiny-llama4-modelopt" / "nvfp4", ["--dtype", "bfloat16"]),
    "nemotron_h-f32": (FIX / "tiny-nemotron-h" / "model", ["--dtype", "float32"]),
    "nemotron_h-fp8-bf16": (FIX / "tiny-nemotron-h-fp8" / "model", ["--dtype", "bfloat16"]),
    # the engine's other schedules: the next step planned while one runs; prompts in chunks
    "llama-f32-async-chunks": (FIX / "tiny-llama3-hf" / "f32",
                               ["--dtype", "float32", "--async-scheduling", "--max-num-batched-tokens", "4"]),
    "nemotron_h-f32-chunks": (FIX / "tiny-nemotron-h" / "model", ["--dtype", "float32", "--max-num-batched-tokens", "4"]),
}

# Token ids below every fixture's vocabulary (300), so the prompts are the same everywhere.
# The first two ask for no logprobs, so the device picks their tokens (argmax, a seeded
# draw) and sends back 4 bytes a row; the others bring their rows to the host.
REQUESTS = [
    {"prompt": [1, 277, 14, 276, 299, 3], "max_tokens": 12, "temperature": 0},
    {"prompt": [1, 279, 287, 223, 87, 82, 81], "max_tokens": 12, "temperature": 0.9, "seed": 5, "top_p": 0.95},
    {"prompt": [1, 277, 14, 276, 299, 3], "max_tokens": 12, "temperature": 0, "logprobs": 5},
    {"prompt": [1, 279, 287, 223, 87, 82, 81, 80, 271], "max_tokens": 12, "temperature": 0.8, "seed": 7,
     "logprobs": 2},
    {"prompt": [1, 281, 223, 84, 81], "max_tokens": 10, "temperature": 0, "presence_penalty": 1.0,
     "frequency_penalty": 0.5, "repetition_penalty": 1.3, "logprobs": 1},
    {"prompt": [1, 281, 223, 84, 81, 87, 86], "max_tokens": 8, "temperature": 0, "prompt_logprobs": 3},
    {"prompt": [1, 277, 14], "max_tokens": 8, "temperature": 1.0, "seed": 3, "n": 2, "top_k": 5, "top_p": 0.9,
     "min_p": 0.05, "logprobs": 1},
    {"prompt": [1, 277, 14, 276, 299, 3], "max_tokens": 12, "temperature": 0, "logit_bias": {"5": 100}},
    {"prompt": [1, 277, 14, 276, 299, 3], "max_tokens": 16, "temperature": 0,
     "response_format": {"type": "json_object"}, "logprobs": 2},
    {"prompt": [1, 277, 14], "max_tokens": 16, "temperature": 0.7, "seed": 11,
     "structured_outputs": {"regex": "[a-z]+ [0-9]+"}},
    # min_tokens' mask over a stop id the bias makes the favourite: masked for 5 tokens,
    # then it stops the request
    {"prompt": [1, 281, 223, 84], "max_tokens": 12, "temperature": 0, "min_tokens": 5, "stop_token_ids": [9],
     "logit_bias": {"9": 60}, "logprobs": 1},
]


def serve(spawn, model, flags, kernels):
    port = free_port()
    proc = spawn([LAUNCHER, "serve", model, "--host", "127.0.0.1", "--port", port, "--served-model-name", "m",
                  "--kv-cache-memory-bytes", "32M", *flags], env=dict(os.environ, TESSERA_KERNELS=kernels))
    base = f"http://127.0.0.1:{port}"

    def ready():
        assert proc.p.poll() is None, proc.output()[-3000:]
        return http_status(base + "/health") == 200
    wait_until(ready, timeout=120, interval=0.1, what=f"{model.name} served ({kernels})")
    return proc, base


def answers(base):
    """Each request's choices (text, token logprobs, top logprobs) and prompt logprobs."""
    out = []
    for req in REQUESTS:
        r = requests.post(base + "/v1/completions", json={"model": "m", "ignore_eos": True, **req}, timeout=120)
        assert r.status_code == 200, r.text
        j = r.json()
        choices = sorted(j["choices"], key=lambda c: c["index"])
        out.append(([(c["text"], (c["logprobs"] or {}).get("token_logprobs"), (c["logprobs"] or {}).get("top_logprobs"))
                     for c in choices], j.get("prompt_logprobs")))
    return out


def assert_close(a, b, where, tol=1e-4):
    """Texts, token keys and every other non-float equal; floats within tol."""
    if isinstance(a, float) and isinstance(b, float):
        assert abs(a - b) <= tol, (where, a, b)
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        assert len(a) == len(b), (where, a, b)
        for i, (x, y) in enumerate(zip(a, b)):
            assert_close(x, y, f"{where}[{i}]", tol)
    elif isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), (where, a, b)
        for k in a:
            assert_close(a[k], b[k], f"{where}[{k!r}]", tol)
    else:
        assert a == b, (where, a, b)


@pytest.mark.parametrize("case", CASES)
def test_device_path_answers_as_the_host_path(spawn, case):
    model, flags = CASES[case]
    host, base = serve(spawn, model, flags, "ref")
    want = answers(base)
    host.kill_group()
    dev, base = serve(spawn, model, flags, "devlike")
    got = answers(base)
    dev.kill_group()            # a clean exit: the runner's closing line
    log = Path(dev.log_path).read_text(errors="replace")
    assert "device: cpu-devlike (TESSERA_KERNELS=devlike" in log, log[-3000:]
    # the rows the device answered (worker/model/answer.h): every sampled row but those
    # under a grammar as its token, the logprobs and the rules with it, the prompt rows
    # as their logprobs; only the grammar's rows and prompt_logprobs' last come whole
    m = re.search(r"logits rows answered on the device: (\d+) as their token \((\d+) with its logprobs, (\d+) "
                  r"under the request's rules\), (\d+) as their prompt logprobs, (\d+) whole", log)
    assert m, log[-3000:]
    token, with_lp, with_rules, prompt_lp, whole = map(int, m.groups())
    assert with_lp >= 12 + 12 + 10 and with_rules >= 10 + 12 and prompt_lp >= 6, m.group(0)
    assert whole <= 16 + 16 + 2 + 1, m.group(0)
    # the upload's closing line (device_arrays.h: every family)
    assert re.search(r"weights on the cpu-devlike device: [0-9.]+ MB in [0-9]+ arrays, [0-9.]+ s \(", log), log[-3000:]
    for i, (w, g) in enumerate(zip(want, got, strict=True)):
        assert_close(g, w, f"request {i}")
    # the answers are not trivially equal: the greedy one with logprobs has text and 12
    assert len(want[2][0][0][0]) > 0 and len(want[2][0][0][1]) == 12
    # min_tokens held the biased stop id back for 5 tokens, then it ended the request
    assert len(want[10][0][0][1]) in (5, 6), want[10]
