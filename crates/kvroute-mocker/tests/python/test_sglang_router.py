"""sglang-router in its default mode (`cache_aware`) in front of four `kvroute mocker`s, as in front
of four SGLang servers, sent SGLang-native `/generate` requests with `input_ids`.

sglang-router 0.3.2 forwards `/generate` to a worker's `/generate` and keys its approximate prefix
tree by the request's text (for `input_ids`, the ids as text); the test checks that the requests
reach the engines' `/generate` (counted on their metrics), are answered in SGLang's shape, and that a
repeated prefix stays on the worker that holds it."""

import json
import subprocess
import sys
import urllib.request

import pytest
import sglang_router  # noqa: F401  (pip sglang-router==0.3.2; scripts/test installs it)

from peer_fleet import free_port, get, metric, start_mockers, stop, wait_until


def generate(base: str, body: dict):
    req = urllib.request.Request(base + "/generate", json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.headers.get("content-type", ""), r.read().decode()


@pytest.fixture
def fleet():
    procs = []
    try:
        workers = start_mockers(procs)
        port = free_port()
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
               "--log-level", "warn", "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
               "--worker-urls", *[w["url"] for w in workers]]
        router = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
        procs.append(router)
        base = f"http://127.0.0.1:{port}"

        def up():
            assert router.poll() is None, "sglang-router exited"
            listed = json.loads(get(base + "/workers"))["workers"]
            return len(listed) == len(workers) and all(w["is_healthy"] for w in listed)

        wait_until(up, "sglang-router and its workers")
        yield base, workers
    finally:
        stop(procs)


def counts(workers) -> list:
    """Requests each engine took on its SGLang `/generate`."""
    name = "kvroute_mocker_sglang_generate_requests_total"
    return [metric(get(w["url"] + "/metrics"), name) for w in workers]


def test_native_generate_through_sglang_router_follows_the_prefix(fleet):
    base, workers = fleet
    prefix = list(range(300, 300 + 160))  # ten 16-token blocks
    kind, body = generate(base, {"input_ids": prefix + [7, 8, 9], "rid": "first",
                                 "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
    first = json.loads(body)
    assert first["meta_info"]["id"] == "first", first
    assert first["meta_info"]["finish_reason"] == {"type": "length", "length": 3}, first
    assert len(first["output_ids"]) == 3 and first["text"], first
    taken = counts(workers)
    assert sorted(taken) == [0, 0, 0, 1], taken
    holder = taken.index(1)

    # Repeats with other endings: the same engine, served from its cache.
    for i in range(5):
        _, body = generate(base, {"input_ids": prefix + [20 + i] * 4, "sampling_params": {"max_new_tokens": 2}})
        assert json.loads(body)["meta_info"]["cached_tokens"] == 160, body
    after = counts(workers)
    assert after[holder] == 6 and sum(after) == 6, after

    # Streamed: SGLang's cumulative chunks, through the router, ending in [DONE].
    kind, body = generate(base, {"input_ids": prefix, "stream": True,
                                 "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
    assert kind.startswith("text/event-stream"), kind
    data = [line[6:] for line in body.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]", body
    chunks = [json.loads(d) for d in data[:-1]]
    assert [len(c["output_ids"]) for c in chunks] == [1, 2, 3], body
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length", body

    # The engine's refusal comes back through the router (which re-encodes the body it forwards,
    # so a sampling parameter it does not know never reaches the engine).
    with pytest.raises(urllib.error.HTTPError) as refused:
        generate(base, {"input_ids": prefix, "sampling_params": {"top_p": 2}})
    assert refused.value.code == 400
    error = json.loads(refused.value.read())["error"]
    assert error["message"] == "top_p must be in (0, 1], got 2.0.", error
