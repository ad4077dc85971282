"""The data plane: a request's KV (target pool, then each draft depth's pool) and its metadata row,
moved from a prefill rank to a decode rank with torch.distributed p2p (NCCL on GPU, gloo on CPU).

Contract (the control plane keeps it; tests/test_transfer.py checks the data plane's side):
- the prefill node announces each transfer (room, number of tokens) before `KVSender.send`
  (right before the forward that completes the request's prompt, so that the receives are
  posted by the time the forward is done), and sends it in the same step; the decode node
  calls `KVReceiver.expect` in announcement order per source rank, with slot lists of the
  announced length. A receive's deadline hence covers the
  prefill's forward too. NCCL matches p2p operations by order alone, so both sides must post one
  order per pair (gloo also matches the tag, derived from the room; NCCL ignores it);
- the sender posts on the caller's thread and stream (the serving thread: one thread, so one
  order per pair); the receiver posts on a FIFO worker thread per source rank, in the order of
  the `expect` calls. On each side one worker thread per peer waits for the posted operations
  and finishes the transfer: transfers to (from) different peers never wait on each other;
- on the wire, one message per pool with at least one slot, its KV as
  [n, num_layers, 2 (K, V), num_kv_heads, head_dim] bytes, in pool order, then one message with
  the metadata row's bytes (`MetadataBuffers.row_bytes`: its fields in `FIELDS` order, room
  last); all of one transfer's messages are posted as one batch (`batch_isend_irecv`, one NCCL
  group) with one tag. Only tensors travel: no pickle;
- each side reads (fills) a pool straight from (into) the pool when ITS slots there are one
  ascending contiguous run, else through a staging tensor (gather before sending, scatter after
  landing). Message sizes do not depend on that choice, so each side makes it alone (`KVSource`);
- the receiver lands the row in a staging tensor and copies it into its row after everything
  landed: the room tag is checked once that copy completed, and a late receive never writes a
  row handed to another request;
- a handle is SUCCESS only once everything landed (on CUDA: the side stream synchronized) and the
  received room tag matches; the caller keeps the slots and the row untouched until the handle is
  terminal, then frees them (sender) or uses them (receiver). Except after a timeout
  (`handle.may_still_write` on the receiver, `handle.may_still_read` on the sender): the
  transfer's operations stay posted and may still fill the receiver's slots or read the sender's
  slots and row whenever the peer gets to them, so those must never be handed to another request;
- a posted p2p operation cannot be cancelled (NCCL; and a gloo wait that times out closes every
  pair of the process group, so none is used). Hence: every announced transfer must be sent, a
  transfer that misses its deadline breaks the channel with that peer for good on both backends
  (later ones fail at once; other peers are unaffected; recovery is a new pair group: `attach`),
  and a handle may be failed by the caller (`handle.fail`) only while it is still queued and only
  if the peer will not send it either (TransferAbandoned);
- `connect(peer)` on both sides, before the first transfer, opens the channel (NCCL creates the
  pair's communicator then, blocking until both ranks join). On NCCL each pair has its own
  two-rank process group: a batch of p2p operations on a group runs on that group's
  communicator, which for the whole world would need every rank to join, and a group's batch
  state is not safe to share between the worker threads of several peers;
- the cluster's nodes give each peer a channel of its own (`attach`, metadata.pair_group): a
  pair group that no other pair shares. Attaching a new channel for a peer (the peer was
  replaced) starts a new worker for it; what was queued for the old channel fails, and a job the
  old worker is still waiting on fails when the dead peer's sockets close (gloo) or its
  communicator is aborted (NCCL). A peer reported dead (`forget_peer`) fails whatever is queued
  for it and every later transfer with it at once, until a channel is attached again. Without
  `attach`, channels are made on the process's default group (`channel_to`), as two-process
  tests do.

The pieces: metadata.kv_sender (KVSender), metadata.kv_receiver (KVReceiver), the worker threads
and channels they share in metadata.peer_workers, the handle in metadata.transfer_handle and the
message layout in metadata.wire.
"""

from metadata.kv_receiver import KVReceiver
from metadata.kv_sender import KVSender
from metadata.transfer_handle import TransferHandle, TransferState

__all__ = ["KVReceiver", "KVSender", "TransferHandle", "TransferState"]
