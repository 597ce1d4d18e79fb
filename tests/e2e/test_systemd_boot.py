"""deploy/systemd under a real systemd (issue #18): the shipped tessera-worker and
tessera-router units, unchanged, started and stopped by systemd 252 (Debian 12's)
running as PID 1 of its own PID and mount namespaces, with every hardening setting in
force (DynamicUser, ProtectSystem=strict, the seccomp filters, DevicePolicy ...).

This machine has no systemd as PID 1, so the test boots one: `unshare --pid --mount`
makes a namespace where systemd is PID 1 (container mode, `container=` set), /run is a
fresh tmpfs holding the units under test, /usr/local/bin holds this build's binaries
(the units' ExecStart paths), /etc is an overlay whose /etc/tessera holds the configs,
and /srv/tessera-test holds the model (ProtectHome/PrivateTmp hide /home, /root, /tmp).
The network namespace is the host's, so the router's HTTP port is reached from here.
systemctl and journalctl run inside with nsenter.  Root is needed, as for the network
namespace tests; on a machine whose PID 1 is systemd the test skips (`host-systemd`,
tests/skips.py): a second systemd would share the host's cgroup hierarchies.

What it shows: Type=notify readiness (the start job returns only after READY=1, and
the worker is serving then), WATCHDOG=1 pings arriving (systemd's watchdog timestamp
moves), a hung worker (SIGSTOP) killed by the watchdog and restarted by Restart=
on-failure, a stop that drains an in-flight stream, and the processes' credentials
(a dynamic user, no capabilities, no_new_privs, a seccomp filter)."""
import json
import re
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import requests

from conftest import BUILD, DEMO_MODEL, REPO, free_port, free_port_pair, skip_because, wait_until
from skips import host_pid1

SYSTEMD = Path("/lib/systemd/systemd")
UNITS = REPO / "deploy" / "systemd"
NEEDED = ["unshare", "nsenter", "systemctl", "journalctl"]

BOOT = r"""#!/bin/bash
# Runs as PID 1 of a new PID + mount namespace, then becomes systemd.  The host's root
# file system is made read-only in this namespace, so nothing the booted systemd runs
# (systemd-tmpfiles cleaning /tmp at boot, journald's persistent journal, utmp) can
# touch the host: everything it may write is a tmpfs or an overlay of this namespace.
set -eu
T=$1; BUILD=$2; UNITS=$3; MODEL=$4
mount --make-rprivate /
mount -t proc proc /proc
# inputs first: $T is under the host's /tmp, which a tmpfs covers below
mount -t overlay overlay -o "lowerdir=/etc,upperdir=$T/etc-upper,workdir=$T/etc-work" /etc
mkdir -p /etc/tessera
cp "$T/worker.yaml" "$T/router.yaml" /etc/tessera/
for d in /run /usr/local/bin /srv /var/lib /var/log /var/cache /var/tmp; do
    mount -t tmpfs -o mode=0755 tmpfs "$d"
done
mkdir -p /run/systemd/system
cp "$UNITS"/tessera-*.service /run/systemd/system/
printf '[Unit]\nDescription=Tessera test boot\nDefaultDependencies=no\n' > /run/systemd/system/tessera-test.target
cp "$BUILD/worker/tessera-worker" "$BUILD/router/tessera-router" /usr/local/bin/
mkdir -p /srv/tessera-test
touch /srv/tessera-test/model.gguf
mount --bind "$MODEL" /srv/tessera-test/model.gguf
mount -t tmpfs -o mode=1777 tmpfs /tmp
chmod 1777 /var/tmp
mount -o remount,bind,ro /
export container=tessera-test
exec /lib/systemd/systemd --system --unit=tessera-test.target
"""


def cgroup_dirs():
    root = Path("/sys/fs/cgroup")
    return {p for h in root.iterdir() if h.is_dir() for p in h.iterdir() if p.is_dir()}


