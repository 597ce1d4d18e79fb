#!/usr/bin/env python3
"""Shared-prefix traffic straight into tessera-worker, token ids in and out (no router, no
tokenizer: for models whose vocabulary has no tokenizer of its own, such as the random
checkpoints of tests/fixtures/make_bench_models.py), for comparing worker flags.

vLLM's prefix_repetition shape: --num-prefixes prefixes of --prefix-len random ids, each
prompt one of them plus --suffix-len random ids, --output-len tokens each (greedy,
ignore_eos), at most --concurrency in flight.  Each configuration (--flags A, --flags B,
...) runs on a fresh worker, alternated --rounds times; per run it prints the duration,
output tok/s, TTFT (submit to first token) mean / median / p99 and the prompt tokens read
from the prefix cache.

    .venv/bin/python scripts/bench-worker-prefix.py /tmp/bm/nemotron_h \\
        --flags "--cpu-threads 2" --flags "--cpu-threads 2 --enable-prefix-caching"
"""
import argparse
import random
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "e2e"))
from conftest import Proc  # noqa: E402
from engine_client import EngineWorker  # noqa: E402


def workload(args, vocab):
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(3, vocab) for _ in range(args.prefix_len)] for _ in range(args.num_prefixes)]
    return [prefixes[i % args.num_prefixes] + [rng.randrange(3, vocab) for _ in range(args.suffix_len)]
            for i in range(args.num_prompts)]


def run_once(args, flags, prompts, log_dir):
    procs = []

    def spawn(argv, env=None):
        procs.append(Proc(argv, Path(log_dir) / f"worker{len(procs)}.log", env=env))
        return procs[-1]

    w = EngineWorker(spawn, args.model, *shlex.split(flags))
    try:
        sent, first, done = {}, {}, {}
        queue = list(enumerate(prompts))
        t0 = time.monotonic()
        while len(done) < len(prompts):
            while queue and len(sent) - len(done) < args.concurrency:
                i, p = queue.pop(0)
                w.submit(f"r{i}", p, args.output_len)
                sent[i] = time.monotonic()
            w.pump(5)
            now = time.monotonic()
            for i in sent:
                r = w.results[f"r{i}"]
                if r.error:
                    sys.exit(f"request {i} refused: {r.error}")
                if i not in first and r.tokens:
                    first[i] = now
                if i not in done and r.done:
                    done[i] = now
        dt = time.monotonic() - t0
        ttft = sorted((first[i] - sent[i]) * 1e3 for i in sent)
        cached = sum(w.results[f"r{i}"].cached for i in sent)
        return {"s": dt, "tok/s": len(prompts) * args.output_len / dt, "ttft_mean": statistics.mean(ttft),
                "ttft_p50": statistics.median(ttft), "ttft_p99": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
                "cached": cached}
    finally:
        w.close()
        for p in procs:
            p.kill_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--flags", action="append", required=True, help="worker flags of one configuration")
    ap.add_argument("--prefix-len", type=int, default=512)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--num-prefixes", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=32768, help="ids are drawn below this (the model's vocab)")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"# {cpu}; {args.num_prompts} prompts = {args.num_prefixes} prefixes x {args.prefix_len} + "
          f"{args.suffix_len}, {args.output_len} out, concurrency {args.concurrency}")
    prompts = workload(args, args.vocab)
    with tempfile.TemporaryDirectory() as log_dir:
        for rnd in range(args.rounds):
            for flags in args.flags:
                r = run_once(args, flags, prompts, log_dir)
                print(f"round {rnd + 1} [{flags}]: {r['s']:.2f} s, {r['tok/s']:.1f} out tok/s, TTFT mean "
                      f"{r['ttft_mean']:.1f} / p50 {r['ttft_p50']:.1f} / p99 {r['ttft_p99']:.1f} ms, "
                      f"cached {r['cached']} prompt tokens", flush=True)


if __name__ == "__main__":
    main()
