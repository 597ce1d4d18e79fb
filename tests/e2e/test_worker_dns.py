"""--worker-dns NAME:PORT follows the name's answer both ways: an address that leaves it
for 3 lookups in a row (5 s apart) is retired and, with nothing of ours in flight
there, leaves the pool (its /metrics series included); when it comes back it is a
worker again.  A --worker at an address the name also lists is never touched.

The name is served by tests/e2e/fake_dns.c, an LD_PRELOAD getaddrinfo() that reads
its answers from a file the test rewrites; the two workers listen on 127.0.0.1 and
127.0.0.2 (both loopback on Linux) with the same port, as pods behind a headless
Service do."""
import os
import re
import time

import requests

from conftest import BUILD, ROUTER, WORKER, free_port, free_port_pair, wait_until

FAKE_DNS = BUILD / "tests" / "tsr_fake_dns.so"
NAME = "tessera-workers.test"


def worker_up(base):
    """{worker endpoint: tessera:worker_up value} from /metrics."""
    text = requests.get(base + "/metrics", timeout=5).text
    return {m[0]: float(m[1]) for m in re.findall(r'^tessera:worker_up\{worker="([^"]+)"\} (\S+)$', text, re.M)}


def test_address_leaving_the_answer_leaves_the_pool(spawn, demo_model, tmp_path):
    assert FAKE_DNS.exists(), f"{FAKE_DNS} not built (tests/meson.build)"
    port = free_port_pair()
    for ip in ("127.0.0.1", "127.0.0.2"):
        spawn([WORKER, demo_model, "--listen", f"tcp://{ip}:{port}", "--kv-cache-memory-bytes", "256M"])
    a, b = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.2:{port}"
    hosts = tmp_path / "hosts"

    def answer(*ips):
        tmp = tmp_path / "hosts.new"
        tmp.write_text(f"{NAME} {' '.join(ips)}\n")
        os.replace(tmp, hosts)   # atomic: a lookup never reads half a file

    answer("127.0.0.1", "127.0.0.2")
    env = dict(os.environ, LD_PRELOAD=str(FAKE_DNS), TSR_FAKE_DNS_FILE=str(hosts),
               # a preloaded library comes before libasan in a sanitizer build
               ASAN_OPTIONS=os.environ.get("ASAN_OPTIONS", "") + ":verify_asan_link_order=0")
    http = free_port()
    router = spawn([ROUTER, "--host", "127.0.0.1", "--port", http, "--worker", a,
                    "--worker-dns", f"{NAME}:{port}"], env=env)
    base = f"http://127.0.0.1:{http}"

    def both_up():
        assert router.p.poll() is None, router.output()
        try:
            return worker_up(base) == {a: 1.0, b: 1.0}
        except requests.RequestException:
            return False

    wait_until(both_up, timeout=90, interval=0.2, what="both workers live at the router")
    assert f"--worker-dns {NAME}:{port}: new worker {b}" in router.output()

    # b leaves the answer: it goes after 3 answers without it; a stays.
    answer("127.0.0.1")
    left = time.monotonic()
    wait_until(lambda: b not in worker_up(base), timeout=45, interval=0.2, what=f"{b} out of /metrics")
    assert time.monotonic() - left >= 9, "removed before 3 answers (5 s apart) had missed it"
    out = router.output()
    assert f"{b} missing from 3 answers in a row: retiring it" in out
    assert f"worker {b} removed from the pool" in out
    assert f"worker {a} retired" not in out
    assert worker_up(base) == {a: 1.0}
    wait_until(lambda: requests.get(base + "/health", timeout=2).status_code == 200, timeout=30,
               what="/health 200")
    model = requests.get(base + "/v1/models", timeout=5).json()["data"][0]["id"]
    r = requests.post(base + "/v1/completions", timeout=60,
                      json={"model": model, "prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text

    # b is back in the answer: a worker again within a lookup or two.
    answer("127.0.0.1", "127.0.0.2")
    wait_until(both_up, timeout=30, interval=0.2, what=f"{b} back at the router")
    assert router.output().count(f"--worker-dns {NAME}:{port}: new worker {b}") == 2
