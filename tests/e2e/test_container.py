"""deploy/Containerfile builds, for real, with buildah (Debian's package, installed by
scripts/setup.sh), and the image serves: a worker and a router started from it answer
an OpenAI completion for the demo model mounted read-only.

No registry is reachable from the development machines, so the `debian:12` base image
is made here with debootstrap from the Debian mirror (the same source apt uses) and
tagged docker.io/library/debian:12 in a private buildah store; `--pull=never` then
builds on it.  The store (/var/tmp/tessera-containers) persists between runs: the base
image and the build-dependency layer are reused, so a rerun recompiles Tessera only
(vfs keeps full copies of layers: past 8 GiB the cached layers are pruned, the base kept).
Storage driver vfs and chroot isolation: they need no overlay or user-namespace support
from the host, and buildah runs rootful here (the test command runs as root)."""
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from openai import OpenAI

from conftest import REPO, free_port, free_port_pair, http_status, wait_until

STORE = Path(os.environ.get("TESSERA_CONTAINER_STORE", "/var/tmp/tessera-containers"))
BASE = "docker.io/library/debian:12"
IMAGE = "localhost/tessera:test"
STORE_CAP = 8 << 30


def buildah(*args, timeout=1800, check=True):
    cmd = ["buildah", "--storage-driver", "vfs", "--root", str(STORE / "root"), "--runroot", str(STORE / "run"),
           *map(str, args)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check:
        assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return r


def ensure_base():
    if buildah("inspect", "--type", "image", BASE, check=False).returncode == 0:
        return
    assert shutil.which("debootstrap"), "debootstrap missing: scripts/setup.sh installs it"
    ctr = buildah("from", "scratch").stdout.strip()
    try:
        mnt = buildah("mount", ctr).stdout.strip()
        r = subprocess.run(["debootstrap", "--variant=minbase", "bookworm", mnt, "http://deb.debian.org/debian"],
                           capture_output=True, text=True, timeout=1800)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        buildah("umount", ctr)
        buildah("commit", "-q", ctr, BASE)
    finally:
        buildah("rm", ctr, check=False)


@pytest.fixture(scope="module")
def image():
    assert shutil.which("buildah"), "buildah missing: scripts/setup.sh installs it"
    assert os.geteuid() == 0, "this test builds with rootful buildah"
    STORE.mkdir(parents=True, exist_ok=True)
    ensure_base()
    started = time.monotonic()
    # pip in the build (xgrammar's sdist) trusts what the host's pip trusts: on these
    # machines HTTPS goes through a proxy whose CA only the host's bundle has
    ca = next((c for c in (os.environ.get("PIP_CERT"), os.environ.get("REQUESTS_CA_BUNDLE"),
                           os.environ.get("SSL_CERT_FILE")) if c and os.path.isfile(c)), None)
    ca_args = ["--volume", f"{ca}:/run/build-ca.crt:ro", "--build-arg", "TESSERA_PIP_CERT=/run/build-ca.crt"] \
        if ca else []
    r = buildah("build", "--pull=never", "--layers", "--isolation", "chroot", *ca_args,
                "-f", REPO / "deploy" / "Containerfile", "-t", IMAGE, REPO, check=False)
    # the whole log when it fails: a build that breaks must say where
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    print(f"image built in {time.monotonic() - started:.0f} s")
    yield IMAGE
    # vfs stores every layer as a full copy (a build adds a few GiB): drop this image,
    # and the cached intermediate layers too once the store passes STORE_CAP (the base
    # image stays, so no new debootstrap)
    buildah("rmi", IMAGE, check=False)
    used = int(subprocess.run(["du", "-sb", STORE], capture_output=True, text=True).stdout.split()[0])
    if used > STORE_CAP:
        buildah("rmi", "--prune", check=False)


def run_in(image, *cmd, mounts=(), background=False, log=None):
    """`buildah run` a fresh container of the image: its own user and root, the host's
    network (chroot isolation)."""
    ctr = buildah("from", image).stdout.strip()
    args = ["buildah", "--storage-driver", "vfs", "--root", str(STORE / "root"), "--runroot", str(STORE / "run"),
            "run", "--isolation", "chroot"]
    for src, dst in mounts:
        args += ["-v", f"{src}:{dst}:ro"]
    args += [ctr, "--", *map(str, cmd)]
    if background:
        return ctr, subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=120)
    finally:
        buildah("rm", ctr, check=False)


def test_image_runs_as_nobody_with_every_binary(image):
    cfg = buildah("inspect", "--format", "{{.OCIv1.Config.User}}", image).stdout.strip()
    assert cfg == "65534:65534"
    assert run_in(image, "id", "-u").stdout.strip() == "65534"
    for binary in ("tessera", "tessera-router", "tessera-worker"):
        r = run_in(image, f"/usr/local/bin/{binary}", "--version")
        assert r.returncode == 0 and r.stdout.strip() == f"{binary} 0.1.0", (binary, r.stdout, r.stderr)
    # tessera-bench has no --version; --help proves it loads with the image's libraries
    r = run_in(image, "/usr/local/bin/tessera-bench", "--help")
    assert r.returncode == 0 and "usage" in r.stdout.lower(), (r.stdout, r.stderr)


def test_image_serves_the_demo_model(image, demo_model, tmp_path):
    wport, rport = free_port_pair(), free_port()
    model_dir = Path(demo_model).resolve().parent
    procs = []
    try:
        procs.append(run_in(image, "/usr/local/bin/tessera-worker", f"/models/{Path(demo_model).name}",
                            "--listen", f"tcp://127.0.0.1:{wport}", mounts=[(model_dir, "/models")],
                            background=True, log=open(tmp_path / "worker.log", "wb")))
        procs.append(run_in(image, "/usr/local/bin/tessera-router", "--worker", f"tcp://127.0.0.1:{wport}",
                            "--host", "127.0.0.1", "--port", rport, background=True,
                            log=open(tmp_path / "router.log", "wb")))
        wait_until(lambda: http_status(f"http://127.0.0.1:{rport}/health") == 200
                   or any(p.poll() is not None for _, p in procs), timeout=120, what="/health 200 from the image")
        assert all(p.poll() is None for _, p in procs), \
            (tmp_path / "worker.log").read_text(errors="replace") + (tmp_path / "router.log").read_text(errors="replace")
        client = OpenAI(base_url=f"http://127.0.0.1:{rport}/v1", api_key="x")
        model = client.models.list().data[0].id
        out = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8,
                                        temperature=0)
        assert out.usage.completion_tokens == 8 and out.choices[0].text
    finally:
        for ctr, p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 15)
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, 9)
                    p.wait(timeout=10)
            buildah("rm", ctr, check=False)
