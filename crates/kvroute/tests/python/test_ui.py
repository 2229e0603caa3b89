"""The status page (`/ui`) in a real headless Chromium: `kvroute serve` with an admin token
takes some requests, then the page is loaded (its token in the URL) and its DOM, after its
script ran, is compared with `/metrics` and `/workers`: it loads without console errors, shows
every worker, and its numbers match once the load has stopped. Without the token it shows
nothing of the fleet."""

import html as htmllib
import json
import os
import pathlib
import re
import shutil
import struct
import subprocess
import tempfile
import threading
import time
import urllib.request
import zlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[4]
TOKEN = "ui-test-admin-token"


def chromium():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    # .ci/run installs it (Debian `chromium`); a developer without it is told how.
    pytest.fail("a headless Chromium is needed: `apt-get install chromium`")


BROWSER = ["--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1200,1400", "--hide-scrollbars"]


def dom(url: str, budget_ms: int = 4000) -> tuple[str, str]:
    """The page's DOM after its script ran (virtual time: a few refreshes), and the browser's log."""
    args = [chromium(), *BROWSER, f"--virtual-time-budget={budget_ms}", "--enable-logging=stderr", "--v=0",
            "--dump-dom", url]
    run = subprocess.run(args, capture_output=True, text=True, timeout=120)
    return run.stdout, run.stderr


def screenshot(url: str, budget_ms: int) -> tuple[int, int, list[tuple[int, int, int]]]:
    """The page as Chromium paints it, as (width, height, RGB pixels): a PNG read with zlib alone."""
    with tempfile.TemporaryDirectory() as d:
        path = pathlib.Path(d) / "ui.png"
        args = [chromium(), *BROWSER, f"--virtual-time-budget={budget_ms}", f"--screenshot={path}", url]
        subprocess.run(args, capture_output=True, timeout=120, check=True)
        data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        (length,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    width, height, depth, color, _, _, interlace = header
    assert depth == 8 and color in (2, 6) and interlace == 0, header
    channels = 3 if color == 2 else 4
    raw, stride = zlib.decompress(idat), width * channels
    rows, prev = [], bytearray(stride)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - channels] if i >= channels else 0
            b, c = prev[i], prev[i - channels] if i >= channels else 0
            if kind == 1:
                line[i] = (line[i] + a) & 255
            elif kind == 2:
                line[i] = (line[i] + b) & 255
            elif kind == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(line)
        prev = line
    pixels = [tuple(row[x * channels:x * channels + 3]) for row in rows for x in range(width)]
    return width, height, pixels


def get(url: str, token: str | None = TOKEN) -> bytes:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.read()


