"""What the peer-router tests share: four `kvroute mocker` processes on free loopback ports, the
peer router's port, readiness waits, and reading Prometheus samples."""

import os
import pathlib
import random
import re
import socket
import subprocess
import time
import urllib.request

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[4]


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def metric(text: str, name: str, **labels) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(r"^([^#\s{]+)(?:\{([^}]*)\})?\s+(\S+)$", line)
        if not m or m.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total


def free_port() -> int:
    # The peer routers refuse port 0, so the port is picked here: below the kernel's ephemeral
    # range (where no socket bound to port 0 and no outgoing connection can hold it when the
    # router binds), at random, free for TCP when picked; the router is started at once.
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    low = max(1024, min(10_000, ephemeral // 2))
    for _ in range(64):
        port = random.randrange(low, ephemeral)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def wait_until(check, what: str, seconds: float = 30):
    deadline = time.monotonic() + seconds
    while True:
        try:
            if check():
                return
        except OSError:
            pass
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


# The fleet's shared secret: prefill and decode engines (and a shared store) need it, in
# KVROUTE_KV_PEER_TOKEN, for their side channels.
PEER_TOKEN = "peer-fleet-token-0123456789abcdef"


def start_mockers(procs: list, n: int = 4, args: tuple = ()) -> list:
    """`n` simulated engines (their processes appended to `procs`), each started with `args`
    and the fleet's token: each one's URL, its event, replay and load ports, and a prefill
    engine's side channel (its SGLang bootstrap port), as it prints them."""
    binary = os.environ.get("KVROUTE_BIN") or str(ROOT / "target/debug/kvroute")
    if not os.path.exists(binary):
        pytest.fail(f"{binary} not found: build it with `cargo build -p kvroute` (or set KVROUTE_BIN)")
    workers = []
    for _ in range(n):
        cmd = [binary, "mocker", "--port", "0", "--speedup", "20", *args]
        env = {**os.environ, "KVROUTE_KV_PEER_TOKEN": PEER_TOKEN}
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
        procs.append(p)
        line = p.stdout.readline()
        m = re.search(r"listening on (\S+) .*events (\S+) replay (\S+)", line)
        assert m, line
        role = re.search(r"side channel \(bootstrap\) \S+:(\d+)", p.stdout.readline())
        workers.append({"url": m.group(1), "events": m.group(2), "replay": m.group(3),
                        "bootstrap": int(role.group(1)) if role else None})
    return workers


def stop(procs: list):
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
