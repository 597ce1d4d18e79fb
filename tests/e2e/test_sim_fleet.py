"""A fleet of simulated workers (tessera-sim-worker) behind real routers: placement
measured by behaviour.  Two fleets of 8, each behind its own router, get the same
shared-prefix workload in the same run (a few long system prompts, many users, in a
shuffled order); the router with --routing-policy kv (prefix-aware) must reach a
strictly higher prefix-cache hit rate than the one with round_robin.  Hits are read
from the responses' usage.prompt_tokens_details.cached_tokens, which the workers'
engines report: no timing is asserted."""
import random
import time

import pytest
import requests

from conftest import ROUTER, SIM_WORKER, free_port, free_port_pair, wait_until, wait_workers_live

N_WORKERS = 8
N_PREFIXES = 6
USERS_PER_PREFIX = 8


def words(rng, n):
    vocab = ["river", "stone", "lantern", "harbor", "meadow", "copper", "violet", "engine", "orchard",
             "signal", "thunder", "pepper", "ledger", "canyon", "velvet", "comet", "garden", "anchor"]
    return " ".join(rng.choice(vocab) for _ in range(n))


def start_fleet(spawn, model, policy):
    workers = []
    for _ in range(N_WORKERS):
        port = free_port_pair()
        spawn([SIM_WORKER, model, "--listen", f"tcp://127.0.0.1:{port}", "--sim-zero-compute",
               "--disable-log-stats"])
        workers.append(f"tcp://127.0.0.1:{port}")
    http = free_port()
    args = [ROUTER, "--host", "127.0.0.1", "--port", http, "--enable-prompt-tokens-details",
            "--routing-policy", policy]
    for w in workers:
        args += ["--worker", w]
    router = spawn(args)
    base = f"http://127.0.0.1:{http}"

    wait_workers_live(router, base, N_WORKERS, timeout=120)
    return base


def complete(base, prompt):
    r = requests.post(base + "/v1/completions", timeout=60, json={
        "model": requests.get(base + "/v1/models", timeout=5).json()["data"][0]["id"],
        "prompt": prompt, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    return usage["prompt_tokens"], (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


# The 0.25 s between requests lets each Status (100 ms) carry the last prompt's STORED
# events at the normal build's speed, not at a sanitizer's.
@pytest.mark.slow_under_sanitizers
def test_kv_policy_beats_round_robin_on_shared_prefixes(spawn, demo_model):
    rng = random.Random(19)
    systems = [f"System prompt {p}. " + words(rng, 240) for p in range(N_PREFIXES)]
    workload = [systems[p] + f"\nUser {u}: " + words(rng, 12) for p in range(N_PREFIXES)
                for u in range(USERS_PER_PREFIX)]
    rng.shuffle(workload)
    fleets = {policy: start_fleet(spawn, demo_model, policy) for policy in ("kv", "round_robin")}
    totals = {policy: [0, 0] for policy in fleets}
    for prompt in workload:
        for policy, base in fleets.items():
            n, cached = complete(base, prompt)
            totals[policy][0] += n
            totals[policy][1] += cached
        # Status (every 100 ms) carries the STORED events the kv router's mirror needs;
        # the same pause for both routers.
        time.sleep(0.25)
    rate = {policy: cached / n for policy, (n, cached) in totals.items()}
    print(f"prefix-cache hit rate: {rate}")
    assert rate["kv"] > rate["round_robin"], rate
    # Each system prompt misses once under kv: at most one miss per prefix plus the
    # per-user tails, so well over half of the prompt tokens come from the cache.
    assert rate["kv"] > 0.5, rate


def mirrors(base):
    data = requests.get(base + "/admin/workers", timeout=5).json()["data"]
    return [w["prefix_cache_mirror"] for w in data]


@pytest.mark.slow_under_sanitizers
def test_restarted_router_rebuilds_its_mirrors_from_snapshots(spawn, demo_model):
    """A kv router that restarts knows where every prefix is cached before any new
    request: it joins the workers' Status streams late, asks each for a snapshot
    (Resync), and its mirrors become exact.  Each prefix is then placed on the worker
    that holds it, and its cached tokens show it.  The prefixes come back in a rotated
    order, so tie-breaking by load alone (an empty mirror) would put each elsewhere."""
    rng = random.Random(7)
    workers = []
    for _ in range(4):
        port = free_port_pair()
        spawn([SIM_WORKER, demo_model, "--listen", f"tcp://127.0.0.1:{port}", "--sim-zero-compute",
               "--disable-log-stats"])
        workers.append(f"tcp://127.0.0.1:{port}")

    def start_router():
        http = free_port()
        args = [ROUTER, "--host", "127.0.0.1", "--port", http, "--enable-prompt-tokens-details",
                "--routing-policy", "kv"]
        for w in workers:
            args += ["--worker", w]
        router = spawn(args)
        base = f"http://127.0.0.1:{http}"
        wait_workers_live(router, base, len(workers), timeout=120)
        return router, base

    systems = [f"System prompt {p}. " + words(rng, 240) for p in range(4)]
    router, base = start_router()
    for s in systems:
        complete(base, s + "\nUser 0: " + words(rng, 12))
        time.sleep(0.25)
    wait_until(lambda: sum(m["blocks"] for m in mirrors(base)) > 0, timeout=10, what="the first router's mirrors")
    router.kill_group()

    router, base = start_router()
    wait_until(lambda: all(m["exact"] and m["blocks"] > 0 for m in mirrors(base)), timeout=30,
               what="every mirror rebuilt from a snapshot")
    for s in systems[1:] + systems[:1]:
        n, cached = complete(base, s + "\nUser 1: " + words(rng, 12))
        assert cached >= 0.8 * n, (n, cached)


def test_resent_answer_hits_the_cache(spawn, demo_model):
    """A chat client resends the simulated worker's answer in its next prompt, as text
    that the router tokenizes again.  The worker says only words that read back as the
    same ids (sim_worker.c, sim_stable_ids), so every block the answer filled is a hit,
    as it would be with a real model's answer.  The last answer token's KV is never
    computed, so the hit stops at the last full block before it.  With arbitrary ids
    the text re-tokenized differently and most answers hit none of their blocks."""
    port = free_port_pair()
    spawn([SIM_WORKER, demo_model, "--listen", f"tcp://127.0.0.1:{port}", "--sim-zero-compute",
           "--disable-log-stats"])
    http = free_port()
    router = spawn([ROUTER, "--host", "127.0.0.1", "--port", http, "--enable-prompt-tokens-details",
                    "--worker", f"tcp://127.0.0.1:{port}"])
    base = f"http://127.0.0.1:{http}"
    wait_workers_live(router, base, 1, timeout=120)
    model = requests.get(base + "/v1/models", timeout=5).json()["data"][0]["id"]
    rng = random.Random(3)
    for k in range(4):
        # odd text before the answer (digits, punctuation, a trailing space or newline)
        prompt = f"Session {k}: " + words(rng, 150) + [" 12,", " (ok)", " ", "\n"][k]
        n_prompt = requests.post(base + "/tokenize", timeout=10, json={
            "model": model, "prompt": prompt, "add_special_tokens": False}).json()["count"]
        r = requests.post(base + "/v1/completions", timeout=60, json={
            "model": model, "prompt": prompt, "max_tokens": 48, "temperature": 0})
        assert r.status_code == 200, r.text
        answer = r.json()["choices"][0]["text"]
        n, cached = complete(base, prompt + answer + "\nUser: " + words(rng, 8))
        assert cached == (n_prompt + 48 - 1) // 16 * 16, (k, n_prompt, n, cached, answer)
