#!/usr/bin/env python3
"""Sum the results of every suite into one closing line: "N passed, N failed, N skipped".

Arguments are NAME=PATH[:RC] pairs; RC is the exit status of the command that ran the
suite.
- PATH ending in .json: a meson test log (one JSON object per line).  A cmocka binary
  counts each of its cases (its "[  PASSED  ] N test(s)" lines); any other test counts
  once.  A binary that failed without a cmocka summary (crash, sanitizer abort,
  timeout) counts as one failure.
- PATH ending in .xml: a JUnit report (pytest).
- PATH ending in .txt: one failure per non-empty line (set-up steps that failed: a
  build, a download); an empty file is no failure.
A missing or unreadable log, a suite that ran no test, and a non-zero RC with no failure
counted each count as one failure: a suite that did not run did not pass.

Skips: each must carry a reason key ("[skip:KEY] ...", tests/skips.py) that is allowed
on this machine; any other skip is counted as a failure and listed.  Exit status 1 if
anything failed.
"""
import json
import re
import sys
import xml.etree.ElementTree as ET
from collections import Counter

import skips

CMOCKA = {
    "passed": re.compile(r"^\[  PASSED  \] (\d+) test", re.M),
    "failed": re.compile(r"^\[  FAILED  \] (\d+) test", re.M),
    "skipped": re.compile(r"^\[  SKIPPED \] (\d+) test", re.M),
}
RUN = re.compile(r"^\[ RUN      \] (\S+)")
CASE_SKIPPED = re.compile(r"^\[  SKIPPED \] (\S+)$")
GROUP_START = re.compile(r"^\[==========\] (?:tests: )?Running ")
GROUP_END = re.compile(r"^\[==========\] (?:tests: )?\d+ test\(s\) run")


class Suite:
    def __init__(self, name):
        self.name = name
        self.counts = Counter(passed=0, failed=0, skipped=0)
        self.failures = []
        self.skips = []         # (test, key or None, message)

    def skip(self, test, message):
        self.skips.append((test, skips.key_of(message), message.strip()))


def cmocka_skips(out):
    """(case, the text it printed) for each skipped cmocka case of one binary's output."""
    found, current, text, in_group = [], None, [], False
    for line in out.splitlines():
        if GROUP_START.match(line):
            in_group, current = True, None
        elif GROUP_END.match(line):
            in_group, current = False, None
        elif not in_group:
            continue
        elif m := RUN.match(line):
            current, text = m.group(1), []
        elif (m := CASE_SKIPPED.match(line)) and m.group(1) == current:
            found.append((current, "\n".join(text)))
            current = None
        elif current:
            text.append(line)
    return found


def read_meson(path, s):
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            t = json.loads(line)
            out = (t.get("stdout") or "") + "\n" + (t.get("stderr") or "")
            found = {k: sum(int(n) for n in rx.findall(out)) for k, rx in CMOCKA.items()}
            result = t.get("result", "")
            if any(found.values()):
                s.counts.update(found)
                cases = cmocka_skips(out)
                for case, text in cases:
                    s.skip(f'{t["name"]}::{case}', text)
                if len(cases) != found["skipped"]:      # a skip we cannot check is not allowed
                    s.counts["skipped"] -= found["skipped"] - len(cases)
                    s.counts["failed"] += found["skipped"] - len(cases)
                    s.failures.append(f'{t["name"]}: {found["skipped"]} skips, {len(cases)} found in its output')
                if result not in ("OK", "SKIP") and found["failed"] == 0:
                    s.counts["failed"] += 1       # e.g. a leak report after all cases passed
                    s.failures.append(f'{t["name"]} ({result} after its cases passed)')
                elif found["failed"]:
                    s.failures.append(t["name"])
            elif result == "OK":
                s.counts["passed"] += 1
            elif result == "SKIP":
                s.counts["skipped"] += 1
                s.skip(t["name"], out)
            else:
                s.counts["failed"] += 1
                why = meson_why(out)
                s.failures.append(f'{t["name"]} ({result})' + (f": {why}" if why else ""))


# The lines of a failed non-cmocka test (a fuzz target's run_fuzz.sh, a script) that say
# why: the sanitizer's or libFuzzer's verdict, the runner's last word, and the input.
WHY_LINE = re.compile(r"SUMMARY: |ERROR: |FINDING|fails again|^input \(base64\)")


def meson_why(out, limit=1500):
    lines = [ln.strip() for ln in out.splitlines() if WHY_LINE.search(ln.strip())]
    text = " | ".join(dict.fromkeys(lines))     # once each, in order
    return text[:limit] + ("..." if len(text) > limit else "")


def why_failed(elem, limit=600):
    """The failure's message on one line, cut to LIMIT characters: CI keeps only the tail
    of the output, so the closing lines must say why, not just what, failed."""
    text = " ".join((elem.get("message") or elem.text or "").split())
    return text[:limit] + ("..." if len(text) > limit else "")


def read_junit(path, s):
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    for suite in suites:
        for case in suite.iter("testcase"):
            name = f'{case.get("classname")}::{case.get("name")}'
            sk = case.find("skipped")
            bad = case.find("failure")
            if bad is None:
                bad = case.find("error")
            if bad is not None:
                s.counts["failed"] += 1
                s.failures.append(f"{name}: {why_failed(bad)}")
            elif sk is not None:
                s.counts["skipped"] += 1
                s.skip(name, (sk.get("message") or "") + "\n" + (sk.text or ""))
            else:
                s.counts["passed"] += 1


def read_list(path, s):
    with open(path) as f:
        for line in f:
            if line.strip():
                s.counts["failed"] += 1
                s.failures.append(line.strip())


def summarize(arg):
    name, _, spec = arg.partition("=")
    path, rc = spec, None
    if re.search(r":-?\d+$", spec):
        path, _, rc_text = spec.rpartition(":")
        rc = int(rc_text)
    s = Suite(name)
    reader = read_junit if path.endswith(".xml") else read_list if path.endswith(".txt") else read_meson
    try:
        reader(path, s)
    except (OSError, ValueError, ET.ParseError) as e:
        s.counts["failed"] += 1
        s.failures.append(f"{path}: {e}")
        return s
    if reader is not read_list and sum(s.counts.values()) == 0:
        s.counts["failed"] += 1
        s.failures.append(f"{path}: the suite ran no test")
    elif rc and s.counts["failed"] == 0:
        s.counts["failed"] += 1
        s.failures.append(f"its command exited {rc} with no failing test counted")
    return s


def main(argv):
    total = Counter(passed=0, failed=0, skipped=0)
    for arg in argv:
        s = summarize(arg)
        allowed_skips = []
        for test, key, message in s.skips:
            ok, why = skips.allowed(key) if key else (False, "no [skip:KEY] reason")
            if ok:
                allowed_skips.append(f"{test}: [{key}] {why}")
            else:
                s.counts["skipped"] -= 1
                s.counts["failed"] += 1
                lines = [ln for ln in message.splitlines() if ln.strip()] or [""]
                said = next((ln for ln in lines if skips.TAG.search(ln)), lines[-1])
                s.failures.append(f"{test} skipped, not allowed here ({why}): {said.strip()[:300]}")
        total.update(s.counts)
        print(f'{s.name}: {s.counts["passed"]} passed, {s.counts["failed"]} failed, '
              f'{s.counts["skipped"]} skipped')
        for f in s.failures:
            print(f"  FAILED {s.name}: {f}")
        for a in allowed_skips:
            print(f"  skipped {s.name}: {a}")
    print(f'{total["passed"]} passed, {total["failed"]} failed, {total["skipped"]} skipped')
    return 1 if total["failed"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
