"""deploy/k8s validated offline: every core object against the Kubernetes OpenAPI schemas
(kubernetes-validate, strict: an unknown or misspelt field fails), the LeaderWorkerSet
against a schema written here from LWS's documented v1 API (its pod templates against
Kubernetes' PodTemplateSpec), the production rules of issue #18 (pinned images,
non-root, requests and limits, /dev/shm in memory, the models PVC defined, grace periods
that cover the drain, startup probes), and the TP=8 x PP=2 Llama 3.3 70B FP8 replica
rendered pod by pod as LWS would start it and fed to the real tessera-worker: the flags
match the Llama 3.3 70B Hopper recipe, and the ones Tessera refuses today are exactly
the ones the manifest says it refuses."""
import re
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from conftest import REPO, WORKER, skip_because

K8S = REPO / "deploy" / "k8s"
K8S_VERSION = "1.30.0"       # oldest Kubernetes the manifests target (LWS needs >= 1.26)
SEED_LLAMA = REPO.parent / "shared" / "seeds" / "001_be6498cad16dedf4.txt"

# The Llama 3.3 70B recipe's Hopper config (Llama3.3_Hopper.yaml: FP8 on H100/H200).
HOPPER_RECIPE = {"kv-cache-dtype": "fp8", "async-scheduling": True, "no-enable-prefix-caching": True,
                 "max-num-batched-tokens": 8192}
# Every flag of the TP=8 x PP=2 replica passes tessera-worker's checks (the multi-node
# flags, one stage per node with its tp ranks, fp8 KV with -tp / -pp, the recipe's
# async-scheduling with --nnodes); only the model, absent here, stops it.  With the model
# there it would serve on CPUs, not on GPUs: the CUDA backend runs one rank (issues #16,
# #20).

# LeaderWorkerSet v1 (leaderworkerset.x-k8s.io/v1), from the fields LWS documents; the
# two pod templates are checked separately against Kubernetes' own PodTemplateSpec.
LWS_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "leaderworkerset.x-k8s.io/v1"},
        "kind": {"const": "LeaderWorkerSet"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["leaderWorkerTemplate"],
            "additionalProperties": False,
            "properties": {
                "replicas": {"type": "integer", "minimum": 0},
                "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
                "networkConfig": {"type": "object", "additionalProperties": False,
                                  "properties": {"subdomainPolicy": {"enum": ["Shared", "UniquePerReplica"]}}},
                "rolloutStrategy": {
                    "type": "object", "additionalProperties": False,
                    "properties": {
                        "type": {"enum": ["RollingUpdate"]},
                        "rollingUpdateConfiguration": {
                            "type": "object", "additionalProperties": False,
                            "properties": {"maxUnavailable": {"type": ["integer", "string"]},
                                           "maxSurge": {"type": ["integer", "string"]}}}}},
                "leaderWorkerTemplate": {
                    "type": "object",
                    "required": ["workerTemplate"],
                    "additionalProperties": False,
                    "properties": {
                        "size": {"type": "integer", "minimum": 1},
                        "restartPolicy": {"enum": ["RecreateGroupOnPodRestart", "None", "Default"]},
                        "leaderTemplate": {"type": "object"},
                        "workerTemplate": {"type": "object"},
                        "subGroupPolicy": {"type": "object",
                                           "properties": {"subGroupSize": {"type": "integer", "minimum": 1}}},
                    }}}}},
}


def documents():
    out = []
    for f in sorted(K8S.glob("*.yaml")):
        out += [(f.name, d) for d in yaml.safe_load_all(f.read_text()) if d]
    return out


def by_kind(kind):
    return {d["metadata"]["name"]: d for _, d in documents() if d["kind"] == kind}


def pod_specs():
    """(where, pod spec) of every pod any workload here starts."""
    out = []
    for _, d in documents():
        if d["kind"] in ("Deployment", "StatefulSet"):
            out.append((d["metadata"]["name"], d["spec"]["template"]["spec"]))
        elif d["kind"] == "LeaderWorkerSet":
            t = d["spec"]["leaderWorkerTemplate"]
            out += [(d["metadata"]["name"] + "/leader", t["leaderTemplate"]["spec"]),
                    (d["metadata"]["name"] + "/worker", t["workerTemplate"]["spec"])]
    return out


