"""A rolling restart of the workers behind one router under a 32-client streaming load
loses no request: each worker in turn gets SIGTERM (what systemd's stop and a
Kubernetes pod deletion send), drains (new Submits refused as retryable, so the router
places them on the other worker; admitted ones finish within --shutdown-timeout),
exits 0, is started again and serves again before the next one goes.  Every stream the
clients open must end with a finish_reason and no error.

The drain must outlast the longest request in flight: a stream that has produced
tokens cannot move to another worker, so whatever is still running at the end of
--shutdown-timeout ends with finish_reason "abort".  On this 2-core shared machine 32
streams of 24 tokens on one worker took longer than 30 s and 30 of them were aborted;
hence 120 s here, and the same rule for TimeoutStopSec / terminationGracePeriodSeconds
in production (docs/deployment.md)."""
import os
import signal
import threading
import time

import pytest
from openai import OpenAI

from conftest import ROUTER, WORKER, free_port, free_port_pair, http_status, wait_until

pytestmark = pytest.mark.slow_under_sanitizers

CLIENTS = 32


def metric(base, name):
    import requests
    text = requests.get(base + "/metrics", timeout=5).text
    return [line for line in text.splitlines() if line.startswith(name)]


def test_rolling_restart_of_two_workers_loses_nothing(spawn, demo_model):
    ports = [free_port_pair(), free_port_pair()]

    def start_worker(i):
        return spawn([WORKER, demo_model, "--listen", f"tcp://127.0.0.1:{ports[i]}", "--shutdown-timeout", "120",
                      "--kv-cache-memory-bytes", "512MiB"])

    workers = [start_worker(0), start_worker(1)]
    rport = free_port()
    spawn([ROUTER, *sum((["--worker", f"tcp://127.0.0.1:{p}"] for p in ports), []), "--host", "127.0.0.1",
           "--port", rport])
    base = f"http://127.0.0.1:{rport}"

    def seen(i):
        """The router's view of worker i (GET /admin/workers), {} before its first Status."""
        import requests
        data = requests.get(base + "/admin/workers", timeout=5).json()["data"]
        return next((w for w in data if w["worker"] == f"tcp://127.0.0.1:{ports[i]}"), {})

    def serving(i, not_epoch=None):
        """Worker i is live and ready, and (not_epoch) is a process started after that
        boot epoch: a restarted worker's endpoint may still read live from the old
        process's last Status for up to a second (CI once stopped worker 1 while worker
        0's replacement was not yet listening, and 5 streams had nowhere to go)."""
        w = seen(i)
        return w.get("live") and w.get("state") == "ready" and w.get("boot_epoch") not in (None, not_epoch)

    def up(i):
        return any(f'worker="tcp://127.0.0.1:{ports[i]}"}} 1' in line for line in metric(base, "tessera:worker_up"))

    wait_until(lambda: http_status(base + "/health") == 200 and serving(0) and serving(1) and up(0) and up(1),
               timeout=90, what="both workers up")
    client = OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=120)
    model = client.models.list().data[0].id

    stop = threading.Event()
    done, failures = [0], []
    lock = threading.Lock()

    def one(i):
        while not stop.is_set():
            try:
                finish = None
                for chunk in client.completions.create(model=model, prompt=f"Client {i} says", max_tokens=12,
                                                       temperature=0, stream=True):
                    if chunk.choices and chunk.choices[0].finish_reason:
                        finish = chunk.choices[0].finish_reason
                with lock:
                    if finish in ("length", "stop"):
                        done[0] += 1
                    else:
                        failures.append(f"client {i}: stream ended with finish_reason {finish!r}")
            except Exception as e:    # noqa: BLE001  (every failure is the finding)
                with lock:
                    failures.append(f"client {i}: {e!r}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: done[0] >= CLIENTS, timeout=120, what="the load running")
        for i in (0, 1):
            before = done[0]
            epoch = seen(i)["boot_epoch"]
            os.kill(workers[i].pid, signal.SIGTERM)
            assert workers[i].wait(timeout=60) == 0, workers[i].output()[-3000:]
            # the other worker carries the whole load meanwhile
            wait_until(lambda: done[0] >= before + CLIENTS, timeout=120, what=f"load served while worker {i} is away")
            workers[i] = start_worker(i)
            wait_until(lambda: serving(i, not_epoch=epoch) and up(i), timeout=90, what=f"worker {i} back")
        before = done[0]
        wait_until(lambda: done[0] >= before + CLIENTS, timeout=120, what="load after the restarts")
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=180)
    assert not failures, f"{len(failures)} failed of {done[0] + len(failures)}:\n" + "\n".join(failures[:10])
    assert done[0] >= 4 * CLIENTS
