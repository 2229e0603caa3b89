"""Times ``RadixTree.apply_event`` and ``find_matches`` from Python on 10k- and 100k-block
trees: ``python -m kvroute.bench``."""

import json
import random
import time

from kvroute import RadixTree

BLOCKS_PER_SEQ = 256
CHUNK = 64


def events_for(seq: int, rng: random.Random) -> list[bytes]:
    locals_ = [rng.getrandbits(63) for _ in range(BLOCKS_PER_SEQ)]
    out, parent = [], None
    for c in range(0, BLOCKS_PER_SEQ, CHUNK):
        blocks = [{"block_hash": seq << 20 | i, "tokens_hash": locals_[i]} for i in range(c, c + CHUNK)]
        out.append(json.dumps({"event_id": c, "data": {"stored": {"parent_hash": parent, "blocks": blocks}}}).encode())
        parent = blocks[-1]["block_hash"]
    return out, locals_


def main() -> None:
    print("| blocks | apply_event (64-block events) | find_matches 256-block hit | find_matches miss |")
    print("|---|---|---|---|")
    for total in (10_000, 100_000):
        rng = random.Random(7)
        tree = RadixTree()
        seqs = total // BLOCKS_PER_SEQ
        prepared = [events_for(s, rng) for s in range(seqs)]
        start = time.perf_counter()
        n = 0
        for s, (events, _) in enumerate(prepared):
            for e in events:
                tree.apply_event(s % 8, e)
                n += 1
        apply_us = (time.perf_counter() - start) / n * 1e6
        queries = [locals_ for _, locals_ in prepared[:64]]
        reps = 2_000
        start = time.perf_counter()
        for i in range(reps):
            tree.find_matches(queries[i % len(queries)])
        hit_us = (time.perf_counter() - start) / reps * 1e6
        miss = [rng.getrandbits(63) for _ in range(BLOCKS_PER_SEQ)]
        start = time.perf_counter()
        for _ in range(reps):
            tree.find_matches(miss)
        miss_us = (time.perf_counter() - start) / reps * 1e6
        print(f"| {len(tree)} | {apply_us:.1f} us/event | {hit_us:.1f} us | {miss_us:.1f} us |")


if __name__ == "__main__":
    main()
