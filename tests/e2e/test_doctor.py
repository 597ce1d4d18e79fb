"""`tessera doctor` (issue #18): the node report, and the nodes of a multi-node replica
meeting through the rendezvous (worker/parallel/bootstrap.c) and measured through the
comm layer's zmq backend: on loopback, and across two network namespaces joined by a
veth pair (two "nodes" with their own addresses, as distributed.md §7 sets them up)."""
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from conftest import BUILD, free_port

DOCTOR = BUILD / "deploy" / "tessera-doctor"
SIZES = "4096,65536,1048576"
HAVE_GPU = bool(list(Path("/dev").glob("nvidia[0-9]*")))
# what a node without a GPU says of itself (a build without the CUDA toolkit has no NCCL)
NO_GPU_HERE = ("no CUDA device on this node" if (BUILD / "worker" / "libtsr_comm_nccl.a").exists()
               else "this build has no NCCL")


def start(args, log, ns=None):
    prefix = ["ip", "netns", "exec", ns] if ns else []
    return subprocess.Popen(prefix + [str(DOCTOR), *map(str, args)], stdout=open(log, "w"),
                            stderr=subprocess.STDOUT)


def finish(proc, log, timeout=60):
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"{proc.args} did not finish within {timeout} s:\n{Path(log).read_text()}")
    return rc, Path(log).read_text()


def group(tmp_path, nnodes, ranks, extra=None, master="127.0.0.1", ns=None, timeout=20, order=None):
    """Start node ranks `ranks` (in `order`, node 0 last by default: the others must wait
    for it), each with its own --json; returns {rank: (rc, output, json or None)}."""
    port = free_port()
    procs = {}
    for r in order or sorted(ranks, reverse=True):
        args = ["--nnodes", nnodes, "--node-rank", r, "--master-addr", master, "--master-port", port,
                "--timeout", timeout, "--sizes", SIZES, "--json", tmp_path / f"n{r}.json",
                *((extra or {}).get(r, []))]
        procs[r] = start(args, tmp_path / f"n{r}.log", ns[r] if ns else None)
        time.sleep(0.2)
    out = {}
    for r, p in procs.items():
        rc, text = finish(p, tmp_path / f"n{r}.log", timeout + 30)
        j = tmp_path / f"n{r}.json"
        out[r] = (rc, text, json.loads(j.read_text()) if j.exists() else None)
    return out


