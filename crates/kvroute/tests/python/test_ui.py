"""The status page (`/ui`) in a real headless Chromium: `kvroute serve` with an admin token
takes some requests, then the page is loaded (its token in the URL) and its DOM, after its
script ran, is compared with `/metrics` and `/workers`: it loads without console errors, shows
every worker, and its numbers match once the load has stopped. Without the token it shows
nothing of the fleet."""

import json
import os
import pathlib
import re
import shutil
import subprocess
import urllib.request

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


def dom(url: str) -> tuple[str, str]:
    """The page's DOM after its script ran (virtual time: a few refreshes), and the browser's log."""
    args = [chromium(), "--headless=new", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=4000",
            "--enable-logging=stderr", "--v=0", "--dump-dom", url]
    run = subprocess.run(args, capture_output=True, text=True, timeout=120)
    return run.stdout, run.stderr


def get(url: str, token: str | None = TOKEN) -> bytes:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.read()


@pytest.fixture
def serve():
    binary = os.environ.get("KVROUTE_BIN") or str(ROOT / "target/debug/kvroute")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    env["KVROUTE_ADMIN_TOKEN"] = TOKEN
    proc = subprocess.Popen([binary, "serve", "--port", "0", "--simulated-workers", "3", "--speedup", "50"],
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert "ready on http://" in line, line
        yield line.split("ready on ")[1].split()[0]
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_the_status_page_shows_every_worker_and_matches_the_metrics(serve):
    base = serve
    for k in range(12):
        body = json.dumps({"messages": [{"role": "user", "content": f"Question {k % 4}: what is a KV cache?"}],
                          "max_tokens": 3}).encode()
        request = urllib.request.Request(base + "/v1/chat/completions", data=body,
                                         headers={"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 200
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
    # Every decision is among the recent ones, each with its chosen worker first.
    assert len(re.findall(r'data-decision="\d+"', html)) == 12

    # Without the token the page loads but shows no worker.
    html, _ = dom(f"{base}/ui")
    assert "data-worker" not in html
    assert "not allowed" in html
