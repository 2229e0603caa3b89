"""kvroute's Python bindings: the seed's multimodal router scenarios, golden vectors, and a
publisher -> `kvroute router` round trip over real ZMQ and HTTP on 127.0.0.1."""

import json
import os
import pathlib
import subprocess
import time
import urllib.request

import pytest

import kvroute
from kvroute import KvEventPublisher, RadixTree, compute_block_hash_for_seq, compute_block_hash_for_seq_py

ROOT = pathlib.Path(__file__).resolve().parents[3]
TOKENS = [1, 2, 3, 4] * 8  # 32 tokens


def image(mm_hash, start=0, end=32):
    return {"mm_objects": [{"mm_hash": mm_hash, "offsets": [[start, end]]}]}


# ---- hashing ------------------------------------------------------------------------------


def test_golden_vectors_from_dynamo():
    cases = json.loads((ROOT / "crates/kvroute-core/tests/fixtures/hash_vectors.json").read_text())["cases"]
    for case in cases:
        got = compute_block_hash_for_seq(case["tokens"], case["kv_block_size"], case["block_mm_infos"], case["lora_name"])
        assert got == case["local_hashes"], case["name"]


def test_no_image_image_a_image_b_all_differ():
    plain = compute_block_hash_for_seq(TOKENS, 32)
    a = compute_block_hash_for_seq(TOKENS, 32, [image(0xA)])
    b = compute_block_hash_for_seq(TOKENS, 32, [image(0xB)])
    assert len({plain[0], a[0], b[0]}) == 3


def test_deterministic():
    assert compute_block_hash_for_seq(TOKENS, 32, [image(7)]) == compute_block_hash_for_seq(TOKENS, 32, [image(7)])
    assert compute_block_hash_for_seq_py(TOKENS, 32, [image(7)]) == compute_block_hash_for_seq(TOKENS, 32, [image(7)])


@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_block_sizes(block_size):
    tokens = list(range(128))
    hashes = compute_block_hash_for_seq(tokens, block_size)
    assert len(hashes) == 128 // block_size
    assert len(set(hashes)) == len(hashes)


def test_partial_block_gives_one_hash():
    assert len(compute_block_hash_for_seq(list(range(20)), 16)) == 1
    assert compute_block_hash_for_seq(list(range(15)), 16) == []


def test_none_entry_equals_no_image():
    assert compute_block_hash_for_seq(TOKENS, 32, [None]) == compute_block_hash_for_seq(TOKENS, 32)
    assert compute_block_hash_for_seq(TOKENS, 32, None) == compute_block_hash_for_seq(TOKENS, 32)


def test_offsets_do_not_change_the_hash():
    assert compute_block_hash_for_seq(TOKENS, 32, [image(9, 0, 32)]) == compute_block_hash_for_seq(TOKENS, 32, [image(9, 4, 8)])


def test_two_images_differ_from_one():
    one = compute_block_hash_for_seq(TOKENS, 32, [image(1)])
    two = compute_block_hash_for_seq(
        TOKENS, 32, [{"mm_objects": [{"mm_hash": 1, "offsets": [[0, 16]]}, {"mm_hash": 2, "offsets": [[16, 32]]}]}]
    )
    assert one != two


def test_lora_name_salts():
    assert compute_block_hash_for_seq(TOKENS, 32, lora_name="a") != compute_block_hash_for_seq(TOKENS, 32)


def test_block_size_zero_is_a_value_error():
    with pytest.raises(ValueError, match="kv_block_size"):
        compute_block_hash_for_seq(TOKENS, 0)


@pytest.mark.parametrize(
    "infos, error, words",
    [
        ("nope", TypeError, "must be a list"),
        ([5], TypeError, r"block_mm_infos\[0\]"),
        ([{"other": 1}], ValueError, "mm_objects"),
        ([{"mm_objects": [{"offsets": []}]}], ValueError, "mm_hash"),
        ([{"mm_objects": [{"mm_hash": -1}]}], ValueError, "mm_hash"),
        ([{"mm_objects": [{"mm_hash": 1, "offsets": "x"}]}], ValueError, "offsets"),
    ],
)
def test_bad_mm_infos_name_the_problem(infos, error, words):
    with pytest.raises(error, match=words):
        compute_block_hash_for_seq(TOKENS, 32, infos)


# ---- the radix tree -----------------------------------------------------------------------


def stored(hashes, parent=None, engine=None):
    engine = engine or hashes
    blocks = [{"block_hash": e, "tokens_hash": h, "mm_extra_info": None} for e, h in zip(engine, hashes)]
    return {"event_id": 1, "data": {"stored": {"parent_hash": parent, "blocks": blocks}}, "dp_rank": 0}


def test_parent_child_chain_scores_two():
    tree = RadixTree()
    tree.apply_event(1, stored([11], engine=[100]))
    tree.apply_event(1, json.dumps(stored([12], parent=100, engine=[101])))
    scores = tree.find_matches([11, 12, 13])
    assert scores.scores == {(1, 0): 2}
    assert scores.tree_sizes == {(1, 0): 2}
    assert len(tree) == 2


def test_image_blocks_are_isolated_per_worker():
    tree = RadixTree()
    with_a = compute_block_hash_for_seq(TOKENS * 2, 32, [None, image(0xA)])
    with_b = compute_block_hash_for_seq(TOKENS * 2, 32, [None, image(0xB)])
    tree.apply_event(1, stored(with_a))
    tree.apply_event(2, stored(with_b, engine=[h ^ 1 for h in with_b]))
    assert tree.find_matches(with_a).scores == {(1, 0): 2, (2, 0): 1}
    assert tree.find_matches(with_b).scores == {(1, 0): 1, (2, 0): 2}


