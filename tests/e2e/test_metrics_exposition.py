"""/metrics checked by an independent parser: tests/fixtures/check_exposition.py reads
the exposition with prometheus_client, re-prints it through prometheus_client's own
writer (byte-identical), and compares the vllm:* series with a prometheus_client
registry built from vLLM's metric definitions (../shared/reference/vllm-surface.md §4).

Two expositions: the rich one tests/unit/test_metrics.c writes (every series kind, two
models, hidden series, awkward label values), and a live router's after real traffic.
"""
import subprocess
import sys

import requests

from conftest import BUILD, REPO

CHECK = REPO / "tests" / "fixtures" / "check_exposition.py"


def check(text_or_path):
    """Run the checker; return its output, asserting that every check passed."""
    args = [sys.executable, str(CHECK)]
    if isinstance(text_or_path, str):
        r = subprocess.run(args + ["-"], input=text_or_path, capture_output=True, text=True, timeout=120)
    else:
        r = subprocess.run(args + [str(text_or_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "FAIL" not in r.stdout and "PASS" in r.stdout, r.stdout
    return r.stdout


def test_unit_exposition_parses_as_prometheus_client_writes_it(tmp_path):
    path = tmp_path / "metrics.prom"
    binary = BUILD / "tests" / "unit" / "test_metrics"
    r = subprocess.run([binary], env={"TSR_METRICS_EXPOSITION": str(path), "CMOCKA_MESSAGE_OUTPUT": "stdout"},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    out = check(path)
    assert "vllm:* series identical" in out and "2 models" in out, out


def test_live_router_exposition(serve):
    s = serve("--served-model-name", "smol", "--max-model-len", "512")
    r = requests.post(s.base + "/v1/completions", json={"model": "smol", "prompt": "Hello", "max_tokens": 4},
                      timeout=120)
    assert r.status_code == 200, r.text
    with requests.post(s.base + "/v1/chat/completions", stream=True, timeout=120,
                       json={"model": "smol", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                             "stream": True}) as st:
        assert st.status_code == 200
        assert b"[DONE]" in b"".join(st.iter_content(None))
    text = requests.get(s.base + "/metrics", timeout=30).text
    assert "vllm:request_success_total" in text
    out = check(text)
    assert "vllm:* series identical" in out and "1 models" in out, out
