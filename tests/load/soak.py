#!/usr/bin/env python3
"""soak.py - a keep-alive soak of a live router + worker: N completions over a few
persistent connections, with the router's and the worker's RSS and open fd counts read
from /proc after a warm-up and at the end.  tests/e2e/test_load.py runs it with
N = 2,000; run it by hand for the 10,000 of docs/testing.md:

    TESSERA_BUILD=$PWD/build .venv/bin/python tests/load/soak.py --requests 10000

It starts its own `tessera serve` on the demo model (or uses --base URL with --router-pid
and --worker-pid) and prints one JSON line of numbers."""
import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))


def rss_kb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


def fd_count(pid):
    import os
    return len(os.listdir(f"/proc/{pid}/fd"))


def sample(pids):
    return {name: {"rss_kb": rss_kb(pid), "fds": fd_count(pid)} for name, pid in pids.items()}


def run_requests(base, n, connections, errors):
    """n completions split over `connections` keep-alive sessions (one thread each)."""
    def one_connection(count):
        with requests.Session() as s:
            for i in range(count):
                try:
                    r = s.post(base + "/v1/completions",
                               json={"prompt": f"Count {i}:", "max_tokens": 1, "temperature": 0}, timeout=120)
                    if r.status_code != 200 or r.json()["usage"]["completion_tokens"] != 1:
                        errors.append((r.status_code, r.text[:200]))
                except requests.RequestException as e:
                    errors.append(("exception", str(e)))

    per = [n // connections + (1 if i < n % connections else 0) for i in range(connections)]
    threads = [threading.Thread(target=one_connection, args=(c,)) for c in per]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


# The server flags of a soak: a KV pool small enough that the warm-up touches all of it
# (the worker's pool is allocated up front but its pages become resident as blocks are
# first used, which would read as growth), and a Status interval that tolerates a loaded
# machine (the router declares a worker down after 3 missed intervals).
SERVE_FLAGS = ("--num-gpu-blocks-override", "288", "--status-interval-ms", "1000")
# The warm-up the test uses: measured on the 10,000-request soak (docs/testing.md), the
# worker's RSS rises for the first 500-1,500 requests (KV pages touched for the first
# time, scratch buffers growing to their batch sizes) and is flat from there on; after a
# 300-request warm-up it was still 11% below its plateau.
TEST_WARMUP = 1000


def soak(base, pids, n, warmup, connections=4, report_every=0):
    """Warm up, sample, run n requests, wait for the connections to close, sample again.
    report_every > 0: a progress line (requests done, RSS, fds) on stderr that often."""
    errors = []
    run_requests(base, warmup, connections, errors)
    before = settle(pids)
    t0 = time.monotonic()
    done = 0
    step = report_every if report_every > 0 else n
    while done < n:
        k = min(step, n - done)
        run_requests(base, k, connections, errors)
        done += k
        if report_every > 0:
            print(json.dumps({"done": done, "seconds": round(time.monotonic() - t0, 1), "errors": len(errors),
                              **sample(pids)}), file=sys.stderr, flush=True)
    elapsed = time.monotonic() - t0
    after = settle(pids, target_fds={k: v["fds"] for k, v in before.items()})
    return {"requests": n, "warmup": warmup, "connections": connections, "seconds": round(elapsed, 1),
            "requests_per_s": round(n / elapsed, 1), "errors": len(errors), "first_errors": errors[:3],
            "before": before, "after": after,
            "rss_drift": {k: round(after[k]["rss_kb"] / before[k]["rss_kb"] - 1.0, 4) for k in pids}}


def settle(pids, target_fds=None, timeout=30.0):
    """Sample once the fd counts are back to `target_fds` (closed connections linger for
    a moment in the router), or after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        s = sample(pids)
        if target_fds is None or all(s[k]["fds"] <= target_fds[k] for k in pids) or time.monotonic() > deadline:
            return s
        time.sleep(0.1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=10000)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--report-every", type=int, default=1000)
    ap.add_argument("--connections", type=int, default=4)
    ap.add_argument("--base")
    ap.add_argument("--router-pid", type=int)
    ap.add_argument("--worker-pid", type=int)
    args = ap.parse_args()
    proc = None
    if args.base:
        base, pids = args.base, {"router": args.router_pid, "worker": args.worker_pid}
    else:
        from conftest import DEMO_MODEL
        from hostile import start_served
        served, proc = start_served(tempfile.mkdtemp(prefix="soak-"), DEMO_MODEL, *SERVE_FLAGS)
        base, pids = served.base, {"router": served.router_pid(), "worker": served.worker_pid()}
    try:
        print(json.dumps(soak(base, pids, args.requests, args.warmup, args.connections, args.report_every)))
    finally:
        if proc:
            proc.kill_group()


if __name__ == "__main__":
    main()
