#!/usr/bin/env python3
"""What a replica over two nodes costs per step (issue #20): the same model served four
ways, measured with the same client, interleaved round by round.

  scripts/bench-multinode.py [--rounds 2] [--namespaces] [--micro] [--kinds K,...]
                             [--chunk N] [--prefill-len L] [--temperature T]

  pp1        tessera serve MODEL                              (one process, one stage)
  pp2        tessera serve MODEL -pp 2                        (one process, two rank threads)
  nodes      node 0 + node 1 (--headless) on loopback         (two processes, -pp 2 --nnodes 2)
  netns      the same two nodes in two network namespaces joined by a veth pair (root;
             --namespaces), the client in node 0's namespace

Each configuration gets every CPU (--cpu-threads unset): the stages of a step run one
after the other (no micro-batches), so a two-stage step computes what one stage does
and adds the hand-over.  --micro adds pipeline micro-batches (TESSERA_PP_MAX_IN_FLIGHT=2:
two steps in the stages at once): pp2-micro (one process), nodes-micro (two nodes, every
CPU each), and nodes-1t / nodes-1t-micro (two nodes with --cpu-threads 1 each: a core of
their own, one step at a time and two).  Per configuration: decode at concurrency 1 (median TPOT) and
32 (output tokens/s, median TPOT), and a 512-token prefill (median TTFT), with
`tessera bench serve` (random prompts, ignore_eos).  Prints one table per round and the
CPU.  A benchmark, not a test; nothing here is asserted.

--kinds runs only those configurations; --chunk N serves with --max-num-batched-tokens N
(a prompt longer than N is prefilled in chunks, which micro-batches pipeline: chunk k+1
enters stage 0 while chunk k is in stage 1) and --prefill-len L sets the prefill row's
prompt length; --temperature goes to every request (0: greedy, whose rows the last node
sends back as their token; without it the server's default applies).

Environment: TESSERA_BUILD (default build/), TESSERA_TEST_MODEL (default the demo GGUF)."""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[1]
BUILD = Path(os.environ.get("TESSERA_BUILD", REPO / "build"))
MODEL = Path(os.environ.get("TESSERA_TEST_MODEL", REPO / ".cache" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
LAUNCHER = BUILD / "deploy" / "tessera"
COMMON = ["--served-model-name", "m", "--max-model-len", "2048", "--kv-cache-memory-bytes", "256M",
          "--disable-log-stats"]
sys.path.insert(0, str(REPO / "scripts"))
from free_port import free_port  # noqa: E402


def ns_prefix(ns):
    return ["ip", "netns", "exec", ns] if ns else []


def start(args, log, env=None):
    return subprocess.Popen([str(a) for a in args], stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env=dict(os.environ, **(env or {})))


def stop(procs):
    for p in procs:
        try:
            os.killpg(p.pid, 15)
        except ProcessLookupError:
            pass
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)


def wait_healthy(port, ns, procs, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise SystemExit("a server exited before it was ready")
        if ns:
            r = subprocess.run([*ns_prefix(ns), "curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
                                f"http://127.0.0.1:{port}/health"], capture_output=True, text=True)
            if r.stdout == "200":
                return
        else:
            try:
                if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
        time.sleep(0.2)
    raise SystemExit("not ready in time")


def serve(kind, tmp, namespaces, common):
    """Start configuration `kind`; (port, namespace of the client, processes)."""
    port, mp = free_port(), free_port()
    log = open(Path(tmp) / f"{kind}.log", "ab")
    http = ["--host", "127.0.0.1", "--port", port]
    env = {"TESSERA_PP_MAX_IN_FLIGHT": "2" if kind.endswith("-micro") else "1"}    # explicit: nodes default to 2
    threads = ["--cpu-threads", "1"] if "-1t" in kind else []
    if kind.split("-")[0] in ("pp1", "pp2"):
        procs = [start([LAUNCHER, "serve", MODEL, *http, *common, *(["-pp", "2"] if kind != "pp1" else [])], log,
                       env)]
        wait_healthy(port, None, procs)
        return port, None, procs
    ns = namespaces if kind == "netns" else (None, None)
    master = "10.214.1.1" if kind == "netns" else "127.0.0.1"
    nodes = ["-pp", "2", "--nnodes", "2", "--master-addr", master, "--master-port", mp, *threads]
    f = start([*ns_prefix(ns[1]), LAUNCHER, "serve", MODEL, *common, *nodes, "--node-rank", "1", "--headless"], log)
    lead = start([*ns_prefix(ns[0]), LAUNCHER, "serve", MODEL, *http, *common, *nodes], log, env)
    wait_healthy(port, ns[0], [f, lead])
    return port, ns[0], [lead, f]


def bench(port, ns, tmp, tag, conc, n, inp, out, seed, temperature=None):
    fname = f"{tag}.json"
    cmd = [*ns_prefix(ns), LAUNCHER, "bench", "serve", "--backend", "openai", "--host", "127.0.0.1", "--port", port,
           "--model", "m", "--tokenizer", MODEL, "--dataset-name", "random", "--random-input-len", inp,
           "--random-output-len", out, "--ignore-eos", "--num-prompts", n, "--max-concurrency", conc, "--seed", seed,
           "--disable-tqdm", "--save-result", "--result-dir", tmp, "--result-filename", fname,
           *(["--temperature", temperature] if temperature is not None else [])]
    r = subprocess.run([str(a) for a in cmd], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"bench {tag} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return json.loads((Path(tmp) / fname).read_text())


def namespaces_up():
    ns = (f"tsr-bm{os.getpid() % 10000}-0", f"tsr-bm{os.getpid() % 10000}-1")
    dev = (f"tsrb{os.getpid() % 10000}a", f"tsrb{os.getpid() % 10000}b")

    def ip(*a):
        subprocess.run(["ip", *a], check=True, capture_output=True)
    for n in ns:
        ip("netns", "add", n)
    ip("link", "add", dev[0], "netns", ns[0], "type", "veth", "peer", "name", dev[1], "netns", ns[1])
    for n, d, a in ((ns[0], dev[0], "10.214.1.1"), (ns[1], dev[1], "10.214.1.2")):
        ip("-n", n, "addr", "add", f"{a}/30", "dev", d)
        ip("-n", n, "link", "set", d, "up")
        ip("-n", n, "link", "set", "lo", "up")
    return ns


def namespaces_down(ns):
    for n in ns:
        subprocess.run(["ip", "netns", "del", n], capture_output=True)


def cpu_name():
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "?"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--namespaces", action="store_true", help="also two nodes in network namespaces (root)")
    ap.add_argument("--micro", action="store_true", help="also pipeline micro-batches (TESSERA_PP_MAX_IN_FLIGHT=2)")
    ap.add_argument("--kinds", help="only these configurations (comma-separated, from the list above)")
    ap.add_argument("--chunk", type=int, help="--max-num-batched-tokens for every server")
    ap.add_argument("--prefill-len", type=int, default=512, help="the prefill row's prompt tokens (default 512)")
    ap.add_argument("--temperature", help="every request's temperature (default: the server's)")
    args = ap.parse_args()
    kinds = ["pp1", "pp2", "nodes"] + (["netns"] if args.namespaces else [])
    if args.micro:
        kinds += ["pp2-micro", "nodes-micro", "nodes-1t", "nodes-1t-micro"]
    if args.kinds:
        kinds = args.kinds.split(",")
    common = COMMON + (["--max-num-batched-tokens", str(args.chunk)] if args.chunk else [])
    ns = namespaces_up() if args.namespaces else None
    flags = [f for f in ("avx512_vnni", "avx512_bf16", "amx_int8") if f in Path("/proc/cpuinfo").read_text()]
    print(f"CPU: {cpu_name()}, {os.cpu_count()} threads, {' '.join(flags) or 'avx2'}; model {MODEL.name}"
          f"{f'; --max-num-batched-tokens {args.chunk}' if args.chunk else ''}"
          f"{f'; --temperature {args.temperature}' if args.temperature is not None else ''}")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for rnd in range(args.rounds):
                print(f"\nround {rnd + 1}\n| configuration | c=1 TPOT ms | c=32 out tok/s | c=32 TPOT ms | "
                      f"prefill {args.prefill_len} TTFT ms |\n|---|---|---|---|---|")
                order = kinds if rnd % 2 == 0 else kinds[::-1]
                rows = {}
                for kind in order:
                    port, cns, procs = serve(kind, tmp, ns, common)
                    try:
                        seed = 1000 * rnd
                        t = args.temperature
                        bench(port, cns, tmp, f"{kind}-w{rnd}", 1, 2, 32, 8, seed + 1, t)        # warm-up
                        c1 = bench(port, cns, tmp, f"{kind}-c1-{rnd}", 1, 4, 128, 64, seed + 2, t)
                        c32 = bench(port, cns, tmp, f"{kind}-c32-{rnd}", 32, 32, 128, 64, seed + 3, t)
                        pf = bench(port, cns, tmp, f"{kind}-pf-{rnd}", 1, 4, args.prefill_len, 1, seed + 4, t)
                    finally:
                        stop(procs)
                    rows[kind] = (c1["median_tpot_ms"], c32["output_throughput"], c32["median_tpot_ms"],
                                  pf["median_ttft_ms"])
                for kind in kinds:
                    a, b, c, d = rows[kind]
                    print(f"| {kind} | {a:.2f} | {b:.1f} | {c:.2f} | {d:.1f} |")
    finally:
        if ns:
            namespaces_down(ns)


if __name__ == "__main__":
    main()
