"""The router <-> worker skeleton with real processes: tessera serve, the official
openai SDK, supervision (kill -9 a worker), clean shutdown, bad configuration."""
import json
import os
import signal
import time

import openai
import pytest
import requests

from conftest import (LAUNCHER, ROUTER, SANITIZED, WORKER, free_port, free_port_pair, http_status, pid_alive,
                      wait_until)


def test_models_list_with_openai_sdk(serve, demo_model):
    s = serve("--served-model-name", "smol-test", "smol-alias")
    client = openai.OpenAI(base_url=s.base + "/v1", api_key="unused")
    models = client.models.list()
    assert [m.id for m in models.data] == ["smol-test", "smol-alias"]
    card = models.data[0]
    assert card.object == "model"
    assert card.owned_by == "vllm"
    # vLLM's extra fields come through the SDK as extras.
    raw = requests.get(s.base + "/v1/models", timeout=5).json()
    assert raw["object"] == "list"
    first = raw["data"][0]
    assert first["root"] == str(demo_model)
    assert first["parent"] is None
    assert first["max_model_len"] == 8192          # SmolLM2's context length, from the GGUF
    assert first["permission"][0]["object"] == "model_permission"


def test_health_ping_version(serve):
    s = serve()
    r = requests.get(s.base + "/health", timeout=5)
    assert r.status_code == 200 and r.content == b""
    assert requests.get(s.base + "/ping", timeout=5).status_code == 200
    assert requests.post(s.base + "/ping", timeout=5).status_code == 200
    assert requests.get(s.base + "/version", timeout=5).json() == {"version": "0.1.0"}


def test_max_model_len_flag_reaches_models(serve):
    s = serve("--max-model-len", "2k")
    assert requests.get(s.base + "/v1/models", timeout=5).json()["data"][0]["max_model_len"] == 2000


def test_routing_errors_have_fastapi_bodies(serve):
    s = serve()
    r = requests.get(s.base + "/no/such/path", timeout=5)
    assert r.status_code == 404 and r.json() == {"detail": "Not Found"}
    r = requests.post(s.base + "/v1/models", timeout=5)
    assert r.status_code == 405 and r.json() == {"detail": "Method Not Allowed"}


def test_api_key_guards_v1_only(serve):
    s = serve("--api-key", "sekret")
    r = requests.get(s.base + "/v1/models", timeout=5)
    assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}
    r = requests.get(s.base + "/v1/models", headers={"Authorization": "Bearer wrong"}, timeout=5)
    assert r.status_code == 401
    assert http_status(s.base + "/health") == 200
    client = openai.OpenAI(base_url=s.base + "/v1", api_key="sekret")
    assert len(client.models.list().data) == 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=s.base + "/v1", api_key="nope", max_retries=0).models.list()


def test_kill_worker_then_supervisor_restarts_it(serve):
    s = serve()
    old = s.worker_pid()
    assert old and pid_alive(old)
    router = s.router_pid()
    os.kill(old, signal.SIGKILL)
    t0 = time.monotonic()
    # The router notices within 3 s: /health 503 while the worker is down, unless the
    # launcher's restart was quicker than that (a GGUF whose blocks stay stored loads in
    # about 0.1 s) and the router saw the new boot epoch instead.
    wait_until(lambda: http_status(s.base + "/health") == 503 or s.worker_pid() not in (None, old),
               timeout=3, what="/health 503 or a restarted worker after kill -9")
    assert time.monotonic() - t0 < 3.0
    # The router kept answering (503 is an answer) and was not restarted.
    assert s.router_pid() == router
    wait_until(lambda: http_status(s.base + "/health") == 200, timeout=30, what="/health 200 after restart")
    new = s.worker_pid()
    assert new and new != old
    out = s.proc.output()
    assert "was killed by signal 9" in out and "restarting in" in out
    client = openai.OpenAI(base_url=s.base + "/v1", api_key="x")
    assert len(client.models.list().data) == 1


def test_sigterm_launcher_leaves_no_children(serve):
    s = serve()
    kids = [s.worker_pid(), s.router_pid()]
    assert all(kids)
    s.proc.p.send_signal(signal.SIGTERM)
    assert s.proc.wait(timeout=20) == 0
    for pid in kids:
        wait_until(lambda: not pid_alive(pid), timeout=5, what=f"child {pid} gone")


def test_sigkill_launcher_children_die_too(serve):
    s = serve()
    kids = [s.worker_pid(), s.router_pid()]
    os.kill(s.proc.pid, signal.SIGKILL)
    for pid in kids:
        wait_until(lambda: not pid_alive(pid), timeout=10, what=f"orphan {pid} gone")


def test_router_death_stops_everything(serve):
    s = serve()
    worker = s.worker_pid()
    os.kill(s.router_pid(), signal.SIGKILL)
    assert s.proc.wait(timeout=20) == 1
    wait_until(lambda: not pid_alive(worker), timeout=5, what="worker gone")
    assert "router was killed by signal 9" in s.proc.output()


