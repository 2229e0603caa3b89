"""kvroute in front of real vLLM engines (vLLM's CPU build, a tiny random Llama): started by
`scripts/real-engines test`, which runs the engines and passes them in REAL_ENGINES_WORKERS
(`--worker` specs separated by ';'). Not part of the default suite: the engines take minutes
and gigabytes (README, "Real engines").

Every test empties the engines' prefix caches first (vLLM's /reset_prefix_cache, served with
VLLM_SERVER_DEV_MODE=1) and starts its own `kvroute serve` in front of them."""

import json
import os
import pathlib
import re
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[4]
SPECS = [s for s in os.environ.get("REAL_ENGINES_WORKERS", "").split(";") if s]
BLOCK = 32

pytestmark = pytest.mark.skipif(not SPECS, reason="no real engines: run scripts/real-engines test")


def spec_field(spec: str, key: str) -> str:
    return dict(kv.split("=", 1) for kv in spec.split(","))[key]


def with_field(spec: str, key: str, value: str) -> str:
    fields = dict(kv.split("=", 1) for kv in spec.split(","))
    fields[key] = value
    return ",".join(f"{k}={v}" for k, v in fields.items())


def http(method: str, url: str, body=None, timeout=60):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            return r.status, dict(r.headers), json.loads(raw) if raw.strip() else None
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, dict(e.headers), json.loads(raw)
        except ValueError:
            return e.code, dict(e.headers), raw.decode(errors="replace")


def reset_caches():
    for spec in SPECS:
        status, _, _ = http("POST", spec_field(spec, "url") + "/reset_prefix_cache", {})
        assert status == 200, "serve vLLM with VLLM_SERVER_DEV_MODE=1"


class Kvroute:
    def __init__(self, specs, *extra):
        binary = os.environ.get("KVROUTE_BIN") or str(ROOT / "target/debug/kvroute")
        args = [binary, "serve", "--simulated-workers", "0", "--port", "0", "--expose-overlap", *extra]
        for s in specs:
            args += ["--worker", s]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        assert "ready on http://" in line, line + self.proc.stderr.read(4000) if self.proc.poll() else line
        self.base = line.split("ready on ")[1].split()[0]
        self.ready_line = line

    def chat(self, system: str, user: str, max_tokens=4):
        body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
                "max_tokens": max_tokens}
        status, headers, answer = http("POST", self.base + "/v1/chat/completions", body)
        return status, {k.lower(): v for k, v in headers.items()}, answer

    def workers(self):
        return http("GET", self.base + "/workers")[2]

    def close(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.fixture
def kvroute():
    started = []

    def start(specs=None, *extra):
        reset_caches()
        k = Kvroute(specs or SPECS, *extra)
        started.append(k)
        return k

    yield start
    for k in started:
        k.close()


WORDS = ("road river town bridge stone field market harbor mill tower valley forest hill lake "
         "castle garden school church square station").split()


def text(seed: int, words: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 13 + i * i) % len(WORDS)] for i in range(words))


def exact(answer_headers, answer):
    predicted = int(answer_headers["x-kvroute-overlap-tokens"])
    cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    return predicted, cached


def settle():
    """The engines' KV events of the last answer reach the router within a few ms; a request
    sent before that would be predicted on the view before them."""
    time.sleep(0.05)


@pytest.mark.parametrize("dialect", ["vllm-generate", "openai-chat"])
def test_every_prediction_exact_on_shared_prefixes_and_turns(kvroute, dialect):
    k = kvroute([with_field(s, "dialect", dialect) for s in SPECS])
    seen = []
    # Shared prefixes: 4 system prompts of ~600 tokens (about 4 tokens a word), 5 questions each, interleaved.
    for q in range(5):
        for g in range(4):
            status, headers, answer = k.chat(text(g, 150), f"question {q} about {text(100 + q, 6)}")
            assert status == 200, answer
            seen.append(exact(headers, answer))
            settle()
    # Multi-turn: a conversation growing by a turn each time.
    history = text(7, 80)
    for turn in range(6):
        history += f" turn {turn}: " + text(200 + turn, 12)
        status, headers, answer = k.chat("You answer briefly.", history)
        assert status == 200, answer
        seen.append(exact(headers, answer))
        settle()
    wrong = [(p, c) for p, c in seen if p != c]
    assert not wrong, f"{len(wrong)} of {len(seen)} predictions differ (predicted, cached): {wrong}"
    assert sum(c for _, c in seen) > 0, "nothing was ever cached"