def test_remove_worker_and_clear_all_blocks():
    tree = RadixTree()
    for w in (1, 2, 3):
        tree.apply_event(w, stored([5, 6], engine=[w * 10, w * 10 + 1]))
    tree.remove_worker(2)
    assert tree.find_matches([5, 6]).scores == {(1, 0): 2, (3, 0): 2}
    tree.clear_all_blocks(3)
    assert tree.find_matches([5, 6]).scores == {(1, 0): 2}
    tree.apply_event(1, {"event_id": 2, "data": {"removed": {"block_hashes": [11]}}})
    assert tree.find_matches([5, 6]).scores == {(1, 0): 1}
    tree.apply_event(1, b'{"event_id": 3, "data": "cleared"}')
    assert tree.find_matches([5, 6]).scores == {}
    assert len(tree) == 0


def test_bad_events_raise():
    tree = RadixTree()
    with pytest.raises(ValueError):
        tree.apply_event(1, b"{not json")
    with pytest.raises(TypeError):
        tree.apply_event(1, 42)


@pytest.mark.parametrize("workers", [2, 3, 5])
def test_compute_store_query(workers):
    tree = RadixTree()
    prompts = {w: [w] * 16 + list(range(16 * (w + 1))) for w in range(workers)}
    for w, tokens in prompts.items():
        hashes = compute_block_hash_for_seq(tokens, 16)
        tree.apply_event(w, stored(hashes, engine=[w << 32 | i for i in range(len(hashes))]))
    for w, tokens in prompts.items():
        scores = tree.find_matches(compute_block_hash_for_seq(tokens, 16)).scores
        assert scores == {(w, 0): w + 2}


def test_dump_rebuilds_the_tree():
    tree = RadixTree()
    tree.apply_event(1, stored([1, 2, 3]))
    tree.apply_event(2, stored([1, 2, 9], engine=[21, 22, 23]))
    copy = RadixTree()
    for e in tree.dump_tree_as_events():
        event = json.loads(e)
        copy.apply_event(event["worker_id"], json.dumps(event["event"]))
    for q in ([1, 2, 3], [1, 2, 9], [1]):
        assert copy.find_matches(q).scores == tree.find_matches(q).scores
    early = tree.find_matches([1, 2, 3], early_exit=True).scores
    assert early[(1, 0)] >= 2


# ---- publisher -> kvroute router ----------------------------------------------------------


def kvroute_binary():
    path = os.environ.get("KVROUTE_BIN") or str(ROOT / "target/debug/kvroute")
    if not os.path.exists(path):
        pytest.fail(f"{path} not found: build it with `cargo build -p kvroute` (or set KVROUTE_BIN)")
    return path


def post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        return json.loads(resp.read())


def test_publisher_feeds_a_kvroute_router():
    with KvEventPublisher("tcp://127.0.0.1:0", 16, replay_endpoint="tcp://127.0.0.1:0") as pub:
        assert pub.endpoint.startswith("tcp://127.0.0.1:") and not pub.endpoint.endswith(":0")
        # Published before the router exists: only the replay socket can deliver it.
        tokens = list(range(1000, 1064))
        hashes = compute_block_hash_for_seq(tokens, 16, [None, None, image(0xFEED, 0, 16), None])
        pub.publish_stored(0, tokens[:32], [16, 16], [501, 502])
        router = subprocess.Popen(
            [kvroute_binary(), "router", "--port", "0", "--worker", f"id=3,events={pub.endpoint},replay={pub.replay_endpoint}"],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            line = router.stdout.readline()
            assert "listening on http://" in line, line
            base = line.split("listening on ")[1].split()[0]
            query = {"local_hashes": hashes, "num_tokens": 64}

            def overlap_becomes(want):
                deadline = time.monotonic() + 15
                while time.monotonic() < deadline:
                    answer = post(base + "/find_best_worker", query)
                    if answer["overlap_blocks"] == want:
                        assert answer["worker_id"] == 3
                        return
                    time.sleep(0.02)
                pytest.fail(f"overlap never became {want}: {answer}")

            overlap_becomes(2)
            pub.publish_stored(1, tokens[32:], [16, 16], [503, 504], parent_hash=502, block_mm_infos=[image(0xFEED, 0, 16), None])
            overlap_becomes(4)
            pub.publish_removed(2, [504, 503])
            overlap_becomes(2)
            pub.publish_cleared()
            overlap_becomes(0)
        finally:
            router.terminate()
            router.wait(timeout=10)
    with pytest.raises(RuntimeError, match="closed"):
        pub.publish_cleared()


def test_publisher_refuses_partial_blocks():
    with KvEventPublisher("tcp://127.0.0.1:0", 16) as pub:
        with pytest.raises(ValueError, match="full blocks"):
            pub.publish_stored(0, list(range(20)), [16, 4], [1, 2])
        with pytest.raises(ValueError, match="token ids"):
            pub.publish_stored(0, list(range(20)), [16], [1])
    with pytest.raises(ValueError):
        KvEventPublisher("tcp://127.0.0.1:0", 0)


def test_module_exports():
    assert set(kvroute.__all__) >= {"RadixTree", "KvEventPublisher", "compute_block_hash_for_seq"}
