"""kvroute's router core for Python engine integrators.

- ``compute_block_hash_for_seq``: Dynamo-compatible block hashes (multimodal, LoRA);
- ``RadixTree``: which worker holds which block, fed by KV events;
- ``KvEventPublisher``: publish an engine's KV events in vLLM's wire format over ZMQ, so a
  kvroute router (or Dynamo's) can follow the engine's cache.
"""

from ._kvroute import (
    KvEventPublisher,
    OverlapScores,
    RadixTree,
    compute_block_hash_for_seq,
    compute_block_hash_for_seq_py,
)

__all__ = [
    "KvEventPublisher",
    "OverlapScores",
    "RadixTree",
    "compute_block_hash_for_seq",
    "compute_block_hash_for_seq_py",
]
