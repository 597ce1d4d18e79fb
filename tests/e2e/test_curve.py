"""CurveZMQ between routers and workers (--zmq-curve-secret-file/--zmq-curve-peers-file):
a router with an allowed key and the worker's public key serves completions; one with
a stranger's key, one trusting the wrong worker key, and a plain router never see the
worker live; bad key files are config errors (exit 2) naming the file."""
import os
import stat
import subprocess
import time

import requests
import zmq

from conftest import LAUNCHER, ROUTER, WORKER, free_port, free_port_pair, http_status, wait_until


def keypair(tmp_path, name):
    pub, sec = zmq.curve_keypair()
    (tmp_path / f"{name}.key").write_bytes(sec + b"\n")
    return pub.decode(), tmp_path / f"{name}.key"


def test_curve_between_router_and_worker(spawn, demo_model, tmp_path):
    assert zmq.has("curve"), "pyzmq was built without CURVE (its wheels have it)"
    # the worker's pair from `tessera curve-keygen`, the others from pyzmq
    out = subprocess.run([LAUNCHER, "curve-keygen", tmp_path / "worker"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    w_pub, w_sec = out.stdout.strip(), tmp_path / "worker.key"
    assert (tmp_path / "worker.pub").read_text().strip() == w_pub
    assert stat.S_IMODE(os.stat(w_sec).st_mode) == 0o600
    again = subprocess.run([LAUNCHER, "curve-keygen", tmp_path / "worker"], capture_output=True, text=True, timeout=30)
    assert again.returncode == 1 and "File exists" in again.stderr       # a secret is never overwritten
    r_pub, r_sec = keypair(tmp_path, "router")
    s_pub, s_sec = keypair(tmp_path, "stranger")
    (tmp_path / "allowed-routers").write_text(f"# routers allowed\n{r_pub}\n")
    (tmp_path / "trusted-workers").write_text(f"{w_pub}   # every worker\n")
    (tmp_path / "wrong-workers").write_text(f"{s_pub}\n")

    port = free_port_pair()
    worker = spawn([WORKER, demo_model, "--listen", f"tcp://127.0.0.1:{port}", "--kv-cache-memory-bytes", "256M",
                    "--zmq-curve-secret-file", w_sec, "--zmq-curve-peers-file", tmp_path / "allowed-routers"])

    def router(secret, peers):
        http = free_port()
        args = [ROUTER, "--host", "127.0.0.1", "--port", http, "--worker", f"tcp://127.0.0.1:{port}"]
        if secret:
            args += ["--zmq-curve-secret-file", secret, "--zmq-curve-peers-file", peers]
        return spawn(args), f"http://127.0.0.1:{http}"

    good, base = router(r_sec, tmp_path / "trusted-workers")

    def serving():
        assert good.p.poll() is None, good.output()
        # /health 200: the worker is live (its first Status came through the CURVE SUB
        # too, which may lag the ModelInfo) and its tokenizer is built
        return http_status(base + "/health") == 200
    wait_until(serving, timeout=90, interval=0.1, what="the worker live over CurveZMQ")
    model = requests.get(base + "/v1/models", timeout=5).json()["data"][0]["id"]
    r = requests.post(base + "/v1/completions", timeout=60,
                      json={"model": model, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    assert "CurveZMQ on" in worker.output() and "CurveZMQ on" in good.output()

    # a router whose key the worker does not list: refused by the ZAP handler
    stranger, sbase = router(s_sec, tmp_path / "trusted-workers")
    wait_until(lambda: "zmq curve: refused a client" in worker.output(), timeout=30, what="the ZAP refusal")
    # a router trusting another key as the worker's, and a plain router: no handshake
    wrong, wbase = router(r_sec, tmp_path / "wrong-workers")
    plain, pbase = router(None, None)
    t_end = time.monotonic() + 3          # the good router was live well within this
    while time.monotonic() < t_end:
        for b in (sbase, wbase, pbase):
            try:
                assert requests.get(b + "/health", timeout=2).status_code == 503
            except requests.ConnectionError:
                pass                      # not listening yet
        time.sleep(0.2)
    assert requests.post(base + "/v1/completions", timeout=60,
                         json={"model": model, "prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_bad_curve_files_are_config_errors(spawn, demo_model, tmp_path):
    _, sec = keypair(tmp_path, "k")
    bad = tmp_path / "bad.key"
    bad.write_text("not-a-key\n")
    (tmp_path / "peers").write_text("tcp://10.0.0.1:8100\n")      # an endpoint without a key
    r = spawn([ROUTER, "--port", free_port(), "--worker", "tcp://127.0.0.1:1",
               "--zmq-curve-secret-file", bad, "--zmq-curve-peers-file", tmp_path / "peers"])
    assert r.wait(30) == 2
    assert f"--zmq-curve-secret-file {bad}:1: not a 40-character Z85 secret key" in r.output()
    w = spawn([WORKER, demo_model, "--listen", f"tcp://127.0.0.1:{free_port_pair()}",
               "--zmq-curve-secret-file", sec, "--zmq-curve-peers-file", tmp_path / "peers"])
    assert w.wait(30) == 2
    assert "--zmq-curve-peers-file" in w.output() and ":1: expected a 40-character Z85 public key" in w.output()
    w = spawn([WORKER, demo_model, "--listen", f"tcp://127.0.0.1:{free_port_pair()}", "--zmq-curve-secret-file", sec])
    assert w.wait(30) == 2
    assert "go together" in w.output()
