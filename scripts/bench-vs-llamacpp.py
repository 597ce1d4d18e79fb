#!/usr/bin/env python3
"""Tessera against llama.cpp's llama-server on the same GGUF, side by side (issue #21).

  scripts/bench-vs-llamacpp.py [--concurrency 1,8,32] [--rounds 2] [--threads 2]
                               [--input-len 128] [--output-len 128] [--prompts-per-client 8]

Builds llama-server from the llama.cpp that the llama-cpp-python sdist on PyPI vendors
(version pinned below; sources and build under .cache/llama.cpp/, never in git), starts
it and `tessera serve` on the same file with the same thread count, and measures both
with the same client (`tessera bench serve`, random dataset, ignore_eos, streamed
completions), interleaved: for each round and concurrency, Tessera then llama.cpp, on
the same prompts, which no earlier cell used (both servers cache prompts).
Prints the table with ratios and the CPU it ran on.  A benchmark, not a test.

Environment: TESSERA_BUILD (default build/), TESSERA_TEST_MODEL (default the demo GGUF,
SmolLM2-135M-Instruct Q4_1), EXTRA_TESSERA_FLAGS (e.g. "--dtype bfloat16"), EXTRA_LLAMA_FLAGS (llama-server's, e.g. "--no-repack")."""
import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[1]
BUILD = Path(os.environ.get("TESSERA_BUILD", REPO / "build"))
MODEL = Path(os.environ.get("TESSERA_TEST_MODEL", REPO / ".cache" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
CACHE = REPO / ".cache" / "llama.cpp"
LLAMA_CPP_PYTHON = "0.3.36"      # the sdist whose vendor/llama.cpp is built
sys.path.insert(0, str(REPO / "scripts"))
from free_port import free_port  # noqa: E402


def cpu_line():
    info = Path("/proc/cpuinfo").read_text()
    model = re.search(r"^model name\s*:\s*(.*)$", info, re.M)
    flags = set(re.search(r"^flags\s*:\s*(.*)$", info, re.M).group(1).split())
    isa = [f for f in ("avx2", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16") if f in flags]
    return f"{model.group(1) if model else '?'}; {os.cpu_count()} logical CPUs; {' '.join(isa)}"


def build_llama_server():
    """The llama-server binary, built once into .cache/llama.cpp/build."""
    server = CACHE / "build" / "bin" / "llama-server"
    if server.exists():
        return server
    CACHE.mkdir(parents=True, exist_ok=True)
    sdist = CACHE / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not sdist.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(CACHE)], check=True)
    src = CACHE / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    if not src.exists():
        with tarfile.open(sdist) as t:
            t.extractall(CACHE, filter="data")
    subprocess.run(["cmake", "-S", str(src), "-B", str(CACHE / "build"), "-DCMAKE_BUILD_TYPE=Release",
                    "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_EXAMPLES=OFF"], check=True)
    subprocess.run(["cmake", "--build", str(CACHE / "build"), "--target", "llama-server", f"-j{os.cpu_count()}"],
                   check=True)
    return server


class Server:
    def __init__(self, name, args, port, log):
        self.name, self.port = name, port
        self.log = open(log, "wb")
        self.p = subprocess.Popen([str(a) for a in args], stdout=self.log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert self.p.poll() is None, f"{name} exited; see {log}"
            try:
                if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise SystemExit(f"{name} not healthy after 180 s; see {log}")

    def stop(self):
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGTERM)
            try:
                self.p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait()


def bench(server, model_name, c, args, out_dir, tag, seed):
    n = max(c * args.prompts_per_client, 8)
    fname = f"{tag}.json"
    cmd = [BUILD / "deploy" / "tessera", "bench", "serve", "--backend", "openai", "--host", "127.0.0.1",
           "--port", server.port, "--model", model_name, "--tokenizer", MODEL, "--dataset-name", "random",
           "--random-input-len", args.input_len, "--random-output-len", args.output_len, "--ignore-eos",
           "--num-prompts", n, "--max-concurrency", c, "--seed", seed, "--disable-tqdm", "--save-result",
           "--result-dir", out_dir, "--result-filename", fname]
    r = subprocess.run([str(a) for a in cmd], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"bench against {server.name} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return json.loads((Path(out_dir) / fname).read_text())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--prompts-per-client", type=int, default=8)
    args = ap.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    if not MODEL.exists():
        raise SystemExit(f"{MODEL} not found: run scripts/setup.sh (it fetches the demo model)")
    server_bin = build_llama_server()
    slots = max(levels)
    ctx_per_slot = args.input_len + args.output_len + 64
    out_dir = tempfile.mkdtemp(prefix="bench-vs-llamacpp-")
    tp, lp = free_port(), free_port()
    extra = shlex.split(os.environ.get("EXTRA_TESSERA_FLAGS", ""))
    # e.g. EXTRA_LLAMA_FLAGS=--no-repack where llama.cpp's AMX-INT8 kernels fault (a VM
    # whose tiles ggml does not get configured: SIGILL on tilezero, 2026-11-28)
    extra_llama = shlex.split(os.environ.get("EXTRA_LLAMA_FLAGS", ""))
    tessera = Server("tessera", [BUILD / "deploy" / "tessera", "serve", MODEL, "--host", "127.0.0.1", "--port", tp,
                                 "--served-model-name", "smol", "--cpu-threads", args.threads,
                                 "--max-num-seqs", slots, "--disable-log-requests", *extra],
                     tp, Path(out_dir) / "tessera.log")
    llama = None
    try:
        llama = Server("llama.cpp", [server_bin, "-m", MODEL, "--host", "127.0.0.1", "--port", lp, "-t", args.threads,
                                     "-tb", args.threads, "--parallel", slots, "-c", slots * ctx_per_slot,
                                     "--alias", "smol", "--no-webui", *extra_llama],
                       lp, Path(out_dir) / "llama-server.log")
        rows = {}
        for rnd in range(args.rounds):
            for c in levels:
                for srv in (tessera, llama):
                    # Fresh prompts in every cell (both servers cache prompts: a repeated
                    # prompt would measure the cache, not the prefill); the same ones for both.
                    seed = 1 + rnd * len(levels) + levels.index(c)
                    res = bench(srv, "smol", c, args, out_dir, f"{srv.name}-c{c}-r{rnd}", seed)
                    rows.setdefault((c, srv.name), []).append(res)
                    print(f"round {rnd + 1} c={c} {srv.name}: {res['output_throughput']:.1f} out tok/s, "
                          f"TTFT p50 {res['median_ttft_ms']:.1f} ms, TPOT p50 {res['median_tpot_ms']:.2f} ms, "
                          f"failed {res['failed']}", flush=True)
    finally:
        tessera.stop()
        if llama:
            llama.stop()

    print(f"\nCPU: {cpu_line()}; {args.threads} threads each; random {args.input_len} in / {args.output_len} out, "
          f"ignore_eos; llama.cpp from llama-cpp-python {LLAMA_CPP_PYTHON}; model {MODEL.name}; "
          f"best of {args.rounds} interleaved rounds")
    print("\n| concurrency | Tessera out tok/s | llama.cpp out tok/s | ratio | Tessera TTFT / TPOT p50 (ms) | "
          "llama.cpp TTFT / TPOT p50 (ms) |\n|---|---|---|---|---|---|")
    for c in levels:
        t = max(rows[(c, "tessera")], key=lambda r: r["output_throughput"])
        ll = max(rows[(c, "llama.cpp")], key=lambda r: r["output_throughput"])
        print(f"| {c} | {t['output_throughput']:.1f} | {ll['output_throughput']:.1f} | "
              f"{t['output_throughput'] / ll['output_throughput']:.2f}x | {t['median_ttft_ms']:.1f} / "
              f"{t['median_tpot_ms']:.2f} | {ll['median_ttft_ms']:.1f} / {ll['median_tpot_ms']:.2f} |")
    print(f"\nlogs and JSON results: {out_dir}")


if __name__ == "__main__":
    main()
