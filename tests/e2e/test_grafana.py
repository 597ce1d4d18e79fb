"""deploy/grafana for real: Debian's Prometheus scrapes a running `tessera serve` with the
shipped scrape config (its target pointed at the test's port, every second), a short
load runs (concurrent streams, a repeated prompt for prefix hits, a stream the client
drops for an abort), and then every query of every dashboard panel is evaluated through
Prometheus' HTTP API, as Grafana would send it: each must return data.  Prometheus is
queried, never the /metrics text directly, so a misspelt series, label or function
fails here."""
import json
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
import requests
import yaml
from openai import OpenAI

from conftest import REPO, free_port, wait_until

GRAFANA = REPO / "deploy" / "grafana"
RATE_WINDOW = "30s"          # stands in for Grafana's $__rate_interval at a 1 s scrape


def dashboard_queries():
    dash = json.loads((GRAFANA / "tessera-dashboard.json").read_text())
    out = []
    for p in dash["panels"]:
        for t in p.get("targets", []):
            out.append((f"{p['title']} / {t['refId']}", t["expr"]))
    return dash, out


def grafana_expand(expr):
    return expr.replace("$__rate_interval", RATE_WINDOW).replace('"$model"', '".*"')


def test_scrape_configs_are_valid(tmp_path):
    promtool = shutil.which("promtool")
    assert promtool, "promtool missing: scripts/setup.sh installs Debian's prometheus"
    r = subprocess.run([promtool, "check", "config", GRAFANA / "prometheus.yml"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    # Debian builds Prometheus without Kubernetes discovery, so promtool cannot load the
    # cluster file; check what it relies on instead: pods kept by the router's label and
    # annotations, address rewritten to the annotated port.
    k8s = yaml.safe_load((GRAFANA / "prometheus-k8s.yml").read_text())
    job = k8s["scrape_configs"][0]
    assert job["kubernetes_sd_configs"] == [{"role": "pod"}]
    keep = {tuple(r["source_labels"]): r["regex"] for r in job["relabel_configs"] if r.get("action") == "keep"}
    assert keep[("__meta_kubernetes_pod_label_app_kubernetes_io_name",)] == "tessera-router"
    router = yaml.safe_load_all((REPO / "deploy" / "k8s" / "tessera-router.yaml").read_text())
    dep = next(d for d in router if d["kind"] == "Deployment")
    ann = dep["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == keep[("__meta_kubernetes_pod_annotation_prometheus_io_scrape",)]
    addr = next(r for r in job["relabel_configs"] if r.get("target_label") == "__address__")
    assert re.sub(addr["regex"], addr["replacement"].replace("$", "\\"),
                  f"10.0.0.7:1234;{ann['prometheus.io/port']}") == f"10.0.0.7:{ann['prometheus.io/port']}"


def test_dashboard_is_grafana_shaped():
    dash, queries = dashboard_queries()
    assert dash["uid"] and dash["schemaVersion"] >= 36
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    titles = {p["title"] for p in dash["panels"]}
    for want in ("E2E request latency", "Time to first token", "Inter-token latency", "Token throughput",
                 "Requests running / waiting", "KV cache usage", "Prefix cache hit rate", "Preemptions",
                 "Placement decisions by policy", "Retries", "Aborts by cause", "Workers up", "KV cache capacity",
                 "KV cache usage per worker"):
        assert want in titles
    assert len(queries) >= 16


def load(base, model, seconds):
    """Concurrent streams for `seconds`, a repeated long prompt (prefix-cache hits) and one
    stream dropped by the client after its first token (an abort)."""
    client = OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    shared = "You are a helpful assistant. " * 20
    stop = time.monotonic() + seconds
    errors = []

    def one(i):
        try:
            while time.monotonic() < stop:
                s = client.completions.create(model=model, prompt=shared + f"Question {i}:", max_tokens=16,
                                              temperature=0, stream=True)
                for _ in s:
                    pass
        except Exception as e:       # noqa: BLE001  (reported below)
            errors.append(repr(e))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    with requests.post(base + "/v1/completions", stream=True, timeout=30,
                       json={"model": model, "prompt": "Count to a thousand:", "max_tokens": 2000, "stream": True}) as r:
        next(r.iter_lines())         # the first event, then hang up
    for t in threads:
        t.join()
    assert not errors, errors[:3]


def test_every_panel_has_data(serve, tmp_path):
    assert shutil.which("prometheus"), "prometheus missing: scripts/setup.sh installs Debian's package"
    s = serve()
    router_port = s.port
    cfg = yaml.safe_load((GRAFANA / "prometheus.yml").read_text())
    cfg["global"]["scrape_interval"] = cfg["global"]["evaluation_interval"] = "1s"
    cfg["scrape_configs"][0]["static_configs"] = [{"targets": [f"127.0.0.1:{router_port}"]}]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    prom_port = free_port()
    prom_log = open(tmp_path / "prometheus.log", "wb")
    prom = subprocess.Popen(["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}",
                             "--log.level=warn"], stdout=prom_log, stderr=subprocess.STDOUT)
    api = f"http://127.0.0.1:{prom_port}/api/v1"

    def query(expr):
        r = requests.get(api + "/query", params={"query": expr}, timeout=10)
        assert r.status_code == 200, (expr, r.text)
        return r.json()["data"]["result"]

    try:
        wait_until(lambda: prom.poll() is not None or _up(api), timeout=60, what="Prometheus scraping the router")
        assert prom.poll() is None, (tmp_path / "prometheus.log").read_text()
        model = requests.get(s.base + "/v1/models", timeout=5).json()["data"][0]["id"]
        load(s.base, model, seconds=8)
        time.sleep(3)                # the last scrapes after the load
        dash, queries = dashboard_queries()
        empty = [(name, expr) for name, expr in queries if not query(grafana_expand(expr))]
        assert not empty, "panels without data:\n" + "\n".join(f"{n}: {e}" for n, e in empty)
        # the template variable's query too
        r = requests.get(api + "/label/model_name/values", params={"match[]": "vllm:num_requests_running"}, timeout=10)
        assert model in r.json()["data"]
        # and the numbers are the load's, not just present: tokens were generated, a
        # prefix was reused, the dropped stream counted as an abort
        assert float(query(grafana_expand(dict(queries)["Token throughput / B"]))[0]["value"][1]) > 0
        assert float(query(f'sum(vllm:prefix_cache_hits_total{{model_name="{model}"}})')[0]["value"][1]) > 0
        assert query("sum(tessera:request_aborts_total)")[0]["value"][1] != "0"
    finally:
        prom.terminate()
        prom.wait(timeout=30)
        prom_log.close()


def _up(api):
    try:
        r = requests.get(api + "/query", params={"query": "up{job=\"tessera-router\"} == 1"}, timeout=2)
        return r.status_code == 200 and bool(r.json()["data"]["result"])
    except requests.RequestException:
        return False
