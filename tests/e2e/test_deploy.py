"""deploy/k8s and deploy/Containerfile hold together: every manifest parses, the
Services select the pods they front, the ports agree end to end (router --worker-dns
port = worker Service port = worker --listen port, Status on the next one), the
probes hit endpoints that exist, and the ConfigMap's YAML files load through the
binaries' own --config reader (a misspelt key fails there, with its name)."""
import re
import subprocess
from pathlib import Path

import requests
import yaml

from conftest import LAUNCHER, REPO, ROUTER, WORKER, free_port, http_status, wait_until

K8S = REPO / "deploy" / "k8s"


def docs():
    out = {}
    for f in sorted(K8S.glob("*.yaml")):
        for d in yaml.safe_load_all(f.read_text()):
            out[(d["kind"], d["metadata"]["name"])] = d
    return out


def test_manifests_fit_together(tmp_path):
    d = docs()
    cm = d[("ConfigMap", "tessera-config")]["data"]
    worker_cfg, router_cfg = yaml.safe_load(cm["worker.yaml"]), yaml.safe_load(cm["router.yaml"])

    wsvc, wsts = d[("Service", "tessera-workers")], d[("StatefulSet", "tessera-worker")]
    rsvc, rdep = d[("Service", "tessera")], d[("Deployment", "tessera-router")]
    assert wsvc["spec"]["clusterIP"] == "None"                  # headless: DNS lists pod IPs
    assert wsts["spec"]["serviceName"] == wsvc["metadata"]["name"]
    for svc, wl in ((wsvc, wsts), (rsvc, rdep)):
        labels = wl["spec"]["template"]["metadata"]["labels"]
        assert svc["spec"]["selector"].items() <= labels.items()
        assert wl["spec"]["selector"]["matchLabels"].items() <= labels.items()

    # ports: --worker-dns NAME:PORT -> the headless Service -> the worker's --listen
    name, port = router_cfg["worker-dns"].rsplit(":", 1)
    assert name == wsvc["metadata"]["name"]
    listen_port = int(re.fullmatch(r"tcp://0\.0\.0\.0:(\d+)", worker_cfg["listen"]).group(1))
    svc_ports = {p["name"]: p["port"] for p in wsvc["spec"]["ports"]}
    assert svc_ports == {"zmq": int(port), "status": int(port) + 1} and listen_port == int(port)
    wc = wsts["spec"]["template"]["spec"]["containers"][0]
    assert {p["containerPort"] for p in wc["ports"]} == {listen_port, listen_port + 1}
    assert wc["readinessProbe"]["tcpSocket"]["port"] == listen_port
    rc = rdep["spec"]["template"]["spec"]["containers"][0]
    assert rc["ports"][0]["containerPort"] == router_cfg["port"] == rsvc["spec"]["ports"][0]["targetPort"]
    assert rc["readinessProbe"]["httpGet"]["path"] == "/health"
    assert rc["livenessProbe"]["httpGet"]["path"] == "/version"
    assert worker_cfg["served-model-name"] == router_cfg["served-model-name"]

    # the ConfigMap's files, mounted at /etc/tessera, parse through each binary's --config
    for binary, key, container in ((WORKER, "worker.yaml", wc), (ROUTER, "router.yaml", rc)):
        assert container["command"] == [f"/usr/local/bin/{binary.name}"]
        assert container["args"] == ["--config", f"/etc/tessera/{key}"]
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    # worker: the file parses; what fails is only the model path, which does not exist here
    good.write_text(cm["worker.yaml"])
    r = subprocess.run([WORKER, "--config", good], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "/models/SmolLM2-135M-Instruct.Q4_1.gguf" in r.stderr + r.stdout, r.stderr
    bad.write_text(cm["worker.yaml"] + "no-such-flag: 1\n")
    r = subprocess.run([WORKER, "--config", bad], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no-such-flag" in r.stderr + r.stdout
    # router: starts with the file (port and host overridden on the command line)
    good.write_text(cm["router.yaml"])
    port = free_port()
    p = subprocess.Popen([ROUTER, "--config", good, "--host", "127.0.0.1", "--port", str(port)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: http_status(f"http://127.0.0.1:{port}/version") == 200 or p.poll() is not None,
                   timeout=30, what="router up with the ConfigMap's file")
        assert p.poll() is None
        assert http_status(f"http://127.0.0.1:{port}/health") == 503     # no worker by that name here
    finally:
        p.terminate()
        p.communicate(timeout=30)
    assert p.returncode == 0
    bad.write_text(cm["router.yaml"] + "no-such-flag: 1\n")
    r = subprocess.run([ROUTER, "--config", bad], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "no-such-flag" in r.stderr


def test_probe_paths_answer(serve):
    s = serve()
    assert requests.get(s.base + "/version", timeout=5).status_code == 200
    assert requests.get(s.base + "/health", timeout=5).status_code == 200


def test_containerfile_installs_the_binaries():
    text = (REPO / "deploy" / "Containerfile").read_text()
    assert "scripts/setup.sh" in text and "meson install" in text
    # the runtime stage has the shared libraries the binaries link (Debian 12 names)
    for lib in ("libuv1", "libzmq5", "libprotobuf-c1", "libjansson4", "libyaml-0-2", "libpcre2-8-0",
                "libxxhash0", "libssl3", "libsystemd0", "libutf8proc2", "libcurl4"):
        assert lib in text
    # direct dependencies (NEEDED); apt brings the packages' own dependencies
    bench = ROUTER.parent.parent / "deploy" / "tessera-bench"
    needed = set()
    for b in (ROUTER, WORKER, LAUNCHER, bench):
        out = subprocess.run(["readelf", "-d", b], capture_output=True, text=True).stdout
        needed |= set(re.findall(r"\(NEEDED\)\s+Shared library: \[(\S+)\]", out))
    assert "libzmq.so.5" in needed
    sonames = {"libuv.so.1": "libuv1", "libzmq.so.5": "libzmq5", "libprotobuf-c.so.1": "libprotobuf-c1",
               "libjansson.so.4": "libjansson4", "libyaml-0.so.2": "libyaml-0-2",
               "libpcre2-8.so.0": "libpcre2-8-0", "libxxhash.so.0": "libxxhash0", "libcrypto.so.3": "libssl3",
               "libsystemd.so.0": "libsystemd0", "libutf8proc.so.2": "libutf8proc2", "libcurl.so.4": "libcurl4"}
    for so in needed & sonames.keys():
        assert sonames[so] in text, so
    base = r"lib(c|m|pthread|dl|rt|gcc_s|stdc\+\+)\.so"      # libc6, libgcc-s1, libstdc++6: in debian:12
    # CUDA's runtime, cuBLAS and NCCL: linked where the toolkit is (a GPU build); the
    # Containerfile builds the CPU backend (-Dcuda=disabled), whose binaries lack them
    gpu = r"lib(cudart|cublas|cublasLt|nccl|cuda)\.so"
    assert "-Dcuda=disabled" in text
    unknown = sorted(so for so in needed - sonames.keys()
                     if not re.match(base, so) and not re.match(gpu, so) and "ld-linux" not in so)
    assert not unknown, f"the runtime stage may miss: {unknown}"
