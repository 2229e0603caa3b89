"""vllm-router's `kv_aware` policy in front of four `kvroute mocker`s, as in front of four vLLMs.

vllm-router 0.1.17 keys its index by the token ids in the engines' KV events and gets each request's
token ids from the workers' `/v1/chat/completions/render`; the test checks that those calls succeed
and that a repeated prefix goes to the worker holding it."""

import json
import subprocess
import sys
import urllib.request

import pytest
import vllm_router  # noqa: F401  (pip vllm-router==0.1.17; scripts/test installs it)

from peer_fleet import free_port, get, metric, start_mockers, stop, wait_until


def chat(base: str, text: str) -> dict:
    body = {"model": "kvroute-tiny", "max_tokens": 2, "messages": [{"role": "user", "content": text}]}
    req = urllib.request.Request(
        base + "/v1/chat/completions", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


@pytest.fixture
def fleet():
    procs = []
    try:
        workers = start_mockers(procs)
        port, prom = free_port(), free_port()
        cmd = [sys.executable, "-m", "vllm_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
               "--policy", "kv_aware", "--kv-event-block-size", "16", "--kv-event-model", "kvroute-tiny",
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom), "--log-level", "warning",
               "--worker-urls", *[w["url"] for w in workers]]
        for w in workers:
            cmd += ["--kv-event-source", f"{w['url']}={w['events']}",
                    "--kv-event-replay-source", f"{w['url']}={w['replay']}"]
        router = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
        procs.append(router)
        base = f"http://127.0.0.1:{port}"

        def up():
            assert router.poll() is None, "vllm-router exited"
            return "kvroute-tiny" in get(base + "/v1/models")

        wait_until(up, "vllm-router")
        yield base, f"http://127.0.0.1:{prom}", workers
    finally:
        stop(procs)


def served(workers) -> list:
    """Prompt tokens each worker has scheduled (vLLM's prefix-cache queries)."""
    return [metric(get(w["url"] + "/metrics"), "vllm:prefix_cache_queries_total") for w in workers]


def test_kv_aware_renders_on_the_mockers_and_follows_the_prefix(fleet):
    base, prom, workers = fleet
    prefix = "Every request that starts with this long shared context should land where it is cached. " * 4
    first = chat(base, prefix + "Question zero?")
    full = (first["usage"]["prompt_tokens"] - 1) // 16 * 16
    assert full >= 64, first["usage"]
    holder = [i for i, n in enumerate(served(workers)) if n > 0]
    assert len(holder) == 1, served(workers)
    holder = holder[0]

    # The router learns the blocks from the holder's events; until then a repeat may go anywhere.
    wait_until(lambda: chat(base, prefix + "Question zero?")["usage"]["prompt_tokens_details"]["cached_tokens"] == full,
               "a repeat served from the cache")
    before = served(workers)
    for i in range(1, 6):
        r = chat(base, prefix + f"Question {i}, a different ending?")
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64, r["usage"]
    after = served(workers)
    moved = [i for i in range(len(workers)) if after[i] != before[i]]
    assert moved == [holder], f"repeats went to {moved}, the prefix is on worker {holder}"

    # Its token ids came from the mockers' render endpoint, every time.
    router_metrics = get(prom + "/metrics")
    assert metric(router_metrics, "vllm_router_kv_routing_inputs_total", result="render") >= 6, router_metrics
    other = metric(router_metrics, "vllm_router_kv_routing_inputs_total") - metric(
        router_metrics, "vllm_router_kv_routing_inputs_total", result="render")
    assert other == 0, router_metrics
    rendered = [metric(get(w["url"] + "/metrics"), "kvroute_mocker_render_requests_total") for w in workers]
    assert sum(rendered) >= 6, rendered
