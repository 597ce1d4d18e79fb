"""Per-request deadline (--request-timeout-secs): a generation still running past it
is aborted at the worker and answered 504 (a stream ends with the error event and
[DONE]); nothing waits forever on a worker that is alive but slow."""
import json
import time

import requests

from conftest import SANITIZED, wait_until

MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"


def metric(base, prefix):
    text = requests.get(base + "/metrics", timeout=5).text
    lines = [l for l in text.splitlines() if l.startswith(prefix)]
    return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0


def test_request_past_its_deadline_is_aborted(serve):
    s = serve("--request-timeout-secs", "2")
    model = requests.get(s.base + "/v1/models", timeout=5).json()["data"][0]["id"]
    wait_until(lambda: requests.post(s.base + "/v1/completions", timeout=30, json={
        "model": model, "prompt": "Hi", "max_tokens": 1}).status_code == 200, timeout=60, interval=0.2,
        what="the model's tokenizer ready at the router")
    long_job = {"model": model, "prompt": "Tell me a long story.", "max_tokens": 5000, "ignore_eos": True}

    t0 = time.monotonic()
    r = requests.post(s.base + "/v1/completions", json=long_job, timeout=60)
    took = time.monotonic() - t0
    assert r.status_code == 504, r.text
    err = r.json()["error"]
    assert err["type"] == "GatewayTimeoutError" and err["code"] == 504
    assert "--request-timeout-secs" in err["message"]
    assert 2.0 <= took < 30, took

    with requests.post(s.base + "/v1/completions", json={**long_job, "stream": True}, stream=True,
                       timeout=60) as r:
        assert r.status_code == 200
        events = [l[len(b"data: "):] for l in r.iter_lines() if l.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    last = json.loads(events[-2])
    assert last["error"]["code"] == 504, last
    if not SANITIZED:               # tokens streamed before the deadline (the ASan build is slower)
        assert len(events) > 3

    wait_until(lambda: metric(s.base, "vllm:num_requests_running{") == 0.0, timeout=10,
               what="the worker dropped the expired requests")
    assert metric(s.base, 'tessera:request_aborts_total{cause="deadline"}') >= 2
    # a short request is unaffected (one that fits in 2 s: not with the ASan build)
    if not SANITIZED:
        ok = requests.post(s.base + "/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 2},
                           timeout=60)
        assert ok.status_code == 200, ok.text
