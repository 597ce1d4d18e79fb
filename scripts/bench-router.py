#!/usr/bin/env python3
"""Router at scale (issue #19): simulated worker fleets behind real routers, measured
with `tessera bench serve`.  docs/benchmarks.md, "Router at scale", shows the output.

  scripts/bench-router.py throughput   router SSE tokens/s per router core, latency added
  scripts/bench-router.py placement    4/16/64 workers x kv/round_robin/least_load x workloads
      [--prompts-per-worker N] [--kv-blocks N] [--num-prefixes N | --prefixes-per-worker N]
      [--prefix-len N] [--turns N]
      [--user-len N] [--reply-len N] [--session-prefix-len N] [--workloads a,b] [--policies a,b]
      [--dataset-replies]
      (--kv-blocks: each simulated worker's KV pool; small pools put the caches under pressure)
  scripts/bench-router.py routers      1, 2 and 4 routers sharing one fleet of 16 (each with its control)
  scripts/bench-router.py all

Environment: TESSERA_BUILD (default build), TESSERA_ROUTER (default the build's),
TESSERA_TEST_MODEL (default the demo GGUF: only its tokenizer and metadata are read).  Every process is started here and stopped
(SIGTERM, then SIGKILL) by its pid.  A benchmark, not a test: nothing is asserted."""
import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[1]
BUILD = Path(os.environ.get("TESSERA_BUILD", REPO / "build"))
MODEL = Path(os.environ.get("TESSERA_TEST_MODEL", REPO / ".cache" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
SIM = BUILD / "deploy" / "tessera-sim-worker"
# TESSERA_ROUTER: another router binary (a before/after comparison of the policy)
ROUTER = Path(os.environ.get("TESSERA_ROUTER", BUILD / "router" / "tessera-router"))
BENCH = [str(BUILD / "deploy" / "tessera"), "bench", "serve"]
sys.path.insert(0, str(REPO / "scripts"))
from free_port import free_port  # noqa: E402

# A GPU-like worker: prefill 20k tokens/s, decode step 20 ms + 0.1 ms per sequence.
GPU_LIKE = ["--sim-prefill-tokens-per-s", "20000", "--sim-decode-ms", "20", "--sim-decode-ms-per-seq", "0.1"]
WORKLOADS = {
    # a few long shared system prompts across many users (agentic / RAG)
    "prefix_repetition": ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "1024",
                          "--prefix-repetition-suffix-len", "64", "--prefix-repetition-num-prefixes", "8",
                          "--prefix-repetition-output-len", "32"],
    # chat sessions growing a history (a 256-token system prompt shared by all)
    "multi_turn": ["--dataset-name", "multi_turn", "--multi-turn-turns", "5", "--multi-turn-user-len", "96",
                   "--random-prefix-len", "256", "--random-output-len", "32"],
    # the shape of vLLM's own multi-turn benchmark (benchmarks/multi_turn,
    # generate_multi_turn.json): a 500-token prefix common to all, a ~1000-token document
    # per conversation, 6-9 user turns of 120-160 tokens, replies of 80-120 (here the
    # middle of each range, as constants)
    "multi_turn_long": ["--dataset-name", "multi_turn", "--multi-turn-turns", "7", "--multi-turn-user-len", "140",
                        "--multi-turn-session-prefix-len", "1000", "--random-prefix-len", "500",
                        "--random-output-len", "100"],
    # the control: no sharing
    "random": ["--dataset-name", "random", "--random-input-len", "1024", "--random-output-len", "32"],
}


class Proc:
    def __init__(self, args, log):
        self.log_path = log
        self.log = open(log, "wb")
        self.p = subprocess.Popen([str(a) for a in args], stdout=self.log, stderr=subprocess.STDOUT)

    def stop(self):
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self.log.close()
        return Path(self.log_path).read_text(errors="replace")

    def cpu_s(self):
        """utime + stime of the process (all threads), seconds."""
        with open(f"/proc/{self.p.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Fleet:
    """n simulated workers and one router per entry of `policies`, all on loopback."""

    def __init__(self, tmp, n, policies, sim_flags, router_threads=1):
        self.tmp, self.workers, self.routers, self.bases = tmp, [], [], []
        eps = []
        for i in range(n):
            port = free_port(2)
            eps.append(f"tcp://127.0.0.1:{port}")
            self.workers.append(Proc([SIM, MODEL, "--listen", eps[-1], "--disable-log-stats", *sim_flags],
                                     tmp / f"w{i}.log"))
        for k, policy in enumerate(policies):
            http = free_port()
            args = [ROUTER, "--host", "127.0.0.1", "--port", http, "--routing-policy", policy,
                    "--router-threads", router_threads, "--disable-log-requests"]
            for e in eps:
                args += ["--worker", e]
            self.routers.append(Proc(args, tmp / f"r{k}.log"))
            self.bases.append(f"http://127.0.0.1:{http}")
        deadline = time.monotonic() + 180
        for base in self.bases:
            while not self.ready(base, n):
                if time.monotonic() > deadline:
                    raise SystemExit(f"fleet of {n} not live at {base}")
                time.sleep(0.2)

    @staticmethod
    def ready(base, n):
        try:
            text = requests.get(base + "/metrics", timeout=2).text
            ok = requests.get(base + "/health", timeout=2).status_code == 200
        except requests.RequestException:
            return False
        return ok and len(re.findall(r'^tessera:worker_up\{[^}]*\} 1(\.0)?$', text, re.M)) == n

    def prefix_counters(self, base):
        text = requests.get(base + "/metrics", timeout=5).text
        get = lambda name: sum(float(v) for v in re.findall(rf'^{name}\{{[^}}]*\}} (\S+)$', text, re.M))
        return get("vllm:prefix_cache_hits_total"), get("vllm:prefix_cache_queries_total")

    def stop(self):
        for r in self.routers:
            r.stop()
        sampled = []
        for w in self.workers:
            m = re.search(r"(\d+) tokens sampled", w.stop())
            sampled.append(int(m.group(1)) if m else 0)
        return sampled


def bench(base, tmp, name, flags):
    out = tmp / f"{name}.json"
    args = [*BENCH, "--base-url", base, "--temperature", "0", "--disable-tqdm", "--save-result",
            "--result-dir", tmp, "--result-filename", out.name, "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,99", *flags]
    r = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"bench failed ({' '.join(map(str, args))}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return json.loads(out.read_text())


def imbalance(sampled):
    """max / mean of the tokens each worker sampled (1.0 = perfectly even)."""
    mean = sum(sampled) / len(sampled) if sampled else 0
    return max(sampled) / mean if mean else float("nan")


def throughput(tmp):
    print("## router throughput: zero-compute simulated workers, 1 router thread")
    fleet = Fleet(tmp, 4, ["round_robin"], ["--sim-zero-compute"])
    router = fleet.routers[0]
    try:
        for conc, prompts, out_len in ((1, 32, 256), (64, 256, 512)):
            c0 = router.cpu_s()
            res = bench(fleet.bases[0], tmp, f"tp{conc}", ["--dataset-name", "random", "--random-input-len", "32",
                                                          "--random-output-len", out_len, "--num-prompts", prompts,
                                                          "--max-concurrency", conc])
            cpu = router.cpu_s() - c0
            toks = res["total_output_tokens"]
            print(f"c={conc}: {res['completed']} requests ({prompts - res['completed']} failed), {toks} tokens in {res['duration']:.2f} s = {toks / res['duration']:.0f} tok/s; "
                  f"router CPU {cpu:.2f} s = {toks / cpu:.0f} tok/s per router core; "
                  f"TTFT p50/p99 {res['p50_ttft_ms']:.2f}/{res['p99_ttft_ms']:.2f} ms, "
                  f"ITL p50/p99 {res['p50_itl_ms']:.3f}/{res['p99_itl_ms']:.3f} ms, "
                  f"E2EL p50 {res['p50_e2el_ms']:.1f} ms", flush=True)
    finally:
        fleet.stop()


def workload_flags(workload, opts, n):
    flags = list(WORKLOADS[workload])
    prefixes = opts.num_prefixes or opts.prefixes_per_worker * n
    turns = {"--multi-turn-turns": opts.turns, "--multi-turn-user-len": opts.user_len,
             "--random-output-len": opts.reply_len}
    overrides = {"prefix_repetition": {"--prefix-repetition-num-prefixes": prefixes,
                                       "--prefix-repetition-prefix-len": opts.prefix_len},
                 "multi_turn": turns,
                 "multi_turn_long": {**turns, "--multi-turn-session-prefix-len": opts.session_prefix_len}}
    for flag, value in overrides.get(workload, {}).items():
        if value:
            flags[flags.index(flag) + 1] = str(value)
    if opts.dataset_replies and workload.startswith("multi_turn"):
        flags.append("--multi-turn-dataset-replies")
    return flags


def workload_flags_note(opts):
    set_ = {k: v for k, v in (("prefixes", opts.num_prefixes), ("prefixes per worker", opts.prefixes_per_worker), ("prefix len", opts.prefix_len),
                              ("turns", opts.turns), ("user len", opts.user_len),
                              ("session prefix len", opts.session_prefix_len),
                              ("reply len", opts.reply_len), ("dataset replies", opts.dataset_replies)) if v}
    return ", ".join(f"{k} {v}" for k, v in set_.items()) or "none"


def placement_run(tmp, n, policy, workload, tag, opts):
    # requests/s: 1.5 per worker, at most 24 (past that the 2-core machine running
    # client, router and fleet, not the placement, sets the TTFT)
    rate = min(1.5 * n, 24.0)
    prompts = opts.prompts_per_worker * n
    sim = GPU_LIKE + (["--num-gpu-blocks-override", str(opts.kv_blocks)] if opts.kv_blocks else [])
    fleet = Fleet(tmp, n, [policy], sim)
    try:
        h0, q0 = fleet.prefix_counters(fleet.bases[0])
        c0 = fleet.routers[0].cpu_s()
        res = bench(fleet.bases[0], tmp, f"{tag}-{n}-{policy}-{workload}",
                    [*workload_flags(workload, opts, n), "--num-prompts", prompts, "--request-rate", rate,
                     "--burstiness", "1.0", "--seed", "1"])
        # the router's CPU over the run: placement, the Status stream (up to 200/s per
        # busy worker), HTTP and SSE
        res["router_cpu_ms_per_request"] = 1000 * (fleet.routers[0].cpu_s() - c0) / max(res["completed"], 1)
        time.sleep(0.3)                     # the last Status with the counters
        h1, q1 = fleet.prefix_counters(fleet.bases[0])
    finally:
        sampled = fleet.stop()
    hit = (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0
    return res, hit, imbalance(sampled)


def placement(tmp, sizes, opts, tag="pl"):
    print(f"## placement quality: GPU-like simulated workers (KV blocks: {opts.kv_blocks or 'default'}), "
          f"Poisson arrivals at min(1.5 x workers, 24) req/s, {opts.prompts_per_worker} prompts per worker"
          f"; workload overrides: {workload_flags_note(opts)}; router {ROUTER}")
    print("| workers | workload | policy | TTFT p50 (ms) | TTFT p99 (ms) | hit rate | imbalance (max/mean) | "
          "router CPU ms/request |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    for n in sizes:
        for workload in opts.workloads.split(","):
            for policy in opts.policies.split(","):
                res, hit, imb = placement_run(tmp, n, policy, workload, tag, opts)
                print(f"| {n} | {workload} | {policy} | {res['p50_ttft_ms']:.1f} | {res['p99_ttft_ms']:.1f} | "
                      f"{hit:.1%} | {imb:.2f} | {res['router_cpu_ms_per_request']:.2f} |", flush=True)


def routers(tmp, n=16, same_prompts=True):
    # same_prompts: each client draws the same dataset (--seed 1): one set of 8 system
    # prompts and the same prompts at the same instants, so k clients send every prompt
    # k times at once (the worst case for routers that cannot see each other's
    # dispatches).  Otherwise client j draws --seed j+1: k independent streams.  Each
    # row with k routers (client j -> router j, as behind a load balancer) is paired
    # with a control: the same k clients all on one router, the same traffic.
    print(f"## routers sharing one fleet of {n} GPU-like simulated workers (kv), prefix_repetition, "
          f"{1.5 * n:g} req/s in all, {'the same prompts in every client' if same_prompts else 'a seed per client'}")
    for k in (1, 2, 4):
        for n_routers in ((1,) if k == 1 else (k, 1)):
            fleet = Fleet(tmp, n, ["kv"] * n_routers, GPU_LIKE)
            try:
                h0 = fleet.prefix_counters(fleet.bases[0])
                procs = []
                for j in range(k):
                    base = fleet.bases[j % n_routers]
                    out = tmp / f"rt{k}-{n_routers}-{j}.json"
                    args = [*BENCH, "--base-url", base, "--temperature", "0", "--disable-tqdm", "--save-result",
                            "--result-dir", tmp, "--result-filename", out.name, "--metric-percentiles", "50,99",
                            *WORKLOADS["prefix_repetition"], "--num-prompts", 12 * n // k,
                            "--request-rate", 1.5 * n / k, "--seed", 1 if same_prompts else j + 1]
                    procs.append((subprocess.Popen([str(a) for a in args], stdout=subprocess.DEVNULL), out))
                results = []
                for p, out in procs:
                    p.wait(timeout=1800)
                    results.append(json.loads(out.read_text()))
                time.sleep(0.3)
                h1 = fleet.prefix_counters(fleet.bases[0])
            finally:
                sampled = fleet.stop()
            hit = (h1[0] - h0[0]) / (h1[1] - h0[1]) if h1[1] > h0[1] else 0.0
            ttft = ", ".join(f"{r['p50_ttft_ms']:.1f}/{r['p99_ttft_ms']:.1f}" for r in results)
            print(f"{k} client(s) on {n_routers} router(s): TTFT p50/p99 per client (ms) {ttft}; "
                  f"fleet hit rate {hit:.1%}; imbalance {imbalance(sampled):.2f}", flush=True)


def main():
    ap = argparse.ArgumentParser(description="Router at scale benchmarks (issue #19)")
    ap.add_argument("what", nargs="?", default="all", choices=("throughput", "placement", "routers", "all"))
    ap.add_argument("sizes", nargs="?", default="4,16,64", help="fleet sizes for placement (comma list)")
    ap.add_argument("--prompts-per-worker", type=int, default=12)
    ap.add_argument("--kv-blocks", type=int, default=0, help="KV blocks per simulated worker (default: its 8192)")
    ap.add_argument("--num-prefixes", type=int, default=0, help="prefix_repetition's system prompts (default 8)")
    ap.add_argument("--prefixes-per-worker", type=int, default=0,
                    help="prefix_repetition's system prompts per worker (instead of --num-prefixes)")
    ap.add_argument("--prefix-len", type=int, default=0, help="prefix_repetition's prefix tokens (default 1024)")
    ap.add_argument("--turns", type=int, default=0, help="multi_turn's turns per session (default 5)")
    ap.add_argument("--user-len", type=int, default=0, help="multi_turn's user tokens per turn (default 96)")
    ap.add_argument("--reply-len", type=int, default=0,
                    help="multi_turn's generated tokens per turn, which the next turn resends (default 32)")
    ap.add_argument("--session-prefix-len", type=int, default=0,
                    help="multi_turn_long's document per session (default 1000)")
    ap.add_argument("--dataset-replies", action="store_true",
                    help="multi_turn resends the dataset's stand-in replies, not the generated answers")
    ap.add_argument("--workloads", default="prefix_repetition,multi_turn,random",
                    help=f"comma list of {', '.join(WORKLOADS)}")
    ap.add_argument("--policies", default="kv,round_robin,least_load")
    opts = ap.parse_args()
    what = opts.what
    sizes = tuple(int(x) for x in opts.sizes.split(","))
    for w in opts.workloads.split(","):
        if w not in WORKLOADS:
            ap.error(f"unknown workload {w} (known: {', '.join(WORKLOADS)})")
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores; build {BUILD}")
    with tempfile.TemporaryDirectory(prefix="bench-router-") as d:
        tmp = Path(d)
        if what in ("throughput", "all"):
            throughput(tmp)
        if what in ("placement", "all"):
            placement(tmp, sizes, opts)
        if what in ("routers", "all"):
            routers(tmp, same_prompts=True)
            routers(tmp, same_prompts=False)


def cpu_model():
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "?"


if __name__ == "__main__":
    main()
