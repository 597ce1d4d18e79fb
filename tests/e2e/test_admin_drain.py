"""The router drains a worker on request (POST /admin/workers/drain): the worker stops
taking new requests, finishes the streams it runs, and reports DRAINING; the router
(and every other router, from the same Status) places new requests on the others.
GET /admin/workers shows each worker's state and when a drained one has nothing left
("drained": the moment to restart it).  Both paths sit behind --api-key like /v1."""
import threading

import pytest
import requests
from openai import OpenAI

from conftest import ROUTER, WORKER, free_port, free_port_pair, http_status, wait_until

pytestmark = pytest.mark.slow_under_sanitizers

KEY = "admin-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def workers(base):
    r = requests.get(base + "/admin/workers", headers=AUTH, timeout=5)
    assert r.status_code == 200, r.text
    return {w["worker"]: w for w in r.json()["data"]}


def test_drain_one_of_two_workers_under_load(spawn, demo_model):
    ports = [free_port_pair(), free_port_pair()]
    eps = [f"tcp://127.0.0.1:{p}" for p in ports]
    for p in ports:
        spawn([WORKER, demo_model, "--listen", f"tcp://127.0.0.1:{p}", "--kv-cache-memory-bytes", "256MiB"])
    rport = free_port()
    spawn([ROUTER, "--worker", eps[0], "--worker", eps[1], "--host", "127.0.0.1", "--port", rport,
           "--api-key", KEY])
    base = f"http://127.0.0.1:{rport}"
    wait_until(lambda: http_status(base + "/health") == 200 and
               all(w["live"] and w["state"] == "ready" for w in workers(base).values()) and len(workers(base)) == 2,
               timeout=90, what="both workers ready")

    # The admin paths are guarded, validated, and name what is wrong.
    assert requests.get(base + "/admin/workers", timeout=5).status_code == 401
    assert requests.post(base + "/admin/workers/drain", json={"worker": eps[0]}, timeout=5).status_code == 401
    assert requests.get(base + "/admin/workers/drain", headers=AUTH, timeout=5).status_code == 405
    r = requests.post(base + "/admin/workers/drain", headers=AUTH, data=b"[1", timeout=5)
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    r = requests.post(base + "/admin/workers/drain", headers=AUTH, json={"reason": "x"}, timeout=5)
    assert r.status_code == 400 and "worker" in r.json()["error"]["message"]
    r = requests.post(base + "/admin/workers/drain", headers=AUTH, json={"worker": "tcp://10.9.9.9:1"}, timeout=5)
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    assert r.json()["error"]["code"] == 404

    client = OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    results, lock = [], threading.Lock()

    def stream(i, max_tokens):
        try:
            finish = None
            for chunk in client.completions.create(model=model, prompt=f"Story {i}:", max_tokens=max_tokens,
                                                   temperature=0, stream=True, extra_body={"ignore_eos": True}):
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
            out = finish
        except Exception as e:    # noqa: BLE001  (every failure is the finding)
            out = repr(e)
        with lock:
            results.append(out)

    # Long streams on both workers (round robin over idle workers spreads them), then drain worker 0.
    first = [threading.Thread(target=stream, args=(i, 48)) for i in range(6)]
    for t in first:
        t.start()
    wait_until(lambda: all(w.get("num_running", 0) > 0 for w in workers(base).values()), timeout=60,
               what="streams running on both workers")
    r = requests.post(base + "/admin/workers/drain", headers=AUTH, json={"worker": eps[0], "reason": "test"},
                      timeout=5)
    assert r.status_code == 200, r.text
    assert r.json()["worker"] == eps[0] and r.json()["drain_requested"] is True
    wait_until(lambda: workers(base)[eps[0]]["state"] == "draining", timeout=10, what="worker 0 reports draining")

    # New requests while it drains: all served (by worker 1), none refused.
    second = [threading.Thread(target=stream, args=(100 + i, 8)) for i in range(6)]
    for t in second:
        t.start()
    for t in first + second:
        t.join()
    assert results == ["length"] * 12, results

    w = wait_until(lambda: workers(base)[eps[0]].get("drained") and workers(base)[eps[0]], timeout=30,
                   what="worker 0 drained")
    assert w["num_running"] == 0 and w["num_waiting"] == 0 and w["live"]
    assert workers(base)[eps[1]]["state"] == "ready"
    # It stays drained: a request now goes to worker 1 and leaves worker 0 idle.
    assert client.completions.create(model=model, prompt="After", max_tokens=4).choices[0].finish_reason == "length"
    assert workers(base)[eps[0]]["state"] == "draining"

    # Resume undoes the drain: worker 0 reports ready again and serves while worker 1 drains.
    assert requests.post(base + "/admin/workers/resume", json={"worker": eps[0]}, timeout=5).status_code == 401
    r = requests.post(base + "/admin/workers/resume", headers=AUTH, json={"worker": eps[0]}, timeout=5)
    assert r.status_code == 200, r.text
    assert r.json()["worker"] == eps[0] and r.json()["resume_requested"] is True
    wait_until(lambda: workers(base)[eps[0]]["state"] == "ready", timeout=10, what="worker 0 resumed")
    assert requests.post(base + "/admin/workers/drain", headers=AUTH, json={"worker": eps[1]},
                         timeout=5).status_code == 200
    wait_until(lambda: workers(base)[eps[1]]["state"] == "draining", timeout=10, what="worker 1 reports draining")
    for i in range(3):
        c = client.completions.create(model=model, prompt=f"Resumed {i}", max_tokens=4)
        assert c.choices[0].finish_reason == "length"
    assert workers(base)[eps[0]]["state"] == "ready" and workers(base)[eps[1]]["state"] == "draining"
    assert requests.post(base + "/admin/workers/resume", headers=AUTH, json={"worker": eps[1]},
                         timeout=5).status_code == 200
    wait_until(lambda: all(w["state"] == "ready" for w in workers(base).values()), timeout=10,
               what="both workers ready again")