def test_node_report(tmp_path):
    r = subprocess.run([str(BUILD / "deploy" / "tessera"), "doctor", "--json", str(tmp_path / "d.json")],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "doctor: OK" in r.stdout
    d = json.loads((tmp_path / "d.json").read_text())
    assert d["ok"] is True and d["nnodes"] == 1
    assert d["node"]["cores"] == os.cpu_count()
    assert d["node"]["gpus"] == len(list(Path("/dev").glob("nvidia[0-9]*")))
    flags = Path("/proc/cpuinfo").read_text()
    assert ("avx2" in d["node"]["isa"].split()) == (" avx2 " in flags)
    # the fast kernels' level follows the flags (kernels/cpu: avx2 needs avx2 + f16c + fma)
    assert d["node"]["kernel_isa"] in ("scalar", "avx2", "avx512_bf16", "amx_bf16"), d["node"]
    assert (d["node"]["kernel_isa"] == "scalar") == (" avx2 " not in flags), d["node"]
    assert f"kernels: cpu-fast at {d['node']['kernel_isa']}" in r.stdout
    # every NCCL_* variable in effect is reported, untouched
    env = dict(os.environ, NCCL_SOCKET_IFNAME="=eth9", NCCL_DEBUG="INFO")
    r = subprocess.run([str(DOCTOR), "--json", str(tmp_path / "e.json")], capture_output=True, text=True,
                       timeout=30, env=env)
    assert r.returncode == 0
    assert json.loads((tmp_path / "e.json").read_text())["node"]["nccl_env"] == {
        "NCCL_SOCKET_IFNAME": "=eth9", "NCCL_DEBUG": "INFO"}
    assert "env: NCCL_SOCKET_IFNAME==eth9" in r.stdout


def check_group(res, nnodes):
    for r, (rc, text, j) in res.items():
        assert rc == 0, f"node {r}:\n{text}"
        assert "doctor: OK, every node reached and checked" in text
        assert [n["rank"] for n in j["nodes"]] == list(range(nnodes))
        assert all(a["bitwise_ok"] for a in j["all_reduce"]) and len(j["all_reduce"]) == 3
    assert len({j["epoch"] for _, _, j in res.values()}) == 1           # one group
    for r, (_, _, j) in res.items():    # node r > 0 checked the bytes of its own link
        if r > 0:
            assert j["links"] == [{"peer": 0, "bytes_ok": True}]
    if not HAVE_GPU:    # the NCCL half needs a CUDA device on every node: said, not failed
        assert res[0][2]["nccl"] == {"run": False, "reason": NO_GPU_HERE}, res[0][1]
        for r in range(1, nnodes):
            assert res[r][2]["nccl"] == {"run": False, "reason": "node 0 has no CUDA device or no NCCL"}, res[r][1]
        assert f"nccl: not run ({NO_GPU_HERE})" in res[0][1]
    links = res[0][2]["links"]
    assert [link["peer"] for link in links] == list(range(1, nnodes))
    for link in links:
        assert link["bytes_ok"] and link["latency_us"] > 0 and link["bandwidth_gbps"] > 0
        assert [s["bytes"] for s in link["sizes"]] == [4096, 65536, 1048576]
    return res[0][2]


def test_three_nodes_on_loopback_in_any_start_order(tmp_path):
    check_group(group(tmp_path, 3, [0, 1, 2]), 3)
    # node 0 first: the others join a rendezvous already waiting
    check_group(group(tmp_path, 3, [0, 1, 2], order=[0, 2, 1]), 3)


def test_nodes_that_disagree_are_refused_naming_the_field(tmp_path):
    res = group(tmp_path, 2, [0, 1], extra={1: ["--sizes", "4096"]}, timeout=10)
    rc0, text0, j0 = res[0]
    rc1, text1, j1 = res[1]
    assert rc0 == 1 and rc1 == 1
    assert "node rank 1 (host " in j0["error"] and "sizes=" in j0["error"], text0
    assert j1["error"].startswith("node 0 refused the group: node rank 1"), text1


@pytest.mark.skipif(HAVE_GPU, reason="checks the NCCL half's refusal where no GPU is")
def test_nccl_half_without_gpus(tmp_path):
    """Without a CUDA device the NCCL measurements are not run (said in a line and the
    JSON); --nccl on makes that a failure on every node, naming why; --nccl off skips."""
    r = subprocess.run([str(DOCTOR), "--nccl", "on", "--json", str(tmp_path / "on.json")], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 1, r.stdout
    assert f"doctor: FAILED: --nccl on, but NCCL cannot run: {NO_GPU_HERE}" in r.stdout
    j = json.loads((tmp_path / "on.json").read_text())
    assert j["ok"] is False and j["nccl"]["run"] is False and j["error"] == NO_GPU_HERE
    r = subprocess.run([str(DOCTOR), "--nccl", "off"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and "nccl: not run (--nccl off)" in r.stdout, r.stdout
    # two nodes: both fail, each with the reason it knows; the zmq half ran first
    res = group(tmp_path, 2, [0, 1], extra={0: ["--nccl", "on"], 1: ["--nccl", "on"]}, timeout=10)
    assert res[0][0] == 1 and f"--nccl on, but NCCL cannot run: {NO_GPU_HERE}" in res[0][1], res[0][1]
    assert res[1][0] == 1 and "--nccl on, but NCCL cannot run: node 0 has no CUDA device or no NCCL" in res[1][1]
    assert all(a["bitwise_ok"] for a in res[0][2]["all_reduce"])


def test_a_node_that_never_comes_is_named(tmp_path):
    t0 = time.monotonic()
    res = group(tmp_path, 3, [0, 2], timeout=3)
    assert time.monotonic() - t0 < 20
    assert res[0][0] == 1 and "node rank 1 did not join within 3000 ms" in res[0][2]["error"]
    # the node that came hears why the group failed
    assert res[2][0] == 1 and "node rank 1 did not join" in res[2][2]["error"]


def test_no_node_0_is_a_clear_error(tmp_path):
    res = group(tmp_path, 2, [1], timeout=2)
    rc, text, j = res[1]
    assert rc == 1 and j["error"].startswith("no answer from node 0 at tcp://127.0.0.1:") and "within 4000 ms" in j["error"], text


@pytest.mark.parametrize("args,msg", [
    (["--nnodes", "2"], "--nnodes 2 needs --master-addr and --master-port"),
    (["--nnodes", "2", "--node-rank", "2", "--master-addr", "x", "--master-port", "1"], "must be below --nnodes"),
    (["--sizes", "3"], "argument --sizes: invalid value"),
    (["--frobnicate", "1"], "unrecognized argument --frobnicate"),
    (["--nccl", "maybe"], "argument --nccl: invalid value 'maybe'"),
])
def test_bad_flags(args, msg):
    r = subprocess.run([str(DOCTOR), *args], capture_output=True, text=True, timeout=10)
    assert r.returncode == 2 and msg in r.stderr


def test_two_nodes_in_two_network_namespaces(tmp_path, two_namespaces):
    ns, addrs = two_namespaces
    res = group(tmp_path, 2, [0, 1], master=addrs[0], ns={0: ns[0], 1: ns[1]})
    j0 = check_group(res, 2)
    # each node is reached at its own address, the one its traffic to node 0 leaves from
    assert j0["nodes"][0]["endpoint"].startswith(f"tcp://{addrs[0]}:")
    assert j0["nodes"][1]["endpoint"].startswith(f"tcp://{addrs[1]}:")
    # node 1 cannot be node 0 in its namespace: the master address is not its own
    res = group(tmp_path, 2, [0], master=addrs[0], ns={0: ns[1]}, timeout=3)
    assert res[0][0] == 1 and "node 0 cannot listen on tcp://" + addrs[0] in res[0][2]["error"]
