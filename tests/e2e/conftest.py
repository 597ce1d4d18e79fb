"""The e2e harness: start real Tessera processes on loopback, wait on /health (no
fixed sleeps), and stop their process groups at teardown: SIGTERM first, so the
processes run their shutdown paths (and, in the sanitizer pass, LeakSanitizer), then
SIGKILL for what is still there.  A sanitizer report in a process's output fails the
test.

Environment: TESSERA_BUILD (default <repo>/build), TESSERA_TEST_MODEL (default the
demo GGUF fetched by scripts/fetch-model.sh).  A test skips only through
skip_because(KEY, why), KEY one of tests/skips.py's reasons; a test needing the demo
model skips "not-fetched" without it, which the test command counts as a failure."""
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

REPO = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("TESSERA_BUILD", REPO / "build"))
LAUNCHER = BUILD / "deploy" / "tessera"
ROUTER = BUILD / "router" / "tessera-router"
WORKER = BUILD / "worker" / "tessera-worker"
# The simulated worker (deploy/sim_worker.c): the real io and engine threads, no model.
SIM_WORKER = BUILD / "deploy" / "tessera-sim-worker"
DEMO_MODEL = Path(os.environ.get("TESSERA_TEST_MODEL",
                                 REPO / ".cache" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
FIXTURES = REPO.parent / "shared" / "fixtures"
# The ASan+UBSan binaries compute ~30x slower (the ThreadSanitizer build, build-tsan,
# slower still): tests whose timing assumptions rest on the normal build's speed (e.g.
# finishing within the router's 10 s drain) are marked `slow_under_sanitizers`, and the
# sanitizer pass deselects them (-m "not slow_under_sanitizers"): not run, not skipped.
SANITIZED = "asan" in BUILD.name or "tsan" in BUILD.name
# What a sanitizer prints when it finds something (ASan, LSan, UBSan, TSan).
SANITIZER_REPORT = re.compile(r"ERROR: (?:Address|Leak|Thread|Memory)Sanitizer|runtime error: |"
                              r"WARNING: ThreadSanitizer")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow_under_sanitizers: too slow for the ASan/TSan builds; the "
                            "sanitizer pass deselects it")


def skip_because(key, why):
    """Skip the current test for reason `key` (tests/skips.py: allowed only where the
    machine confirms it, e.g. "no-shared-fixtures" without ../shared)."""
    pytest.skip(f"[skip:{key}] {why}")


sys.path.insert(0, str(REPO / "scripts"))
from free_port import free_port  # noqa: E402  (below the ephemeral range; see scripts/free_port.py)
sys.path.insert(0, str(REPO / "tests"))
from skips import gpu_present  # noqa: E402,F401  (whether this machine has an NVIDIA device)


def free_port_pair():
    """Two consecutive free ports (a worker's requests and Status sockets)."""
    return free_port(2)


def wait_until(predicate, timeout, interval=0.02, what="condition"):
    """Poll `predicate` until it returns a truthy value; fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def wait_workers_live(router, base, n, timeout=90):
    """Wait until the router at `base` (Proc `router`) counts n live workers and is
    healthy: /health 200 too, because a worker is live before the router has built the
    model's tokenizer, and a completion in between gets 503 "still loading" (seen on a
    loaded 2-core machine)."""
    def up():
        assert router.p.poll() is None, router.output()
        try:
            text = requests.get(base + "/metrics", timeout=2).text
            healthy = requests.get(base + "/health", timeout=2).status_code == 200
        except requests.RequestException:
            return False
        return healthy and len(re.findall(r'^tessera:worker_up\{[^}]*\} 1(\.0)?$', text, re.M)) == n

    wait_until(up, timeout=timeout, interval=0.1, what=f"{n} workers live at the router")


def http_status(url, **kw):
    try:
        return requests.get(url, timeout=2, **kw).status_code
    except requests.RequestException:
        return None


def children_of(pid):
    """Direct children of `pid` (Linux /proc)."""
    kids = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                kids += [int(x) for x in f.read().split()]
    except FileNotFoundError:
        pass
    return kids


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")[0].decode(errors="replace")
    except FileNotFoundError:
        return ""


def group_alive(pgid):
    """True while a live (not zombie) process is in process group `pgid`."""
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False


def pid_alive(pid):
    """True while `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class Proc:
    """One process (and its process group) with its output in a log file."""

    def __init__(self, args, log_path, env=None):
        self.args = [str(a) for a in args]
        self.log_path = log_path
        self.log = open(log_path, "wb")
        self.p = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT,
                                  start_new_session=True, env=env)
        self.pid = self.p.pid

    def output(self):
        self.log.flush()
        return Path(self.log_path).read_text(errors="replace")

    def wait(self, timeout):
        return self.p.wait(timeout=timeout)

    def kill_group(self, grace=None):
        """Stop the process group: SIGTERM (and SIGCONT, for a stopped one), up to
        `grace` seconds for a clean exit, then SIGKILL.  Raises AssertionError when the
        output holds a sanitizer report (a leak found at exit included)."""
        if grace is None:
            grace = 60 if SANITIZED else 15
        if self.p.poll() is None:
            for sig in (signal.SIGTERM, signal.SIGCONT):
                try:
                    os.killpg(self.pid, sig)
                except ProcessLookupError:
                    pass
            try:
                self.p.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        # children (a launcher's worker and router) may outlive the leader: wait for the
        # group to empty, then SIGKILL whatever did not stop
        deadline = time.monotonic() + grace
        while group_alive(self.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.p.poll() is None:
            self.p.wait(timeout=10)
        self.log.close()
        found = SANITIZER_REPORT.search(Path(self.log_path).read_text(errors="replace"))
        if found:
            raise AssertionError(f"sanitizer report in the output of {' '.join(self.args)}:\n"
                                 + Path(self.log_path).read_text(errors="replace")[-6000:])


@pytest.fixture
def spawn(tmp_path, request):
    """spawn(args) -> Proc; every process is killed (group) at teardown, and its log
    is printed when the test failed."""
    procs = []

    def _spawn(args, env=None):
        proc = Proc(args, tmp_path / f"proc{len(procs)}.log", env=env)
        procs.append(proc)
        return proc

    yield _spawn
    reports = []
    for proc in procs:
        try:
            proc.kill_group()
        except AssertionError as e:
            reports.append(str(e))
    # the logs of a test that failed, or whose fixture did (a server that never became healthy)
    if any(getattr(getattr(request.node, "rep_" + when, None), "failed", False) for when in ("setup", "call")):
        for proc in procs:
            print(f"---- {' '.join(proc.args)}\n{Path(proc.log_path).read_text(errors='replace')[-4000:]}")
    assert not reports, "\n".join(reports)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)


@pytest.fixture(params=["worker", "sim-worker"])
def worker_binary(request):
    """The protocol conformance tests run against both the real worker and the
    simulated one, so that router benchmarks on simulated workers measure the router."""
    return WORKER if request.param == "worker" else SIM_WORKER


@pytest.fixture
def demo_model():
    if not DEMO_MODEL.exists():
        skip_because("not-fetched", f"demo model absent ({DEMO_MODEL}); scripts/fetch-model.sh fetches it")
    return DEMO_MODEL


class Served:
    def __init__(self, proc, port):
        self.proc = proc
        self.port = port
        self.base = f"http://127.0.0.1:{port}"

    def worker_pid(self):
        for pid in children_of(self.proc.pid):
            if cmdline(pid).endswith("tessera-worker"):
                return pid
        return None

    def router_pid(self):
        for pid in children_of(self.proc.pid):
            if cmdline(pid).endswith("tessera-router"):
                return pid
        return None


def serve_demo(tmp_path_factory, *flags, name="smol", kv_cache="256M"):
    """`tessera serve` of the demo model for a module-scoped fixture (served as `name`,
    2048-token context, `kv_cache` bytes of KV cache): (base URL, Proc) once healthy; the
    fixture calls proc.kill_group() at teardown."""
    if not DEMO_MODEL.exists():
        skip_because("not-fetched", f"demo model absent ({DEMO_MODEL}); scripts/fetch-model.sh fetches it")
    return serve_model(tmp_path_factory, DEMO_MODEL, "--served-model-name", name, "--max-model-len", "2048",
                       "--kv-cache-memory-bytes", kv_cache, *flags)


def serve_model(tmp_path_factory, model, *flags):
    """`tessera serve MODEL *flags` on a free port for a module-scoped fixture: (base URL,
    Proc) once /health is 200; the fixture calls proc.kill_group() at teardown."""
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    proc = Proc([LAUNCHER, "serve", model, "--host", "127.0.0.1", "--port", port, *flags], log)
    base = f"http://127.0.0.1:{port}"

    def ready():
        if proc.p.poll() is not None:
            raise AssertionError(proc.output())
        return http_status(base + "/health") == 200
    wait_until(ready, timeout=120, interval=0.1, what=f"{model} served")
    return base, proc


@pytest.fixture
def serve(spawn, demo_model):
    """serve(*extra_flags) -> Served: `tessera serve` on a free port, healthy."""

    def _serve(*flags, model=None, wait=True):
        port = free_port()
        proc = spawn([LAUNCHER, "serve", model or demo_model, "--host", "127.0.0.1",
                      "--port", port, *flags])
        served = Served(proc, port)
        if wait:
            wait_until(lambda: proc.p.poll() is not None or http_status(served.base + "/health") == 200,
                       timeout=240 if SANITIZED else 60, what="/health 200")
            assert proc.p.poll() is None, proc.output()
        return served

    return _serve


@pytest.fixture
def two_namespaces():
    """Two network namespaces joined by a veth pair (no bridge: distributed.md §7), with
    addresses 10.213.X.1 and .2, for test_doctor.py and test_multinode.py; removed
    afterwards (deleting a namespace removes its end of the pair)."""
    assert os.geteuid() == 0, "network namespaces need root (the project's machines run tests as root)"
    tag = f"{os.getpid() % 10000}"
    ns = [f"tsr-ns{tag}-0", f"tsr-ns{tag}-1"]
    sub = os.getpid() % 250 + 1
    addrs = [f"10.213.{sub}.1", f"10.213.{sub}.2"]

    def ip(*a):
        subprocess.run(["ip", *a], check=True, capture_output=True, timeout=10)
    try:
        for n in ns:
            ip("netns", "add", n)
        ip("link", "add", f"tsrd{tag}a", "netns", ns[0], "type", "veth", "peer", "name", f"tsrd{tag}b",
           "netns", ns[1])
        for n, dev, a in ((ns[0], f"tsrd{tag}a", addrs[0]), (ns[1], f"tsrd{tag}b", addrs[1])):
            ip("-n", n, "addr", "add", f"{a}/30", "dev", dev)
            ip("-n", n, "link", "set", dev, "up")
            ip("-n", n, "link", "set", "lo", "up")
        yield ns, addrs
    finally:
        for n in ns:
            subprocess.run(["ip", "netns", "del", n], capture_output=True, timeout=10)
