"""The orders rank 0 sends its followers (engine/tensor_parallel/forward_plan.py), each opened by
a header of HEADER_SIZE int64."""

from __future__ import annotations

import enum


class Order(enum.IntEnum):
    STOP = 0
    FORWARD = 1  # ModelRunner.forward
    EVERY_TOKEN = 2  # ModelRunner.forward_every_token
    # The KV links' orders (link_orders.LinkOrder), run by ModelRunner.run_link_order.
    OPEN_LINKS = 3
    SEND_KV = 4
    RECV_KV = 5
    LAND_KV = 6
    FORGET_PEER = 7


# order, keep_hidden, tokens, requests, table width, has embeddings, has tree masks (a link
# order: LinkOrder.header, as long)
HEADER_SIZE = 7
LINK_ORDERS = (Order.OPEN_LINKS, Order.SEND_KV, Order.RECV_KV, Order.LAND_KV, Order.FORGET_PEER)