def test_corrupt_model_exits_with_clear_error(spawn, tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 40)
    p = spawn([LAUNCHER, "serve", bad, "--port", free_port()])
    assert p.wait(timeout=30) == 2
    out = p.output()
    assert "broken.gguf" in out
    assert "restarting cannot help" in out


def test_missing_model_path(spawn, tmp_path):
    p = spawn([WORKER, tmp_path / "nope", "--listen", f"tcp://127.0.0.1:{free_port_pair()}"])
    assert p.wait(timeout=30) == 2
    assert "nope" in p.output()


def test_bad_yaml_config_names_key_and_file(spawn, tmp_path, demo_model):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("port: 8123\ntensor-parallel-sise: 2\n")
    p = spawn([LAUNCHER, "serve", demo_model, "--config", cfg])
    assert p.wait(timeout=30) == 2
    out = p.output()
    assert str(cfg) in out and "tensor-parallel-sise" in out


def test_yaml_config_is_honoured(spawn, tmp_path, demo_model):
    port = free_port()
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"host: 127.0.0.1\nport: {port}\nserved-model-name: from-yaml\nmax_model_len: 1024\n")
    p = spawn([LAUNCHER, "serve", demo_model, "--config", cfg])
    base = f"http://127.0.0.1:{port}"
    # /health waits for the router's tokenizer too: minutes with the ASan build
    wait_until(lambda: p.p.poll() is not None or http_status(base + "/health") == 200,
               timeout=240 if SANITIZED else 60, what="/health")
    data = requests.get(base + "/v1/models", timeout=5).json()["data"]
    assert [(m["id"], m["max_model_len"]) for m in data] == [("from-yaml", 1024)]


def test_router_without_workers_is_unhealthy(spawn):
    port = free_port()
    p = spawn([ROUTER, "--host", "127.0.0.1", "--port", port])
    base = f"http://127.0.0.1:{port}"
    wait_until(lambda: http_status(base + "/health") is not None, timeout=10, what="router up")
    assert http_status(base + "/health") == 503
    assert requests.get(base + "/v1/models", timeout=5).json() == {"object": "list", "data": []}
    p.p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=15) == 0


def test_router_and_worker_started_by_hand(spawn, demo_model):
    """Two routers sharing one worker, as a multi-router deployment runs them."""
    wport = free_port_pair()
    w = spawn([WORKER, demo_model, "--listen", f"tcp://127.0.0.1:{wport}", "--served-model-name", "hand"])
    bases = []
    for _ in range(2):
        port = free_port()
        spawn([ROUTER, "--host", "127.0.0.1", "--port", port, "--worker", f"tcp://127.0.0.1:{wport}"])
        bases.append(f"http://127.0.0.1:{port}")
    for base in bases:
        wait_until(lambda: http_status(base + "/health") == 200, timeout=30, what=f"{base} healthy")
        assert requests.get(base + "/v1/models", timeout=5).json()["data"][0]["id"] == "hand"
    w.p.send_signal(signal.SIGTERM)
    assert w.wait(timeout=15) == 0
    for base in bases:
        wait_until(lambda: http_status(base + "/health") == 503, timeout=3, what=f"{base} unhealthy")


def test_help_lists_vllm_flags():
    import subprocess
    out = subprocess.run([str(LAUNCHER), "serve", "--help"], capture_output=True, text=True, timeout=10)
    assert out.returncode == 0
    for flag in ("--tensor-parallel-size", "--max-model-len", "--block-size", "--enable-prefix-caching",
                 "--served-model-name", "--api-key", "--config", "(default: 8000)"):
        assert flag in out.stdout, flag


def test_engine_stats_log_line(spawn, demo_model):
    """vLLM's periodic line, every VLLM_LOG_STATS_INTERVAL seconds, CPU-worded; gone
    with --disable-log-stats."""
    env = dict(os.environ, VLLM_LOG_STATS_INTERVAL="0.3")
    port = free_port()
    p = spawn([LAUNCHER, "serve", demo_model, "--host", "127.0.0.1", "--port", port,
               "--kv-cache-memory-bytes", "64M"], env=env)
    base = f"http://127.0.0.1:{port}"
    wait_until(lambda: http_status(base + "/health") == 200, timeout=60, what="/health")
    wait_until(lambda: requests.post(base + "/tokenize", json={"prompt": "x"}, timeout=5).status_code == 200,
               timeout=30, what="tokenizer ready")
    r = requests.post(base + "/v1/completions", json={"prompt": "Hello", "max_tokens": 24, "temperature": 0},
                      timeout=60)
    assert r.status_code == 200
    line = wait_until(lambda: next((l for l in p.output().splitlines()
                                    if "Engine 000: Avg prompt throughput:" in l and "Avg generation throughput:" in l
                                    and "KV cache usage:" in l and "Prefix cache hit rate:" in l), None),
                      timeout=10, what="stats line")
    assert " tokens/s, Running: " in line

    port2 = free_port()
    q = spawn([LAUNCHER, "serve", demo_model, "--host", "127.0.0.1", "--port", port2,
               "--kv-cache-memory-bytes", "64M", "--disable-log-stats"], env=env)
    base2 = f"http://127.0.0.1:{port2}"
    wait_until(lambda: http_status(base2 + "/health") == 200, timeout=60, what="/health")
    wait_until(lambda: requests.post(base2 + "/tokenize", json={"prompt": "x"}, timeout=5).status_code == 200,
               timeout=30, what="tokenizer ready")
    requests.post(base2 + "/v1/completions", json={"prompt": "Hello", "max_tokens": 8, "temperature": 0}, timeout=60)
    metrics = requests.get(base2 + "/metrics", timeout=5).text
    assert "vllm:" not in metrics                       # --disable-log-stats removes the vllm:* series
    assert "Engine 000:" not in q.output()


