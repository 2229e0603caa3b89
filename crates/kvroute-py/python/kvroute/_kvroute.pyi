"""Type stubs of kvroute's native module (re-exported by ``kvroute``)."""

from typing import Any, Optional, Sequence, Union

BlockMmInfos = Optional[Sequence[Optional[dict[str, Any]]]]
"""One entry per block: ``None`` or ``{"mm_objects": [{"mm_hash": int, "offsets": [[start, end]]}]}``."""

def compute_block_hash_for_seq(
    tokens: Sequence[int],
    kv_block_size: int,
    block_mm_infos: BlockMmInfos = None,
    lora_name: Optional[str] = None,
) -> list[int]:
    """Block hashes of ``tokens``: one per *full* block of ``kv_block_size`` tokens,
    bit-compatible with Dynamo's ``compute_block_hash_for_seq`` (xxh3-64, seed 1337).

    A block that covers an image folds the image's ``mm_hash`` into its hash, so the same
    placeholder tokens with a different image give a different block. ``lora_name`` salts the
    hashes per adapter. Raises ``ValueError`` for ``kv_block_size == 0`` or bad
    ``block_mm_infos`` values, ``TypeError`` for ``block_mm_infos`` of the wrong shape.

    >>> compute_block_hash_for_seq(list(range(20)), 16)   # the 4-token tail is not hashed
    [15310707395893867146]
    """

def compute_block_hash_for_seq_py(
    tokens: Sequence[int],
    kv_block_size: int,
    block_mm_infos: BlockMmInfos = None,
    lora_name: Optional[str] = None,
) -> list[int]:
    """Dynamo's older name for :func:`compute_block_hash_for_seq`."""

class OverlapScores:
    """How many leading blocks of a query each cache holds."""

    scores: dict[tuple[int, int], int]
    """``{(worker_id, dp_rank): leading blocks held}``, for caches holding at least one."""
    tree_sizes: dict[tuple[int, int], int]
    """``{(worker_id, dp_rank): blocks held in all}`` for the same caches."""

class RadixTree:
    """Which worker holds which KV block.

    >>> tree = RadixTree()
    >>> tree.apply_event(7, {"event_id": 1, "data": {"stored": {"parent_hash": None,
    ...     "blocks": [{"block_hash": 100, "tokens_hash": 1}, {"block_hash": 101, "tokens_hash": 2}]}}})
    >>> tree.find_matches([1, 2, 3]).scores
    {(7, 0): 2}
    """

    def __init__(self) -> None: ...
    def apply_event(self, worker_id: int, event: Union[bytes, str, dict[str, Any]]) -> None:
        """Applies one KV cache event (Dynamo's JSON shape: ``stored``, ``removed`` or
        ``"cleared"``). Raises ``ValueError`` for an event that cannot be read; a Stored event
        whose parent the worker does not hold is ignored."""
    def find_matches(self, local_hashes: Sequence[int], early_exit: bool = False) -> OverlapScores:
        """Leading blocks of ``local_hashes`` each (worker_id, dp_rank) holds. With
        ``early_exit``, the walk stops once a single cache still matches."""
    def remove_worker(self, worker_id: int) -> None:
        """Forgets every block of every dp rank of the worker, and the worker."""
    def clear_all_blocks(self, worker_id: int) -> None:
        """Drops every block of the worker (all dp ranks), keeping it known."""
    def dump_tree_as_events(self) -> list[str]:
        """``RouterEvent`` JSON strings that, applied in order to an empty tree, rebuild it."""
    def tree_size(self, worker_id: int, dp_rank: int = 0) -> int:
        """Blocks the worker's dp rank holds."""
    def __len__(self) -> int:
        """Distinct blocks in the tree."""

class KvEventPublisher:
    """Publishes an engine's KV events as vLLM does (ZMQ PUB, msgpack batches), with an
    optional ROUTER socket replaying the last batches to a router that missed them.

    >>> pub = KvEventPublisher("tcp://127.0.0.1:0", 16, replay_endpoint="tcp://127.0.0.1:0")
    >>> pub.publish_stored(0, list(range(32)), [16, 16], [111, 222])
    >>> pub.close()
    """

    endpoint: str
    """The PUB endpoint actually bound (a port 0 resolved)."""
    replay_endpoint: Optional[str]

    def __init__(
        self,
        endpoint: str,
        kv_block_size: int,
        topic: str = "",
        replay_endpoint: Optional[str] = None,
        replay_buffer: int = 10000,
    ) -> None: ...
    def publish_stored(
        self,
        event_id: int,
        token_ids: Sequence[int],
        num_block_tokens: Sequence[int],
        block_hashes: Sequence[int],
        lora_id: Optional[int] = None,
        parent_hash: Optional[int] = None,
        block_mm_infos: BlockMmInfos = None,
        lora_name: Optional[str] = None,
    ) -> None:
        """Publishes newly filled blocks (full blocks only: every ``num_block_tokens`` entry
        equals ``kv_block_size``); images go out as vLLM ``extra_keys``."""
    def publish_removed(self, event_id: int, block_hashes: Sequence[int]) -> None: ...
    def publish_cleared(self) -> None: ...
    def close(self) -> None: ...
    def __enter__(self) -> "KvEventPublisher": ...
    def __exit__(self, *exc: object) -> None: ...
