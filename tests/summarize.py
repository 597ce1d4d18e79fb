#!/usr/bin/env python3
"""Sum the results of every suite into one closing line: "N passed, N failed, N skipped".

Arguments are NAME=PATH pairs.  A PATH ending in .json is a meson test log (one JSON
object per line): a cmocka binary counts each of its test cases (read from its
"[  PASSED  ] N test(s)" / "[  FAILED  ] N test(s)" / "[  SKIPPED ] N test(s)" lines);
any other test counts once.  A binary that failed without a cmocka summary (crash,
sanitizer abort, timeout) counts as one failure.  A PATH ending in .xml is a JUnit
report (pytest).  A missing file counts as one failure: a suite that did not run did
not pass.  Exit status 1 if anything failed.
"""
import json
import re
import sys
import xml.etree.ElementTree as ET

CMOCKA = {
    "passed": re.compile(r"^\[  PASSED  \] (\d+) test", re.M),
    "failed": re.compile(r"^\[  FAILED  \] (\d+) test", re.M),
    "skipped": re.compile(r"^\[  SKIPPED \] (\d+) test", re.M),
}


def meson_counts(path):
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failures = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            t = json.loads(line)
            out = (t.get("stdout") or "") + "\n" + (t.get("stderr") or "")
            found = {k: sum(int(n) for n in rx.findall(out)) for k, rx in CMOCKA.items()}
            result = t.get("result", "")
            if any(found.values()):
                for k in counts:
                    counts[k] += found[k]
                if result not in ("OK", "SKIP") and found["failed"] == 0:
                    counts["failed"] += 1       # e.g. a leak report after all cases passed
                    failures.append(t["name"])
                elif found["failed"]:
                    failures.append(t["name"])
            elif result == "OK":
                counts["passed"] += 1
            elif result == "SKIP":
                counts["skipped"] += 1
            else:
                counts["failed"] += 1
                failures.append(f'{t["name"]} ({result})')
    return counts, failures


def junit_counts(path):
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failures = []
    for s in suites:
        for case in s.iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                counts["failed"] += 1
                failures.append(f'{case.get("classname")}::{case.get("name")}')
            elif case.find("skipped") is not None:
                counts["skipped"] += 1
            else:
                counts["passed"] += 1
    return counts, failures


def main(argv):
    total = {"passed": 0, "failed": 0, "skipped": 0}
    for arg in argv:
        name, _, path = arg.partition("=")
        try:
            counts, failures = (junit_counts if path.endswith(".xml") else meson_counts)(path)
        except (OSError, ValueError, ET.ParseError) as e:
            counts, failures = {"passed": 0, "failed": 1, "skipped": 0}, [f"{path}: {e}"]
        for k in total:
            total[k] += counts[k]
        print(f'{name}: {counts["passed"]} passed, {counts["failed"]} failed, {counts["skipped"]} skipped')
        for f in failures:
            print(f"  FAILED {name}: {f}")
    print(f'{total["passed"]} passed, {total["failed"]} failed, {total["skipped"]} skipped')
    return 1 if total["failed"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
