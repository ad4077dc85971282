"""A node re-pairs its ranks' KV links with a replaced peer (ServingNode.repair, metadata.rank_kv)
on its serving thread, and the opening waits up to the transfer timeout for the peer's ends
(its ranks may be slow to open theirs): the repair returns once the links are open, however
much longer than an ordinary call to the serving thread that takes, so that the cluster sends
the pair no transfer before. Nodes over the tiny model on CPU (tests/
node_builders.py): a prefill node of two ranks and a decode node of one, whose links cross."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from node_builders import built, new_decode_node, new_prefill_node

import metadata.serving_node
from metadata.pair_group import PairLink
from metadata.process_group import create_store_server

PREFILL_RANK, DECODE_RANK = 0, 1
# How much later than its channel the replaced peer opens its ends of the links: longer than
# the wait for an ordinary call to the serving thread (PEER_LOST_WAIT_S, shortened below).
LATE_S = 3.0


def _link(port: int, peer: int, epoch: int, peer_tp: int, name: str) -> PairLink:
    return PairLink("127.0.0.1", port, peer, epoch, peer_tp, name)


def test_a_repair_returns_once_the_links_are_open(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(metadata.serving_node, "PEER_LOST_WAIT_S", 0.5)
    store, port = create_store_server("127.0.0.1")
    prefill_node = new_prefill_node(tiny_model_path, 256, 4, tensor_parallel_size=2)
    with built(prefill_node) as prefill, built(new_decode_node(tiny_model_path, 256, 4)) as decode:
        pairings = [
            (prefill, PREFILL_RANK, _link(port, DECODE_RANK, 0, 1, "decode-0")),
            (decode, DECODE_RANK, _link(port, PREFILL_RANK, 0, 2, "prefill-0")),
        ]
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda p: p[0].pair_with(p[1], [p[2]]), pairings))
        assert decode.rank_kv.uses_links(PREFILL_RANK)
        decode.start()
        # The prefill node is replaced: its successor pairs under epoch 1, its links late.
        pair = prefill.rank_kv.pair

        def late_pair(*args) -> None:
            time.sleep(LATE_S)
            pair(*args)

        monkeypatch.setattr(prefill.rank_kv, "pair", late_pair)
        successor = threading.Thread(
            target=prefill.pair_with,
            args=(PREFILL_RANK, [_link(port, DECODE_RANK, 1, 1, "decode-0")]),
        )
        successor.start()
        decode.repair(_link(port, PREFILL_RANK, 1, 2, "prefill-0"))
        assert decode.rank_kv.is_open(PREFILL_RANK)
        successor.join()
    del store
