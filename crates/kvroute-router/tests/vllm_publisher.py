"""A vLLM-shaped KV event publisher for kvroute's integration tests.

Publishes on a ZMQ PUB socket exactly as vLLM's ZmqEventPublisher does: frames
[topic, seq (8 bytes, big-endian), msgpack KVEventBatch], the batch [ts, events, dp_rank],
events as msgspec structs in the map form (vLLM >= 0.24: a "type" key) or the older
positional array form (tag first). Keeps every batch for replay on a ROUTER socket: a DEALER
sends ["", start_seq] and gets ["", topic, seq, payload]... then seq 0xff..ff, b"".

Protocol with the test (JSON lines): on start it prints {"events": "tcp://..", "replay": ".."};
then reads commands from stdin:
  {"op": "publish", "seq": n, "form": "map"|"array", "events": [...], "skip": false}
      encodes the batch, keeps it for replay, and sends it unless "skip"; answers {"ok": n}
  {"op": "raw", "frames": ["hex", ...]}   sends arbitrary frames (garbage tests)
  {"op": "quit"}
"""

import json
import sys
import time
from typing import Any, Optional, Union

import msgspec
import zmq

TOPIC = b"kv-events"
END = (2**64 - 1).to_bytes(8, "big")


# The map form, as vLLM >= 0.24 writes it.
class MapEvent(msgspec.Struct, tag_field="type", omit_defaults=True):
    pass


class MapBlockStored(MapEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Optional[list[Any]]]] = None
    group_idx: int = 0


class MapBlockRemoved(MapEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: Optional[str]
    group_idx: int = 0


class MapAllBlocksCleared(MapEvent, tag="AllBlocksCleared"):
    pass


# The positional form of vLLM <= 0.23.
class ArrEvent(msgspec.Struct, array_like=True, tag=True):
    pass


class BlockStored(ArrEvent):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str] = None
    extra_keys: Optional[list[Optional[list[Any]]]] = None


class BlockRemoved(ArrEvent):
    block_hashes: list[int]
    medium: Optional[str]


class AllBlocksCleared(ArrEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Union[MapEvent, ArrEvent]]
    data_parallel_rank: Optional[int] = None


def build(event: dict, form: str):
    kind = event["type"]
    if kind == "BlockStored":
        cls = MapBlockStored if form == "map" else BlockStored
        return cls(
            block_hashes=event["block_hashes"],
            parent_block_hash=event.get("parent_block_hash"),
            token_ids=event["token_ids"],
            block_size=event["block_size"],
            lora_id=None,
            medium=event.get("medium", "GPU"),
            lora_name=event.get("lora_name"),
            extra_keys=event.get("extra_keys"),
        )
    if kind == "BlockRemoved":
        cls = MapBlockRemoved if form == "map" else BlockRemoved
        return cls(block_hashes=event["block_hashes"], medium=event.get("medium", "GPU"))
    return MapAllBlocksCleared() if form == "map" else AllBlocksCleared()


def main() -> None:
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub_port = pub.bind_to_random_port("tcp://127.0.0.1")
    router = ctx.socket(zmq.ROUTER)
    replay_port = router.bind_to_random_port("tcp://127.0.0.1")
    encoder = msgspec.msgpack.Encoder()
    kept: dict[int, bytes] = {}
    print(json.dumps({"events": f"tcp://127.0.0.1:{pub_port}", "replay": f"tcp://127.0.0.1:{replay_port}"}), flush=True)

    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    poller.register(sys.stdin, zmq.POLLIN)
    deadline = time.monotonic() + 120  # never outlive a stuck test
    while time.monotonic() < deadline:
        for sock, _ in poller.poll(1000):
            if sock is router:
                ident, _empty, start = router.recv_multipart()
                first = int.from_bytes(start, "big")
                for seq in sorted(kept):
                    if seq >= first:
                        router.send_multipart([ident, b"", TOPIC, seq.to_bytes(8, "big"), kept[seq]])
                router.send_multipart([ident, b"", TOPIC, END, b""])
                continue
            line = sys.stdin.readline()
            if not line:
                return
            cmd = json.loads(line)
            if cmd["op"] == "quit":
                return
            if cmd["op"] == "raw":
                # Arbitrary frames (hex), for garbage tests; not kept for replay.
                pub.send_multipart([bytes.fromhex(f) for f in cmd["frames"]])
                print(json.dumps({"ok": "raw"}), flush=True)
                continue
            seq = cmd["seq"]
            batch = KVEventBatch(
                ts=time.time(),
                events=[build(e, cmd.get("form", "map")) for e in cmd["events"]],
                data_parallel_rank=0,
            )
            payload = encoder.encode(batch)
            kept[seq] = payload
            if not cmd.get("skip"):
                pub.send_multipart([TOPIC, seq.to_bytes(8, "big"), payload])
            print(json.dumps({"ok": seq}), flush=True)


if __name__ == "__main__":
    main()
