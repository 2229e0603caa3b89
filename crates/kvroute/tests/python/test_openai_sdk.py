"""`kvroute serve` driven by the official `openai` Python SDK: a text chat, a streamed chat, an
image chat, cached tokens on a repeat, and a clean exit on SIGTERM."""

import base64
import os
import pathlib
import signal
import struct
import subprocess
import time
import zlib

import pytest
from openai import OpenAI

ROOT = pathlib.Path(__file__).resolve().parents[4]


def png(width: int, height: int, shade: int) -> bytes:
    """A real PNG, written by hand (no imaging library needed)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    rows = b"".join(
        b"\x00" + bytes(v for x in range(width) for v in (shade, x % 256, y % 256)) for y in range(height)
    )
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


@pytest.fixture
def serve():
    binary = os.environ.get("KVROUTE_BIN") or str(ROOT / "target/debug/kvroute")
    if not os.path.exists(binary):
        pytest.fail(f"{binary} not found: build it with `cargo build -p kvroute` (or set KVROUTE_BIN)")
    proc = subprocess.Popen([binary, "serve", "--port", "0", "--speedup", "50"], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "ready on http://" in line, line
        yield proc, line.split("ready on ")[1].split()[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_the_openai_sdk_chats_streams_and_sends_images(serve):
    _, base = serve
    client = OpenAI(base_url=base + "/v1", api_key="not-needed")
    question = [{"role": "user", "content": "Please summarize the following text in three bullet points. "
                 "The router sends each request to the worker that already holds its prefix."}]
    r = client.chat.completions.create(model="kvroute-tiny", messages=question, max_tokens=5)
    assert r.choices[0].message.content and r.usage.completion_tokens == 5

    # A repeat is routed to the worker holding its blocks, which reports them cached.
    deadline = time.monotonic() + 15
    while True:
        again = client.chat.completions.create(model="kvroute-tiny", messages=question, max_tokens=1)
        cached = again.usage.prompt_tokens_details.cached_tokens
        # Every full block but a last one that ends the prompt (engines recompute it).
        if cached == (again.usage.prompt_tokens - 1) // 16 * 16:
            break
        assert time.monotonic() < deadline, f"never fully cached: {again.usage}"

    stream = client.chat.completions.create(
        model="kvroute-tiny", messages=question, max_tokens=4, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text.split()) == 4, "four words, cut at the length"
    assert chunks[-1].usage.completion_tokens == 4
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"

    picture = "data:image/png;base64," + base64.b64encode(png(56, 84, 7)).decode()
    r = client.chat.completions.create(
        model="kvroute-tiny",
        messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is in this picture?"},
            {"type": "image_url", "image_url": {"url": picture}},
        ]}],
        max_tokens=3,
    )
    assert r.choices[0].message.content
    assert r.usage.prompt_tokens > 6, "the image became placeholder tokens"


def test_sigterm_exits_cleanly(serve):
    proc, base = serve
    client = OpenAI(base_url=base + "/v1", api_key="not-needed")
    client.chat.completions.create(model="kvroute-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=15) == 0