@pytest.mark.parametrize("name,doc", documents(), ids=lambda v: v if isinstance(v, str) else v["kind"])
def test_schema(name, doc):
    if doc["kind"] == "LeaderWorkerSet":
        jsonschema.validate(doc, LWS_SCHEMA)
        t = doc["spec"]["leaderWorkerTemplate"]
        for key in ("leaderTemplate", "workerTemplate"):
            kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate",
                                          "metadata": {"name": f"{doc['metadata']['name']}-{key}"},
                                          "template": t[key]}, K8S_VERSION, strict=True)
    else:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_validators_refuse_a_misspelt_field():
    """Both checks above would fail a typo: they are not vacuous."""
    _, lws = next((n, d) for n, d in documents() if d["kind"] == "LeaderWorkerSet")
    bad = yaml.safe_load(yaml.safe_dump(lws))
    bad["spec"]["leaderWorkerTemplate"]["sise"] = 2
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, LWS_SCHEMA)
    dep = next(iter(by_kind("Deployment").values()))
    bad = yaml.safe_load(yaml.safe_dump(dep))
    bad["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_pods_are_production_shaped():
    claims = set(by_kind("PersistentVolumeClaim"))
    for where, spec in pod_specs():
        sc = spec["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0, where
        assert sc["seccompProfile"]["type"] == "RuntimeDefault", where
        for c in spec["containers"]:
            image = c["image"]
            assert re.fullmatch(r"[\w./-]+:[\w.-]+", image) and not image.endswith(":latest"), (where, image)
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, where
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"], where
            assert {"cpu", "memory"} <= c["resources"]["requests"].keys() <= c["resources"]["limits"].keys()
        for v in spec.get("volumes", []):
            if "persistentVolumeClaim" in v:       # every claim used is defined here
                assert v["persistentVolumeClaim"]["claimName"] in claims, (where, v)


def test_workers_have_memory_shm_startup_probes_and_drain_time():
    cfgmaps = by_kind("ConfigMap")
    for where, spec in pod_specs():
        c = spec["containers"][0]
        if "tessera-worker" not in c["command"][0]:
            continue
        vols = {v["name"]: v for v in spec["volumes"]}
        shm = [m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        assert shm and vols[shm[0]["name"]]["emptyDir"]["medium"] == "Memory", where
        cfg = yaml.safe_load(cfgmaps[vols["config"]["configMap"]["name"]]["data"]["worker.yaml"])
        # the pod's grace covers --shutdown-timeout, with room to close and exit
        assert spec["terminationGracePeriodSeconds"] >= cfg["shutdown-timeout"] + 10, where
        if "--headless" not in c["args"]:          # the pods that serve: a startupProbe, no initialDelay
            assert c["startupProbe"]["tcpSocket"]["port"] == 8100, where
            assert "initialDelaySeconds" not in c["livenessProbe"], where


def test_router_rollout_and_disruption():
    dep = by_kind("Deployment")["tessera-router"]
    pdb = by_kind("PodDisruptionBudget")["tessera-router"]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items() and pdb["spec"]["minAvailable"] >= 1
    assert pdb["spec"]["minAvailable"] < dep["spec"]["replicas"]          # a drain can still proceed
    spec = dep["spec"]["template"]["spec"]
    c = spec["containers"][0]
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert c["livenessProbe"]["httpGet"]["path"] == "/version"
    grace_ms = int(re.search(r"#define SHUTDOWN_GRACE_MS (\d+)", (REPO / "router" / "main.c").read_text()).group(1))
    pre_stop = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert spec["terminationGracePeriodSeconds"] >= pre_stop + grace_ms / 1000 + 2


def lws_pods(lws, namespace="default"):
    """The pods of group 0 as LWS creates them: (index, container) with $(VAR) in args
    expanded from the variables LWS injects (Kubernetes expands $(VAR) in args)."""
    t = lws["spec"]["leaderWorkerTemplate"]
    name, size = lws["metadata"]["name"], t["size"]
    env = {"LWS_GROUP_SIZE": str(size), "LWS_LEADER_ADDRESS": f"{name}-0.{name}.{namespace}"}
    pods = []
    for i in range(size):
        c = dict((t["leaderTemplate"] if i == 0 else t["workerTemplate"])["spec"]["containers"][0])
        env_i = dict(env, LWS_WORKER_INDEX=str(i))
        c["args"] = [re.sub(r"\$\((\w+)\)", lambda m: env_i[m.group(1)], a) for a in c["args"]]
        pods.append((i, c))
    return pods


def flag(args, name):
    return args[args.index(name) + 1] if name in args else None


def test_llama70b_tp8_pp2_lines_up():
    lws = by_kind("LeaderWorkerSet")["tessera-llama70b"]
    cfg = yaml.safe_load(by_kind("ConfigMap")["tessera-llama70b-config"]["data"]["worker.yaml"])
    tp, pp = cfg["tensor-parallel-size"], cfg["pipeline-parallel-size"]
    assert (tp, pp) == (8, 2)
    assert cfg["model"].endswith("Llama-3.3-70B-Instruct-FP8") and "FP8" in cfg["served-model-name"]
    assert {k: cfg.get(k) for k in HOPPER_RECIPE} == HOPPER_RECIPE
    pods = lws_pods(lws)
    assert len(pods) == pp                                  # one node per pipeline stage
    gpus = [int(c["resources"]["limits"]["nvidia.com/gpu"]) for _, c in pods]
    assert all(g == tp for g in gpus) and sum(gpus) == tp * pp
    leader_addr = f"{lws['metadata']['name']}-0.{lws['metadata']['name']}.default"
    for i, c in pods:
        a = c["args"]
        assert flag(a, "--nnodes") == str(pp) and flag(a, "--node-rank") == str(i)
        assert flag(a, "--master-addr") == leader_addr
        assert ("--headless" in a) == (i != 0)              # only rank 0 serves routers
    # the routers reach the leaders only
    svc = by_kind("Service")["tessera-llama70b-leaders"]
    assert svc["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"


def test_hopper_recipe_is_the_seeds():
    if not SEED_LLAMA.exists():
        skip_because("no-shared-fixtures", f"{SEED_LLAMA} absent")
    text = SEED_LLAMA.read_text()
    block = text[text.index("Llama3.3_Hopper.yaml"):].split("\n\n")[1]
    assert yaml.safe_load(block) == HOPPER_RECIPE


def run_worker(args, cfg, tmp_path):
    f = tmp_path / "worker.yaml"
    f.write_text(yaml.safe_dump(cfg))
    r = subprocess.run([WORKER, "--config", f, *args], capture_output=True, text=True, timeout=60)
    return r.returncode, r.stdout + r.stderr


def test_llama70b_pods_against_the_real_worker(tmp_path):
    """Each rendered pod's command and config through tessera-worker, with the values
    LeaderWorkerSet substitutes ($(LWS_GROUP_SIZE) 2, $(LWS_WORKER_INDEX) the pod's index,
    $(LWS_LEADER_ADDRESS)): exit 2, stopped by the (absent) model alone, with and without
    the recipe's async-scheduling."""
    lws = by_kind("LeaderWorkerSet")["tessera-llama70b"]
    base_cfg = yaml.safe_load(by_kind("ConfigMap")["tessera-llama70b-config"]["data"]["worker.yaml"])
    for i, c in lws_pods(lws):
        subst = {"$(LWS_GROUP_SIZE)": "2", "$(LWS_WORKER_INDEX)": str(i), "$(LWS_LEADER_ADDRESS)": "127.0.0.1"}
        args = [subst.get(a, a) for a in c["args"]][2:]        # after --config FILE
        assert base_cfg.get("async-scheduling") is True, base_cfg
        for cfg in (dict(base_cfg), {k: v for k, v in base_cfg.items() if k != "async-scheduling"}):
            rc, out = run_worker(args, cfg, tmp_path)
            assert rc == 2 and base_cfg["model"] in out and "not supported" not in out, (i, out)