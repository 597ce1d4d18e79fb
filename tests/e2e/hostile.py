"""Helpers shared by the hostile-input and load tests: a module-scoped `tessera serve`,
a raw-socket HTTP/1.1 client (requests cannot send malformed bytes), and /proc readers."""
import json
import os
import socket
import subprocess
import time
from pathlib import Path

import requests

from conftest import LAUNCHER, Proc, Served, free_port, http_status, wait_until


def start_served(tmp_dir, model, *flags, name="serve", headers=None):
    """`tessera serve MODEL` on a free port, healthy and with its model loaded (/health
    turns 200 before the worker has finished loading: a completion is polled until it is
    no longer 503).  Returns (Served, Proc); the caller kills the group at teardown."""
    port = free_port()
    proc = Proc([LAUNCHER, "serve", model, "--host", "127.0.0.1", "--port", port, *flags],
                Path(tmp_dir) / f"{name}.log")
    served = Served(proc, port)
    try:
        wait_until(lambda: proc.p.poll() is not None or http_status(served.base + "/health") == 200,
                   timeout=90, what="/health 200")
        assert proc.p.poll() is None, proc.output()

        def loaded():
            try:
                r = requests.post(served.base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1},
                                  headers=headers or {}, timeout=30)
            except requests.RequestException:
                return False
            return r.status_code == 200
        wait_until(loaded, timeout=90, interval=0.2, what="a first completion")
    except BaseException:
        proc.kill_group()
        raise
    return served, proc


def recv_response(sock, timeout=60.0):
    """Read one HTTP/1.1 response from `sock`: (status, headers dict, body bytes).  Handles
    content-length, chunked and close-delimited bodies.  Returns (None, {}, b"") when the
    peer closed before sending a status line."""
    sock.settimeout(timeout)
    buf = b""
    while b"\r\n\r\n" not in buf:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            return None, {}, buf
        buf += chunk
    head, rest = buf.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        k, v = line.split(":", 1)
        headers[k.strip().lower()] = v.strip()
    if status == 100:
        return recv_response_from(sock, rest, timeout)
    return status, headers, read_body(sock, headers, rest)


def recv_response_from(sock, already, timeout):
    # A 100 Continue came first: parse the real response from what is left.
    class Pre:
        def __init__(self):
            self.data = already

        def settimeout(self, t):
            sock.settimeout(t)

        def recv(self, n):
            if self.data:
                d, self.data = self.data, b""
                return d
            return sock.recv(n)

    return recv_response(Pre(), timeout)


def read_body(sock, headers, rest):
    def more():
        try:
            return sock.recv(65536)
        except ConnectionResetError:
            return b""

    if "content-length" in headers:
        n = int(headers["content-length"])
        while len(rest) < n:
            chunk = more()
            if not chunk:
                break
            rest += chunk
        return rest[:n]
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            while b"\r\n" not in rest:
                chunk = more()
                if not chunk:
                    return body
                rest += chunk
            size_line, rest = rest.split(b"\r\n", 1)
            size = int(size_line.split(b";")[0], 16)
            while len(rest) < size + 2:
                chunk = more()
                if not chunk:
                    return body + rest
                rest += chunk
            body += rest[:size]
            rest = rest[size + 2:]
            if size == 0:
                return body
    while True:   # close-delimited
        chunk = more()
        if not chunk:
            return rest
        rest += chunk


def raw_request(port, data, timeout=60.0, shut_write=False):
    """Send raw bytes on a fresh connection and read one response."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            s.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass   # the server may answer (413/431) and close before reading everything
        if shut_write:
            s.shutdown(socket.SHUT_WR)
        return recv_response(s, timeout)


def post_bytes(path, body, content_type="application/json", extra=b""):
    """An HTTP/1.1 POST with `body` as is (bytes), Connection: close."""
    head = (f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n").encode() + extra + b"\r\n"
    return head + body


def rss_kb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


def fd_count(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def metric_value(text, name):
    """The value of an unlabelled sample `name` in a Prometheus exposition, or None."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def metric_sum(text, name):
    """The sum of every sample of `name` (all label sets), 0.0 if none."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def error_of(body):
    return json.loads(body)["error"]
