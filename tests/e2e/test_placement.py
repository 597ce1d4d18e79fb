"""Placement: with two workers, the kv routing policy sends repeats of a prompt to the
worker whose prefix cache holds it (the router mirrors each worker's cached block
hashes from its Status events).  Visible from outside only through
usage.prompt_tokens_details.cached_tokens: a repeat hits the cache only if it lands
where the first one ran."""
import re
import time

import requests

from conftest import ROUTER, WORKER, free_port, free_port_pair, wait_until, wait_workers_live

PARAGRAPH = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a "
    "small brass lamp and a notebook in which he recorded the colour of the sky, the "
    "direction of the wind, and the names of the ships that passed beyond the reef. "
    "Over forty years the notebooks filled three shelves in the cottage below, and "
    "nobody but the keeper had ever read a single page of them."
)
OTHER = (
    "In the mountain village the baker rose long before the sun, kneading dough by the "
    "light of a single candle while the river outside ran loud with melted snow. Her "
    "bread was famous across the valley, and travellers would walk for hours along the "
    "narrow path just to buy one warm loaf before it sold out at noon. On feast days "
    "she baked twice as much and still the shelves were empty by the time the bells rang."
)


def start_cluster(spawn, demo_model, *router_flags):
    workers = []
    for _ in range(2):
        port = free_port_pair()
        spawn([WORKER, demo_model, "--listen", f"tcp://127.0.0.1:{port}",
               "--kv-cache-memory-bytes", "256M"])
        workers.append(f"tcp://127.0.0.1:{port}")
    http = free_port()
    args = [ROUTER, "--host", "127.0.0.1", "--port", http, "--enable-prompt-tokens-details", *router_flags]
    for w in workers:
        args += ["--worker", w]
    router = spawn(args)
    base = f"http://127.0.0.1:{http}"

    wait_workers_live(router, base, 2)
    return base


def complete(base, prompt):
    r = requests.post(base + "/v1/completions", timeout=60, json={
        "model": requests.get(base + "/v1/models", timeout=5).json()["data"][0]["id"],
        "prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    return usage["prompt_tokens"], (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def settled(base):
    """The router has the Status that followed the last Output: nothing running (so
    the finished request's blocks no longer count as active) and its STORED events
    applied.  Polled, because on a loaded machine a Status can lag well past its 100 ms."""
    def idle():
        text = requests.get(base + "/metrics", timeout=5).text
        return re.search(r'^vllm:num_requests_running\{[^}]*\} 0(\.0)?$', text, re.M)
    wait_until(idle, timeout=10, interval=0.05, what="workers idle at the router")
    time.sleep(0.15)   # one more Status interval: the events ride with or before it


def test_kv_policy_repeats_hit_the_cache(spawn, demo_model):
    base = start_cluster(spawn, demo_model)
    n_prompt, cached = complete(base, PARAGRAPH)
    assert n_prompt >= 64
    assert cached == 0
    for _ in range(6):
        settled(base)
        n, cached = complete(base, PARAGRAPH)
        assert n == n_prompt
        assert cached > 0, "a repeat missed the cache: it went to the other worker"
    # another prompt family: goes wherever the cost says, and succeeds
    for _ in range(3):
        time.sleep(0.3)
        n, cached = complete(base, OTHER)
        assert n >= 64
    text = requests.get(base + "/metrics", timeout=5).text
    assert re.search(r'^tessera:placement_decisions(_total)?\{[^}]*policy="kv"[^}]*\} 10(\.0)?$', text, re.M), \
        [l for l in text.splitlines() if "placement" in l]


def test_round_robin_policy_serves(spawn, demo_model):
    base = start_cluster(spawn, demo_model, "--routing-policy", "round_robin")
    for _ in range(4):
        n, _cached = complete(base, PARAGRAPH)
        assert n >= 64
    text = requests.get(base + "/metrics", timeout=5).text
    assert 'policy="round_robin"' in text


def test_worker_dns_discovers_workers(spawn, demo_model):
    """--worker-dns NAME:PORT: the router resolves the name (here localhost, from
    /etc/hosts) and routes to the worker at that address; a bad spec is a config error."""
    port = free_port_pair()
    spawn([WORKER, demo_model, "--listen", f"tcp://127.0.0.1:{port}", "--kv-cache-memory-bytes", "256M"])
    http = free_port()
    router = spawn([ROUTER, "--host", "127.0.0.1", "--port", http, "--worker-dns", f"localhost:{port}"])
    base = f"http://127.0.0.1:{http}"

    def healthy():
        assert router.p.poll() is None, router.output()
        try:   # /health 200: live, and its tokenizer loaded at the router
            return requests.get(base + "/health", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    wait_until(healthy, timeout=90, interval=0.1, what="the DNS-discovered worker live at the router")
    n, _cached = complete(base, PARAGRAPH)
    assert n >= 64
    assert f"new worker tcp://127.0.0.1:{port}" in router.output()

    bad = spawn([ROUTER, "--host", "127.0.0.1", "--port", free_port(), "--worker-dns", "localhost"])
    assert bad.wait(30) == 2
    assert "--worker-dns localhost: expected NAME:PORT" in bad.output()


def test_late_router_gets_a_prefix_snapshot(spawn, demo_model):
    """A router that joins after a worker has cached blocks does not see them in the
    Status events (they were published before it subscribed): it asks the worker for
    a snapshot (proto Resync) and places a repeat of the prompt there at once.
    Without the snapshot its mirrors are empty, the costs tie, and the rotation sends
    the first request to the first listed worker, which holds nothing."""
    ports, workers = [], []
    for _ in range(2):
        port = free_port_pair()
        workers.append(spawn([WORKER, demo_model, "--listen", f"tcp://127.0.0.1:{port}",
                              "--kv-cache-memory-bytes", "256M"]))
        ports.append(port)
    holder, empty = ports

    def router(*worker_ports):
        http = free_port()
        args = [ROUTER, "--host", "127.0.0.1", "--port", http, "--enable-prompt-tokens-details"]
        for p in worker_ports:
            args += ["--worker", f"tcp://127.0.0.1:{p}"]
        proc, base = spawn(args), f"http://127.0.0.1:{http}"

        def ready():
            assert proc.p.poll() is None, proc.output()
            try:
                text = requests.get(base + "/metrics", timeout=2).text
                ok = requests.post(base + "/tokenize", json={"prompt": "x"}, timeout=2).status_code == 200
            except requests.RequestException:
                return False
            return ok and len(re.findall(r'^tessera:worker_up\{[^}]*\} 1(\.0)?$', text, re.M)) == len(worker_ports)
        wait_until(ready, timeout=90, interval=0.1, what="workers live at the router")
        return proc, base

    _, first = router(holder)
    n, cached = complete(first, PARAGRAPH)
    assert n >= 64 and cached == 0
    settled(first)
    late, base = router(empty, holder)          # the worker holding the blocks is listed second
    wait_until(lambda: workers[0].output().count("asks for a prefix-cache snapshot") >= 2, timeout=30,
               what="the late router's Resync at the worker holding the blocks")
    settled(base)
    n2, cached = complete(base, PARAGRAPH)
    assert n2 == n
    assert cached >= 64, "the late router placed the repeat on the worker without the blocks"