class BootedSystemd:
    def __init__(self, tmp, model):
        self.tmp = tmp
        for d in ("etc-upper", "etc-work"):
            (tmp / d).mkdir(parents=True, exist_ok=True)
        self.worker_port = free_port_pair()         # the worker binds PORT and PORT + 1 (status)
        self.http_port = free_port()
        (tmp / "worker.yaml").write_text(
            "model: /srv/tessera-test/model.gguf\n"
            f"listen: tcp://127.0.0.1:{self.worker_port}\n"
            "served-model-name: smol\nmax-model-len: 1024\nkv-cache-memory-bytes: 200000000\n")
        (tmp / "router.yaml").write_text(
            f"worker: tcp://127.0.0.1:{self.worker_port}\nhost: 127.0.0.1\nport: {self.http_port}\n"
            "served-model-name: smol\n")
        boot = tmp / "boot"
        boot.write_text(BOOT)
        boot.chmod(0o755)
        self.cgroups_before = cgroup_dirs()
        self.log = open(tmp / "boot.log", "w")
        self.unshare = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--mount", "--uts", "--ipc", "--propagation", "private",
             str(boot), str(tmp), str(BUILD), str(UNITS), str(model)],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = None
        wait_until(self._found_pid1, timeout=20, interval=0.1, what="systemd as PID 1 of the namespace")
        wait_until(lambda: self.ctl("is-system-running").stdout.strip() in ("running", "degraded"),
                   timeout=60, interval=0.2, what="systemd to finish booting tessera-test.target")

    def _found_pid1(self):
        try:
            pids = Path(f"/proc/{self.unshare.pid}/task/{self.unshare.pid}/children").read_text().split()
        except OSError:
            pids = []
        if pids and Path(f"/proc/{pids[0]}/exe").resolve() == SYSTEMD.resolve():
            self.pid = int(pids[0])
            return True
        assert self.unshare.poll() is None, (self.tmp / "boot.log").read_text()
        return False

    def run(self, *cmd, timeout=60):
        return subprocess.run(["nsenter", "-t", str(self.pid), "-m", "-p", *cmd], capture_output=True,
                              text=True, timeout=timeout)

    def ctl(self, *args, timeout=60):
        return self.run("systemctl", *args, timeout=timeout)

    def show(self, unit, *props):
        r = self.ctl("show", unit, *[f"--property={p}" for p in props])
        return dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)

    def journal(self, unit):
        return self.run("journalctl", "--no-pager", "-o", "cat", "-u", unit).stdout

    def proc_status(self, pid):
        """/proc/PID/status of a process of the namespace (PID as systemd sees it)."""
        text = self.run("cat", f"/proc/{pid}/status").stdout
        return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)

    def close(self):
        if self.pid:
            os.kill(self.pid, signal.SIGKILL)      # PID 1 of the namespace: the kernel kills the rest
        try:
            self.unshare.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.unshare.pid, signal.SIGKILL)
            self.unshare.wait(timeout=10)
        self.log.close()
        # the cgroups systemd made in the host's hierarchies (this host has no systemd of its own)
        for d in sorted(cgroup_dirs() - self.cgroups_before):
            for sub in sorted(d.rglob("*"), key=lambda p: -len(p.parts)):
                if sub.is_dir():
                    sub.rmdir()
            d.rmdir()


@pytest.fixture(scope="module")
def booted(tmp_path_factory):
    missing = [t for t in NEEDED if not shutil.which(t)]
    assert not missing and SYSTEMD.exists(), f"missing {missing or SYSTEMD}: scripts/setup.sh installs systemd"
    assert os.geteuid() == 0, "booting systemd in a namespace needs root (as the network namespace tests do)"
    if host_pid1() == "systemd":
        skip_because("host-systemd", "this machine runs systemd as PID 1: a second one beside it would share "
                     "its cgroup hierarchies")
    if not DEMO_MODEL.exists():
        skip_because("not-fetched", f"demo model absent ({DEMO_MODEL}); scripts/fetch-model.sh fetches it")
    sd = BootedSystemd(tmp_path_factory.mktemp("systemd"), DEMO_MODEL.resolve())
    try:
        yield sd
    finally:
        sd.close()


def chat(port, timeout=120):
    body = {"model": "smol", "messages": [{"role": "user", "content": "Name three colours."}],
            "max_tokens": 8, "temperature": 0}
    return requests.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=timeout)


def serves(port):
    """A chat completion through the router answers 200 (False while it cannot yet)."""
    try:
        return chat(port).status_code == 200
    except requests.RequestException:
        return False


def start(sd, unit):
    r = sd.ctl("start", unit, timeout=180)
    assert r.returncode == 0, f"systemctl start {unit}: {r.stdout}{r.stderr}\n{sd.journal(unit)[-4000:]}"