def start(*extra: str):
    binary = os.environ.get("KVROUTE_BIN") or str(ROOT / "target/debug/kvroute")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    env["KVROUTE_ADMIN_TOKEN"] = TOKEN
    proc = subprocess.Popen([binary, "serve", "--port", "0", "--simulated-workers", "3", "--speedup", "50", *extra],
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert "ready on http://" in line, line
        yield line.split("ready on ")[1].split()[0]
    finally:
        proc.kill()
        proc.wait(timeout=10)


@pytest.fixture
def serve():
    yield from start()


@pytest.fixture
def serve_fast_history():
    # 300 samples 20 ms apart: the history a page opens on fills in 6 s instead of 5 minutes.
    yield from start("--status-sample-ms", "20")


def ask(base: str, k: int):
    # Streamed: the router learns from each answer's first token.
    body = json.dumps({"messages": [{"role": "user", "content": f"Question {k % 4}: what is a KV cache?"}],
                      "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}).encode()
    request = urllib.request.Request(base + "/v1/chat/completions", data=body,
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200
        assert b"[DONE]" in response.read()


def test_the_status_page_shows_every_worker_and_matches_the_metrics(serve):
    base = serve
    for k in range(12):
        ask(base, k)
    # The load has stopped: what the page shows must be what the server says.
    metrics = get(base + "/metrics").decode()
    decisions = int(re.search(r"^kvroute_router_decisions_total (\d+)", metrics, re.M).group(1))
    workers = json.loads(get(base + "/workers"))["workers"]
    answered = sum(w["checks"]["answered"] for w in workers)
    def total(name):
        return sum(float(v) for v in re.findall(rf"^{name}\{{[^}}]*\}} (\S+)", metrics, re.M))
    prompt, cached = total("kvroute_router_answered_prompt_tokens_total"), total("kvroute_router_answered_cached_tokens_total")
    assert prompt > 0 and cached > 0, "repeated questions are served from cache"

    html, log = dom(f"{base}/ui?token={TOKEN}")
    assert 'data-loaded="yes"' in html, html[:2000]
    errors = [line for line in log.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert not errors, errors
    shown = sorted(int(w) for w in re.findall(r'data-worker="(\d+)"', html))
    assert shown == sorted(w["id"] for w in workers)
    assert re.search(rf'id="decisions-total">{decisions}<', html), (decisions, html[:3000])
    assert re.search(rf'id="answered">{answered}<', html), (answered, html[:3000])
    assert decisions == 12
    assert re.search(rf'id="hit-rate">{100 * cached / prompt:.1f} %<', html), (cached / prompt, html[:3000])
    # The chart has its axes: decisions/s, %, and time.
    for axis in ("rate", "error", "time"):
        assert f'data-axis="{axis}"' in html, html[:3000]
    assert "decisions / s" in html and "100 %" in html and "seconds ago" in html
    # Every decision is among the recent ones, each with its chosen worker first, its cost
    # in milliseconds (kv's cost is predicted seconds).
    assert len(re.findall(r'data-decision="\d+"', html)) == 12
    rows = re.findall(r'<tr data-decision="\d+">(.*?)</tr>', html)
    costs = [re.findall(r"<td>(.*?)</td>", row)[6] for row in rows]
    assert all(re.fullmatch(r"\d+\.\d+ ms", c) for c in costs), costs
    # Each row names its request, a link that opens the request's decision (/decisions/{id}).
    recent = json.loads(get(base + "/workers"))["recent_decisions"]
    linked = [re.search(r'<a href="#decision">(.*?)</a>', row).group(1) for row in rows]
    assert sorted(linked) == sorted(d["request"] for d in recent), (linked, recent)
    shown = json.loads(get(base + "/decisions/" + linked[0]))
    assert shown["request"] == linked[0] and shown["candidates"], shown
    # The first-token predictions: one row per worker that answered, its first tokens
    # counted as the server counts them.
    predictions = json.loads(get(base + "/workers"))["ttft_predictions"]
    assert sum(p["observed"] for p in predictions) == 12, predictions
    for p in predictions:
        row = re.search(rf'<tr data-prediction="{p["worker"]["worker_id"]}">(.*?)</tr>', html).group(1)
        cells = re.findall(r"<td>(.*?)</td>", row)
        assert cells[1] == str(p["observed"]) and cells[2].endswith("x"), cells
        assert re.fullmatch(r"\d+\.\d %", cells[3]), cells
    # Each worker with its URL.
    for w in workers:
        assert f"<td>{w['url']}</td>" in html, (w["url"], html[:3000])

    # Without the token the page loads but shows no worker.
    html, _ = dom(f"{base}/ui")
    assert "data-worker" not in html
    assert "not allowed" in html


def test_a_page_opened_late_draws_the_servers_history(serve_fast_history):
    """The chart is the server's own samples: opened after the load, the page draws all 300 of
    them at once (5 minutes at the default period; 6 s here), every label whole, and Chromium
    paints the rate and hit-rate lines inside the plot.

    The load goes on while the browser runs: 6 s of history slides past in the seconds
    Chromium takes to start, and a hit rate is drawn only for samples that had answers."""
    base = serve_fast_history
    deadline, k = time.monotonic() + 60, 0
    while True:
        ask(base, k)
        k += 1
        points = json.loads(get(base + "/ui/history"))["points"]
        if len(points) == 300 and sum(1 for p in points if p["rate"] > 0) > 100:
            break
        assert time.monotonic() < deadline, f"{len(points)} points after {k} requests"
    assert any(p["hit"] for p in points), "repeated questions hit"

    stop = threading.Event()
    def load():
        while not stop.is_set():
            ask(base, k)
    asker = threading.Thread(target=load, daemon=True)
    asker.start()
    try:
        html, log = dom(f"{base}/ui?token={TOKEN}", budget_ms=1500)
        width, height, pixels = screenshot(f"{base}/ui?token={TOKEN}", budget_ms=1500)
    finally:
        stop.set()
        asker.join(timeout=60)
    assert 'data-loaded="yes"' in html, html[:2000]
    chart = re.search(r'<svg id="chart"[^>]*>', html).group(0)
    assert 'data-points="300"' in chart, chart
    assert "data-clipped" not in chart, chart
    span = int(re.search(r'data-span-seconds="(\d+)"', chart).group(1))
    assert 5 <= span <= 10, chart

    plot = json.loads(htmllib.unescape(re.search(r'data-plot="([^"]*)"', chart).group(1)))
    def painted(rgb):
        # A pixel of the line is its colour laid over the white plot with some coverage: a
        # level line that falls between pixel rows is anti-aliased into two paler rows, and
        # those count when at least 40 % of the colour is there and no other colour mixed in.
        ink = [255 - c for c in rgb]
        norm = sum(i * i for i in ink)
        near = 0
        for y in range(plot["y"], min(height, plot["y"] + plot["h"])):
            for x in range(plot["x"], min(width, plot["x"] + plot["w"])):
                d = [255 - c for c in pixels[y * width + x]]
                cover = sum(a * b for a, b in zip(d, ink)) / norm
                near += cover >= 0.4 and sum(abs(a - cover * b) for a, b in zip(d, ink)) < 40
        return near
    assert painted((0x33, 0x66, 0xcc)) > 200, "the decisions/s line"
    assert painted((0x8e, 0x44, 0xad)) > 100, "the hit-rate line"