def _running(base):
    text = requests.get(base + "/metrics", timeout=5).text
    line = [l for l in text.splitlines() if l.startswith("vllm:num_requests_running{")]
    return float(line[0].rsplit(" ", 1)[1]) if line else 0.0


def _generated(base):
    text = requests.get(base + "/metrics", timeout=5).text
    line = [l for l in text.splitlines() if l.startswith("vllm:generation_tokens_total{")]
    return float(line[0].rsplit(" ", 1)[1]) if line else 0.0


def _serve_ready(serve):
    s = serve("--served-model-name", "smol", "--kv-cache-memory-bytes", "64M")
    wait_until(lambda: requests.post(s.base + "/tokenize", json={"prompt": "x"}, timeout=5).status_code == 200,
               timeout=30, what="tokenizer ready")
    return s


def test_worker_killed_mid_request_non_stream_gets_502(serve):
    """The only worker dies after tokens were produced: the request ends at once with a
    502 and vLLM's error body, no hang; the supervisor brings the worker back."""
    import threading
    s = _serve_ready(serve)
    out = {}

    def call():
        out["r"] = requests.post(s.base + "/v1/completions", json={
            "model": "smol", "prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True,
            "temperature": 0}, timeout=60)
    t = threading.Thread(target=call)
    t.start()
    wait_until(lambda: _running(s.base) >= 1 and _generated(s.base) >= 4, timeout=20,
               what="request producing tokens on the worker")
    os.kill(s.worker_pid(), signal.SIGKILL)
    t.join(timeout=15)
    assert not t.is_alive(), "the request hung after its worker died"
    r = out["r"]
    assert r.status_code == 502
    err = r.json()["error"]
    assert err["code"] == 502 and err["type"] == "BadGatewayError" and "worker" in err["message"]
    wait_until(lambda: http_status(s.base + "/health") == 200, timeout=30, what="worker restarted")


def test_worker_killed_mid_stream_ends_with_error_event(serve):
    s = _serve_ready(serve)
    with requests.post(s.base + "/v1/completions", json={"model": "smol", "prompt": "Once upon a time",
                                                         "max_tokens": 2000, "ignore_eos": True, "stream": True},
                       stream=True, timeout=60) as r:
        events = []
        for line in r.iter_lines():
            if not line:
                continue
            events.append(line)
            if len(events) == 3:
                os.kill(s.worker_pid(), signal.SIGKILL)
            if line == b"data: [DONE]":
                break
    assert events[-1] == b"data: [DONE]"
    err = json.loads(events[-2][6:])["error"]
    assert err["code"] == 502 and "worker" in err["message"]


@pytest.mark.slow_under_sanitizers
def test_sigterm_lets_inflight_streams_finish(serve):
    """SIGTERM to `tessera serve` mid-stream: the router stops accepting but the stream
    it is serving runs to its end ([DONE], finish_reason length); then everything exits 0."""
    s = _serve_ready(serve)
    kids = [s.worker_pid(), s.router_pid()]
    with requests.post(s.base + "/v1/completions", json={"model": "smol", "prompt": "Once upon a time",
                                                         "max_tokens": 24, "ignore_eos": True, "stream": True,
                                                         "temperature": 0}, stream=True, timeout=60) as r:
        events = []
        for line in r.iter_lines():
            if not line:
                continue
            events.append(line)
            if len(events) == 2:
                s.proc.p.send_signal(signal.SIGTERM)
    assert events[-1] == b"data: [DONE]"
    bodies = [json.loads(e[6:]) for e in events[:-1]]
    assert bodies[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(1 for b in bodies if b["choices"][0]["text"]) >= 20   # the whole answer came
    assert s.proc.wait(timeout=30) == 0
    for pid in kids:
        wait_until(lambda: not pid_alive(pid), timeout=5, what=f"child {pid} gone")