def test_worker_and_router_start_serve_and_ping(booted):
    sd = booted
    start(sd, "tessera-worker.service")
    # Type=notify: the start job ended, so READY=1 came, after the model was loaded
    w = sd.show("tessera-worker.service", "ActiveState", "SubState", "MainPID", "StatusText", "WatchdogUSec",
                "WatchdogTimestampMonotonic", "User", "NRestarts")
    assert (w["ActiveState"], w["SubState"], w["StatusText"]) == ("active", "running", "serving"), w
    assert w["WatchdogUSec"] == "1min" and w["User"] == "tessera-worker"
    log = sd.journal("tessera-worker.service")
    assert re.search(r"loaded \d+ tensors", log) and "listening on tcp://127.0.0.1:" in log, log[-3000:]
    start(sd, "tessera-router.service")
    r = sd.show("tessera-router.service", "ActiveState", "MainPID", "WatchdogUSec", "WatchdogTimestampMonotonic")
    assert r["ActiveState"] == "active" and r["WatchdogUSec"] == "10s", r
    # the router places on the worker once it has seen its ModelInfo
    wait_until(lambda: serves(sd.http_port), timeout=30, interval=0.2, what="a chat completion through the router")
    out = chat(sd.http_port).json()
    assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 8, out

    # WATCHDOG=1: the router pings every 5 s, so systemd's timestamp of the last ping moves
    t0 = int(r["WatchdogTimestampMonotonic"])
    wait_until(lambda: int(sd.show("tessera-router.service", "WatchdogTimestampMonotonic")
                           ["WatchdogTimestampMonotonic"]) > t0, timeout=15, interval=0.5,
               what="a WATCHDOG=1 from the router")

    # the hardening is in force on the running processes
    for unit, props in (("tessera-worker.service", w), ("tessera-router.service", r)):
        st = sd.proc_status(props["MainPID"])
        uid = int(st["Uid"].split()[0])
        assert uid != 0 and 61184 <= uid <= 65519, f"{unit}: not a dynamic user: {st['Uid']}"
        assert int(st["CapEff"], 16) == 0 and st["NoNewPrivs"].strip() == "1", (unit, st)
        assert st["Seccomp"].strip() == "2", f"{unit}: no seccomp filter: {st['Seccomp']}"


def test_a_hung_worker_is_killed_by_the_watchdog_and_restarted(booted):
    """SIGSTOP stands for a hung engine: no WATCHDOG=1 comes.  A drop-in shortens the
    unit's 60 s watchdog to 3 s for the test (and the abort's grace to 2 s: a stopped
    process cannot take the SIGABRT); systemd kills the worker, records `watchdog`, and
    Restart=on-failure brings it back READY; the router serves again without a restart."""
    sd = booted
    dropin = Path("/run/systemd/system/tessera-worker.service.d")
    r = sd.run("sh", "-c", f"mkdir -p {dropin} && printf '[Service]\\nWatchdogSec=3\\nTimeoutAbortSec=2\\n"
               f"RestartSec=1\\n' > {dropin}/test.conf")
    assert r.returncode == 0, r.stderr
    assert sd.ctl("daemon-reload").returncode == 0
    start(sd, "tessera-worker.service")
    assert sd.ctl("restart", "tessera-worker.service", timeout=180).returncode == 0   # the 3 s watchdog in force
    before = sd.show("tessera-worker.service", "MainPID", "NRestarts", "WatchdogUSec")
    assert before["WatchdogUSec"] == "3s", before
    sd.run("kill", "-STOP", before["MainPID"])
    wait_until(lambda: sd.show("tessera-worker.service", "NRestarts")["NRestarts"] != before["NRestarts"],
               timeout=60, interval=0.2, what="the watchdog to kill the stopped worker and a restart")
    log = sd.journal("tessera-worker.service")
    assert "Watchdog timeout" in log, log[-3000:]
    wait_until(lambda: sd.show("tessera-worker.service", "ActiveState")["ActiveState"] == "active",
               timeout=120, interval=0.2, what="the restarted worker to be READY")
    after = sd.show("tessera-worker.service", "MainPID", "NRestarts")
    assert after["MainPID"] != before["MainPID"] and int(after["NRestarts"]) == int(before["NRestarts"]) + 1
    start(sd, "tessera-router.service")
    wait_until(lambda: serves(sd.http_port), timeout=60, interval=0.2,
               what="the router serving on the restarted worker")
    sd.run("rm", "-r", str(dropin))
    assert sd.ctl("daemon-reload").returncode == 0
    assert sd.ctl("restart", "tessera-worker.service", timeout=180).returncode == 0   # the shipped settings again


