"""Decode tok/s of a real tessera-worker with and without --async-scheduling (a
benchmark, not a test: it prints a table and asserts nothing; docs/benchmarks.md).

    TESSERA_BUILD=$PWD/build .venv/bin/python tests/load/async_sched_bench.py \
        [--model M.gguf] [--batches 1,8,32] [--tokens 64] [--repeat 3] [-- worker flags]

For each batch B and each mode: B greedy requests (distinct 8-token prompts,
ignore_eos, --tokens each) submitted at once through the wire client of the e2e tests
(tests/e2e/engine_client.py); the clock starts when every request has its first token
(prefill done) and stops when the last one finishes: decode tok/s = tokens produced in
between / seconds.  The two modes run alternately on one worker each, best of --repeat.
"""
import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from conftest import DEMO_MODEL, Proc  # noqa: E402
from engine_client import EngineWorker  # noqa: E402


def decode_rate(w, batch, tokens, round_no):
    ids = [f"r{round_no}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        w.submit(rid, [504 + 37 * i + round_no, 2365, 6354, 16438, 28, 3 + i, 1201, 12], tokens)
    t0 = n0 = None
    while not all(w.results[r].done for r in ids):
        w.pump(1)
        if t0 is None and all(w.results[r].tokens for r in ids):
            t0, n0 = time.monotonic(), sum(len(w.results[r].tokens) for r in ids)
    t1 = time.monotonic()
    n1 = sum(len(w.results[r].tokens) for r in ids)
    assert all(w.results[r].finish == "length" for r in ids)
    return (n1 - n0) / (t1 - t0), [w.results[r].tokens for r in ids]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(DEMO_MODEL))
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("flags", nargs="*")
    a = ap.parse_args()
    batches = [int(x) for x in a.batches.split(",")]
    tmp = Path(tempfile.mkdtemp())
    procs = []

    def spawn(args, env=None):
        procs.append(Proc(args, tmp / f"w{len(procs)}.log", env=env))
        return procs[-1]

    try:
        workers = {mode: EngineWorker(spawn, a.model, *a.flags, *(["--async-scheduling"] if mode else []))
                   for mode in (False, True)}
        best = {}
        outs = {}
        round_no = 0
        for b in batches:
            for rep in range(a.repeat):
                for mode in (False, True):
                    round_no += 1
                    rate, toks = decode_rate(workers[mode], b, a.tokens, rep * 1000 + b)
                    best[(b, mode)] = max(best.get((b, mode), 0.0), rate)
                    outs.setdefault((b, rep), []).append(toks)
        same = all(v[0] == v[1] for v in outs.values())
        print(f"model {Path(a.model).name}, {a.tokens} tokens per request, best of {a.repeat}, "
              f"worker flags {' '.join(a.flags) or '(none)'}; outputs identical in both modes: {same}")
        print("| decode tok/s | synchronous | --async-scheduling | ratio |")
        print("|---|---|---|---|")
        for b in batches:
            s, x = best[(b, False)], best[(b, True)]
            print(f"| batch {b} | {s:.1f} | {x:.1f} | {x / s:.3f} |")
        for w in workers.values():
            w.close()
    finally:
        for p in procs:
            p.kill_group()
        subprocess.run(["rm", "-rf", str(tmp)])


if __name__ == "__main__":
    main()