def test_predictions_stay_exact_through_evictions(kvroute):
    """`scripts/real-engines test` runs 128-block caches (REAL_ENGINES_KV_BYTES=4M): 12
    prompts of ~1,000 tokens evict the first ones."""
    k = kvroute()
    seen = []
    for rep in range(2):
        for g in range(12):
            status, headers, answer = k.chat(text(g, 230), "go on")
            assert status == 200, answer
            seen.append(exact(headers, answer))
            settle()
    wrong = [(p, c) for p, c in seen if p != c]
    assert not wrong, f"{len(wrong)} of {len(seen)} differ: {wrong}"
    removed = sum(w["conversion"]["blocks_removed"] for w in k.workers()["workers"])
    assert removed > 0, "no eviction happened: the caches are larger than the test assumes"


def test_an_engine_restarted_is_followed(kvroute):
    k = kvroute()
    system = text(3, 170)
    for q in range(3):
        status, headers, answer = k.chat(system, f"before {q}")
        assert status == 200
        settle()
    worker = headers["x-kvroute-worker"]
    index = [spec_field(s, "id") for s in SPECS].index(worker)
    env = dict(os.environ)
    subprocess.run([str(ROOT / "scripts/real-engines"), "restart", str(index)], check=True, env=env, timeout=600)
    deadline = time.monotonic() + 60
    while not all(all(w["ready"]) for w in k.workers()["workers"]):
        assert time.monotonic() < deadline, k.workers()["workers"]
        time.sleep(0.2)
    seen = []
    for q in range(6):
        status, headers, answer = k.chat(system, f"after {q}")
        assert status == 200, answer
        seen.append(exact(headers, answer))
        settle()
    wrong = [(p, c) for p, c in seen if p != c]
    assert not wrong, f"after the restart {len(wrong)} of {len(seen)} differ: {wrong}"


class Gate:
    """A TCP forwarder on loopback between an engine's event socket and the router, whose
    forwarding can be held: the connection stays up, the events stop."""

    def __init__(self, target_port: int):
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen()
        self.port = self.listener.getsockname()[1]
        self.target = target_port
        self.open = threading.Event()
        self.open.set()
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            threading.Thread(target=self.pipe, args=(upstream, client, True), daemon=True).start()
            threading.Thread(target=self.pipe, args=(client, upstream, False), daemon=True).start()

    def pipe(self, src, dst, gated):
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                return
            if not data:
                return
            if gated:
                self.open.wait()
            try:
                dst.sendall(data)
            except OSError:
                return


def test_events_that_stop_while_the_engine_serves_are_noticed(kvroute):
    spec = SPECS[0]
    events_port = int(spec_field(spec, "events").rsplit(":", 1)[1])
    gate = Gate(events_port)
    gated = with_field(spec, "events", f"tcp://127.0.0.1:{gate.port}")
    k = kvroute([gated])
    # Served with its events flowing: exact.
    for q in range(3):
        status, headers, answer = k.chat(text(1, 120), f"flowing {q}")
        p, c = exact(headers, answer)
        assert p == c, (p, c)
        settle()
    gate.open.clear()
    # Events held: new prefixes are computed and cached by the engine, unseen by the router
    # (the self-checks' silence rule: answers that stored new blocks, and no event).
    deadline = time.monotonic() + 120
    n = 0
    while True:
        status, headers, answer = k.chat(text(50 + n, 120), f"held {n}")
        assert status == 200, answer
        n += 1
        checks = k.workers()["workers"][0]["checks"]
        if checks["silent"]:
            break
        assert time.monotonic() < deadline, f"never noticed after {n} requests: {checks}"
    assert n <= 25, f"noticed only after {n} answers"
    # Its events flowing again, the flag is lifted.
    gate.open.set()
    deadline = time.monotonic() + 30
    while k.workers()["workers"][0]["checks"]["silent"]:
        k.chat(text(500, 120), "flowing again")
        assert time.monotonic() < deadline, "still silent with its events flowing"
        time.sleep(0.1)


