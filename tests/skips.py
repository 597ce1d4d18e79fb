"""Why a test may skip, and whether that reason holds on this machine.

Every skip in every suite names one reason key at the start of its message,
`[skip:KEY] free text` (C: TSR_SKIP in tests/tsr_test.h, pytest: skip_because() in
tests/e2e/conftest.py, a GPU binary: that line on stdout before exit 77).  A skip is
allowed only when its key is in ALLOWED and the machine check beside it confirms the
reason: a "no GPU" skip on a machine with a GPU, a "CPU lacks AMX" skip on a CPU with
AMX, a skip without a key or with any other key (a download that failed, a tool that
is not installed) fails the run (tests/summarize.py).
"""
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED_FIXTURES = REPO.parent / "shared" / "fixtures"

TAG = re.compile(r"\[skip:([a-z0-9_:.-]+)\]")

# /proc/cpuinfo flags each ISA level of the fast CPU kernels needs (kernels/cpu/fast.c,
# kernels/cpu/amx.c pick a level only when the CPU has all of them).
ISA_FLAGS = {
    "avx2": {"avx2"},
    "avx512_bf16": {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"},
    "amx_bf16": {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_bf16", "amx_tile"},
}


def cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def gpu_present():
    """An NVIDIA device node: the driver sees a GPU here."""
    return any(Path("/dev").glob("nvidia[0-9]*"))


def host_pid1():
    try:
        return Path("/proc/1/comm").read_text().strip()
    except OSError:
        return "?"


def allowed(key):
    """(True, why) when a skip for `key` is allowed on this machine, else (False, why)."""
    if key == "no-gpu":
        return (not gpu_present(), "no NVIDIA device here" if not gpu_present()
                else "this machine has an NVIDIA device")
    if key.startswith("cpu-lacks:"):
        isa = key.split(":", 1)[1]
        need = ISA_FLAGS.get(isa)
        if need is None:
            return False, f"unknown ISA level {isa!r}"
        missing = need - cpu_flags()
        if missing:
            return True, f"the CPU lacks {' '.join(sorted(missing))}"
        return False, f"the CPU has every flag {isa} needs"
    if key == "no-shared-fixtures":
        return (not SHARED_FIXTURES.is_dir(), f"{SHARED_FIXTURES} is absent (a user's clone)"
                if not SHARED_FIXTURES.is_dir() else f"{SHARED_FIXTURES} is present")
    if key == "host-systemd":
        # test_systemd_boot.py boots its own systemd as PID 1 of a namespace, sharing the
        # host's cgroup hierarchies: only where no systemd manages them already
        pid1 = host_pid1()
        return (pid1 == "systemd", f"PID 1 of this machine is {pid1!r}")
    if key == "not-fetched":
        return False, "the test command fetches it: a failed download is a failure"
    return False, "not a reason a test may skip for"


def key_of(message):
    m = TAG.search(message or "")
    return m.group(1) if m else None
