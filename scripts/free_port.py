#!/usr/bin/env python3
"""Free loopback ports for processes a test or script is about to start.

`free_port(count)` returns the first of `count` consecutive ports that nothing holds,
chosen at random below the kernel's ephemeral range (10000 .. its start): outgoing
connections take their source ports from that range, so a port picked there (bind to
port 0) may belong to some connection by the time the spawned process binds it - CI saw
a router's connection take a worker's Status port that way.  Ports handed out once are
not handed out again by this process.  Falls back to the ephemeral way only when there
is no room below.

Command line: `scripts/free_port.py [COUNT]` prints one such port (the first of COUNT)."""
import os
import random
import socket
import sys
import time

_handed_out = set()
_rng = random.Random(os.getpid() ^ time.time_ns())


def _ephemeral_low():
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def free_port(count=1):
    low = _ephemeral_low()
    if low > 10000 + count:
        for _ in range(1000):
            p = _rng.randrange(10000, low - count)
            ports = range(p, p + count)
            if not _handed_out.intersection(ports) and all(_bindable(q) for q in ports):
                _handed_out.update(ports)
                return p
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if all(_bindable(q) for q in range(p + 1, p + count)):
            return p
    raise RuntimeError(f"no {count} free consecutive loopback ports")


if __name__ == "__main__":
    print(free_port(int(sys.argv[1]) if len(sys.argv) > 1 else 1))