def test_stop_drains_a_stream_in_flight(booted):
    """systemctl stop sends SIGTERM: the worker says STOPPING=1, lets the stream already
    generating finish (--shutdown-timeout 30), exits 0; the unit ends `success`."""
    sd = booted
    start(sd, "tessera-worker.service")
    start(sd, "tessera-router.service")
    wait_until(lambda: serves(sd.http_port), timeout=60, interval=0.2, what="serving")
    got = {}

    def stream():
        body = {"model": "smol", "messages": [{"role": "user", "content": "Tell a long story."}],
                "max_tokens": 96, "temperature": 0, "stream": True, "ignore_eos": True}
        chunks, finish = 0, None
        with requests.post(f"http://127.0.0.1:{sd.http_port}/v1/chat/completions", json=body, stream=True,
                           timeout=120) as resp:
            got["status"] = resp.status_code
            for line in resp.iter_lines(decode_unicode=True):
                if line and line.startswith("data: {"):
                    d = json.loads(line[6:])
                    for ch in d.get("choices", []):
                        chunks += bool(ch.get("delta", {}).get("content"))
                        finish = ch.get("finish_reason") or finish
                    got["first"] = got.get("first") or time.monotonic()
        got.update(chunks=chunks, finish=finish)

    th = threading.Thread(target=stream)
    th.start()
    wait_until(lambda: "first" in got, timeout=60, interval=0.05, what="the stream's first token")
    t0 = time.monotonic()
    r = sd.ctl("stop", "tessera-worker.service", timeout=120)
    stop_s = time.monotonic() - t0
    th.join(timeout=120)
    assert r.returncode == 0, r.stderr
    w = sd.show("tessera-worker.service", "ActiveState", "Result", "ExecMainStatus", "ExecMainCode")
    assert w["ActiveState"] == "inactive" and w["Result"] == "success" and w["ExecMainStatus"] == "0", w
    assert got.get("status") == 200 and got.get("finish") == "length", got
    assert stop_s < 45, f"the stop took {stop_s:.1f} s (TimeoutStopSec=45)"
    log = sd.journal("tessera-worker.service")
    assert "Stopped tessera-worker.service" in log or "Deactivated successfully" in log, log[-2000:]
    r = sd.ctl("stop", "tessera-router.service", timeout=60)
    rr = sd.show("tessera-router.service", "ActiveState", "Result", "ExecMainStatus")
    assert r.returncode == 0 and rr["Result"] == "success" and rr["ExecMainStatus"] == "0", rr


def test_a_two_node_replica_under_the_leader_and_follower_units(booted):
    """tessera-leader.service and tessera-follower.service, unchanged, as node ranks 0 and
    1 of one replica (-pp 2 over two nodes; here both nodes are this machine, so one
    /etc/tessera/node.env serves both: the leader's unit fixes --node-rank 0).  The router
    that served the single worker keeps its endpoint: the leader binds it now."""
    sd = booted
    assert sd.ctl("stop", "tessera-worker.service", timeout=120).returncode == 0
    master_port = free_port()
    conf = (f"model: /srv/tessera-test/model.gguf\nlisten: tcp://127.0.0.1:{sd.worker_port}\n"
            "served-model-name: smol\nmax-model-len: 1024\nkv-cache-memory-bytes: 128000000\n"
            "pipeline-parallel-size: 2\nmax-num-seqs: 8\n")
    env = f"NNODES=2\nNODE_RANK=1\nMASTER_ADDR=127.0.0.1\nMASTER_PORT={master_port}\n"
    r = sd.run("sh", "-c", f"printf '{conf}' > /etc/tessera/worker.yaml && printf '{env}' > /etc/tessera/node.env")
    assert r.returncode == 0, r.stderr
    # the follower waits for node 0 before it is READY: start it without waiting
    assert sd.ctl("start", "--no-block", "tessera-follower.service").returncode == 0
    start(sd, "tessera-leader.service")
    wait_until(lambda: sd.show("tessera-follower.service", "ActiveState")["ActiveState"] == "active", timeout=120,
               interval=0.2, what="the follower READY")
    start(sd, "tessera-router.service")
    wait_until(lambda: serves(sd.http_port), timeout=60, interval=0.2, what="the router serving on the replica")
    out = chat(sd.http_port).json()
    assert out["usage"]["completion_tokens"] == 8, out
    lead, follow = sd.journal("tessera-leader.service"), sd.journal("tessera-follower.service")
    assert "the 2 nodes met" in lead and "runs stage 0" in lead, lead[-3000:]
    assert "(node rank 1, headless) runs stage 1" in follow and "serving pipeline stage 1" in follow, follow[-3000:]
    for unit in ("tessera-leader.service", "tessera-follower.service"):
        st = sd.proc_status(sd.show(unit, "MainPID")["MainPID"])
        assert int(st["Uid"].split()[0]) != 0 and st["Seccomp"].strip() == "2", (unit, st)
    # node 0 first (the follower then waits for a new group), then the follower: both clean
    for unit in ("tessera-leader.service", "tessera-follower.service"):
        assert sd.ctl("stop", unit, timeout=120).returncode == 0
        u = sd.show(unit, "Result", "ExecMainStatus")
        assert u["Result"] == "success" and u["ExecMainStatus"] == "0", (unit, u, sd.journal(unit)[-2000:])