def test_the_status_page_agrees_with_vllms_own_metrics(kvroute):
    k = kvroute()

    def vllm_hits():
        total = 0.0
        for spec in SPECS:
            with urllib.request.urlopen(spec_field(spec, "url") + "/metrics", timeout=10) as r:
                for line in r.read().decode().splitlines():
                    if line.startswith("vllm:prefix_cache_hits_total"):
                        total += float(line.rsplit(" ", 1)[1])
        return total

    before = vllm_hits()
    cached = 0
    for q in range(8):
        status, headers, answer = k.chat(text(q % 2, 150), f"status {q}")
        assert status == 200
        cached += answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        settle()
    after = vllm_hits()
    # What the engines counted as prefix-cache hits is what the answers said, block for block.
    assert after - before == cached, (after - before, cached)
    workers = k.workers()["workers"]
    answered = sum(w["checks"]["answered"] for w in workers)
    exact_n = sum(w["checks"]["exact"] for w in workers)
    assert answered >= 8 and exact_n == answered, [w["checks"] for w in workers]
    assert sum(w["checks"]["over"] + w["checks"]["under"] for w in workers) == 0


def test_a_block_size_mismatch_refuses_the_worker(kvroute):
    k = kvroute(SPECS[:1], "--block-size", "16", "--ready-timeout", "3")
    deadline = time.monotonic() + 30
    while True:
        w = k.workers()["workers"][0]
        if w.get("refused"):
            break
        assert time.monotonic() < deadline, w
        time.sleep(0.2)
    assert re.search(r"32 tokens.*16.*--block-size 32", w["refused"]), w["refused"]
    assert w["ready"] == [False]
    status, _, answer = k.chat("hello", "there")
    assert status == 503, (status, answer)


SPANS = os.environ.get("REAL_ENGINES_SPANS")
OTLP = os.environ.get("REAL_ENGINES_OTLP")


def received_spans(path: str) -> list[dict]:
    """The spans rotel printed (its debug log, "detailed"): trace, parent, id, name."""
    spans, fields = [], {"    Trace ID       :": "trace", "    Parent ID      :": "parent",
                         "    ID             :": "id", "    Name           :": "name"}
    for line in pathlib.Path(path).read_text(errors="replace").splitlines():
        if line.startswith("Span #"):
            spans.append({})
        for prefix, key in fields.items():
            if spans and line.startswith(prefix):
                spans[-1][key] = line[len(prefix):].strip()
    return spans


@pytest.mark.skipif(not SPANS, reason="no collector: scripts/real-engines test starts rotel from the suite's .venv")
def test_vllms_spans_hang_under_kvroutes_engine_span(kvroute, monkeypatch):
    """One trace from the client through kvroute into vLLM: the engines export to the same
    collector (--otlp-traces-endpoint), and vLLM's `llm_request` span is the child of the
    `kvroute.engine` span whose context kvroute sent it."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    k = kvroute(None, "--otlp-endpoint", OTLP, "--trace-ratio", "1")
    trace = "8bf92f3577b34da6a3ce929d0e0e4730"
    body = json.dumps({"messages": [{"role": "user", "content": text(5, 40)}], "max_tokens": 4}).encode()
    request = urllib.request.Request(k.base + "/v1/chat/completions", data=body, headers={
        "content-type": "application/json", "traceparent": f"00-{trace}-00f067aa0ba902b7-01"})
    with urllib.request.urlopen(request, timeout=60) as r:
        assert r.status == 200
    deadline = time.monotonic() + 60
    while True:
        spans = [s for s in received_spans(SPANS) if s.get("trace") == trace]
        engine = [s for s in spans if s.get("name") == "kvroute.engine"]
        vllm = [s for s in spans if s.get("name") == "llm_request"]
        if engine and vllm:
            break
        assert time.monotonic() < deadline, spans
        time.sleep(0.2)
    assert [s["parent"] for s in vllm] == [engine[0]["id"]], (engine, vllm)
    request_span = [s for s in spans if s.get("name") == "kvroute.request"]
    assert request_span and request_span[0]["parent"] == "00f067aa0ba902b7", spans
    assert engine[0]["parent"] == request_span[0]["id"]
