"""Compare two lm-eval runs sample by sample (their --log_samples output).

    python tests/lm_eval/compare.py OUT_A OUT_B [--tolerance 1e-3]

OUT_A and OUT_B are the --output_path folders of two runs of the same tasks with the
same --limit (e.g. Tessera through local-completions and transformers through the hf
model).  For every task found in both, and every (doc_id, filter) pair:
  * generate_until: counts the raw generations that are identical, and the
    filtered answers that are identical; prints the first differences.
  * loglikelihood / multiple_choice / loglikelihood_rolling: the largest absolute
    difference in log-likelihood over all (document, choice) pairs, how many are within
    the tolerance, and how many is_greedy flags and argmax choices agree.
Exit status 0 always: this reports, the reader judges (docs/accuracy.md)."""
import argparse
import glob
import json
import os
import sys


def latest_samples(folder):
    """task name -> list of sample records, from the newest samples_*.jsonl per task."""
    found = {}
    for path in sorted(glob.glob(os.path.join(folder, "**", "samples_*.jsonl"),
                                 recursive=True), key=os.path.getmtime):
        task = os.path.basename(path)[len("samples_"):].rsplit("_", 1)[0]
        found[task] = path
    samples = {}
    for task, path in found.items():
        with open(path, encoding="utf-8") as handle:
            samples[task] = [json.loads(line) for line in handle if line.strip()]
    return samples


def keyed(records):
    return {(record["doc_id"], record.get("filter", "none")): record for record in records}


def is_generation(record):
    """generate_until requests carry their generation kwargs (a dict) as the second
    argument; loglikelihood ones a continuation string, rolling ones nothing."""
    return isinstance(record["arguments"]["gen_args_0"].get("arg_1"), dict)


def loglikelihoods(record):
    """[(loglikelihood, is_greedy or None)] for each request of one document.  lm-eval
    logs the values as strings ("-4.52", "False")."""
    values = []
    for response in record["resps"]:
        first = response[0]
        if isinstance(first, (list, tuple)):
            values.append((float(first[0]), str(first[1]) == "True"))
        else:
            values.append((float(first), None))
    return values


def compare_generations(name, a, b, show):
    same_raw = same_filtered = total = 0
    shown = 0
    for key in sorted(a):
        if key not in b:
            continue
        total += 1
        raw_a, raw_b = a[key]["resps"][0][0], b[key]["resps"][0][0]
        if raw_a == raw_b:
            same_raw += 1
        if a[key]["filtered_resps"] == b[key]["filtered_resps"]:
            same_filtered += 1
        elif shown < show:
            shown += 1
            print(f"  doc {key[0]} filter {key[1]}: filtered {a[key]['filtered_resps']!r}"
                  f" vs {b[key]['filtered_resps']!r}")
        if raw_a != raw_b and shown < show:
            shown += 1
            prefix = os.path.commonprefix([raw_a, raw_b])
            print(f"  doc {key[0]} filter {key[1]}: raw texts part after {len(prefix)} "
                  f"equal characters: {raw_a[len(prefix):len(prefix) + 60]!r} vs "
                  f"{raw_b[len(prefix):len(prefix) + 60]!r}")
    print(f"{name}: generations identical {same_raw}/{total}, "
          f"filtered answers identical {same_filtered}/{total} ((doc, filter) pairs)")


def compare_loglikelihoods(name, a, b, tolerance, show):
    worst = worst_relative = 0.0
    within = total = greedy_same = greedy_total = argmax_same = choice_docs = 0
    shown = 0
    for key in sorted(a):
        if key not in b:
            continue
        values_a, values_b = loglikelihoods(a[key]), loglikelihoods(b[key])
        if len(values_a) > 1:
            choice_docs += 1
            best_a = max(range(len(values_a)), key=lambda i: values_a[i][0])
            best_b = max(range(len(values_b)), key=lambda i: values_b[i][0])
            argmax_same += best_a == best_b
        for (ll_a, greedy_a), (ll_b, greedy_b) in zip(values_a, values_b):
            total += 1
            difference = abs(ll_a - ll_b)
            worst = max(worst, difference)
            worst_relative = max(worst_relative, difference / max(abs(ll_b), 1e-30))
            if difference <= tolerance:
                within += 1
            elif shown < show:
                shown += 1
                print(f"  doc {key[0]}: {ll_a:.6f} vs {ll_b:.6f} (diff {difference:.2e})")
            if greedy_a is not None:
                greedy_total += 1
                greedy_same += greedy_a == greedy_b
    line = (f"{name}: {within}/{total} log-likelihoods within {tolerance:g}, "
            f"largest difference {worst:.3e} (relative {worst_relative:.1e})")
    if greedy_total:
        line += f", is_greedy equal {greedy_same}/{greedy_total}"
    if choice_docs:
        line += f", same chosen answer {argmax_same}/{choice_docs}"
    print(line)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_a")
    parser.add_argument("run_b")
    parser.add_argument("--tolerance", type=float, default=1e-3)
    parser.add_argument("--show", type=int, default=5, help="differences to print per task")
    args = parser.parse_args()
    runs_a, runs_b = latest_samples(args.run_a), latest_samples(args.run_b)
    common = sorted(set(runs_a) & set(runs_b))
    if not common:
        print(f"no task has samples in both {args.run_a} and {args.run_b}", file=sys.stderr)
        return 1
    for task in common:
        a, b = keyed(runs_a[task]), keyed(runs_b[task])
        if is_generation(next(iter(a.values()))):
            compare_generations(task, a, b, args.show)
        else:
            compare_loglikelihoods(task, a, b, args.tolerance, args.show)
    return 0


if __name__ == "__main__":
    sys.exit(main())
