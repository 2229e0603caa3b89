"""The peer routers' prefill/decode modes in front of `kvroute mocker --role prefill|decode`, as in
front of vLLM's NIXL connector and SGLang's disaggregation:

- vllm-router 0.1.17 `--vllm-pd-disaggregation` sends the prefill engine the request with
  `kv_transfer_params.do_remote_decode` and one token, then the decode engine the request with the
  prefill's answer's `kv_transfer_params`;
- sglang-router 0.3.2 `--pd-disaggregation` sends both the request with `bootstrap_host`,
  `bootstrap_port` (the prefill engine's, given with `--prefill URL PORT`) and `bootstrap_room`.

Every request must be answered, its KV pulled from the prefill engine by the decode engine (the
decode engine's cached tokens), and nothing left held on the prefill engines."""

import json
import subprocess
import sys
import urllib.request

import pytest
import sglang_router  # noqa: F401  (pip sglang-router==0.3.2; scripts/test installs it)
import vllm_router  # noqa: F401  (pip vllm-router==0.1.17)

from peer_fleet import free_port, get, start_mockers, stop, wait_until


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def stats(worker) -> dict:
    return json.loads(get(worker["url"] + "/stats"))


def pd_fleet(router_args, bootstrap: bool):
    procs = []
    prefill = start_mockers(procs, 2, ("--role", "prefill"))
    # Each decode engine may pull from these prefill engines' side channels only.
    peers = ",".join(f"127.0.0.1:{w['bootstrap']}" for w in prefill)
    decode = start_mockers(procs, 2, ("--role", "decode", "--prefill-peers", peers))
    port = free_port()
    cmd = [*router_args, "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
           "--prometheus-port", str(free_port()), "--policy", "round_robin"]
    for w in prefill:
        cmd += ["--prefill", w["url"]] + ([str(w["bootstrap"])] if bootstrap else [])
    for w in decode:
        cmd += ["--decode", w["url"]]
    router = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    procs.append(router)
    return procs, router, f"http://127.0.0.1:{port}", prefill, decode


def check_answers(base, path, bodies, prefill, decode, answered):
    for body in bodies:
        assert answered(post(base + path, body))
    received = sum(stats(w)["handoff"]["received"] for w in decode)
    assert received == len(bodies), [stats(w)["handoff"] for w in decode]
    # The decodes served prompt KV they pulled (vllm-router reports its own usage to the client,
    # so the engines' ground truth is read; a decode engine pulls only what it lacks, so the
    # shared prefix moves once per decode engine).
    assert sum(stats(w)["remote_tokens"] for w in decode) >= 96 * len(decode)
    assert sum(stats(w)["handoff"]["pull_failures"] for w in decode) == 0
    wait_until(lambda: all(stats(w)["held_blocks"] == 0 for w in prefill), "every hold released")
    assert sum(stats(w)["handoff"]["pulled"] for w in prefill) == len(bodies)


@pytest.fixture
def vllm_pd():
    procs = []
    try:
        procs, router, base, prefill, decode = pd_fleet(
            [sys.executable, "-m", "vllm_router.launch_router", "--vllm-pd-disaggregation",
             "--log-level", "warning"], bootstrap=False)

        def up():
            assert router.poll() is None, "vllm-router exited"
            return "kvroute-tiny" in get(base + "/v1/models")

        wait_until(up, "vllm-router in P/D mode")
        yield base, prefill, decode
    finally:
        stop(procs)


def test_vllm_router_pd_mode_over_the_mockers(vllm_pd):
    base, prefill, decode = vllm_pd
    text = "A long shared context about disaggregated serving, repeated to fill blocks. " * 6
    bodies = [{"model": "kvroute-tiny", "max_tokens": 4,
               "messages": [{"role": "user", "content": text + f"Question {i}?"}]} for i in range(6)]
    check_answers(base, "/v1/chat/completions", bodies, prefill, decode,
                  lambda a: a["usage"]["completion_tokens"] == 4)
    # Each prefill engine prefilled (one token each) for the decode engines.
    assert all(stats(w)["requests_finished"] > 0 for w in prefill)


@pytest.fixture
def sglang_pd():
    procs = []
    try:
        procs, router, base, prefill, decode = pd_fleet(
            [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
             "--log-level", "warn"], bootstrap=True)

        def up():
            assert router.poll() is None, "sglang-router exited"
            return get(base + "/health") is not None

        wait_until(up, "sglang-router in P/D mode")
        yield base, prefill, decode
    finally:
        stop(procs)


def test_sglang_router_pd_mode_over_the_mockers(sglang_pd):
    base, prefill, decode = sglang_pd
    ids = list(range(300, 300 + 160))
    bodies = [{"input_ids": ids + [7, i], "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
              for i in range(6)]
    check_answers(base, "/generate", bodies, prefill, decode,
                  lambda a: a["meta_info"]["cached_tokens"] >= 96 and a["meta_info"]["completion_tokens"] == 4)
