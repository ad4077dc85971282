"""Authenticated frames for the control plane: what keeps anyone who can reach a node's socket
but does not hold the cluster's key from speaking to it.

The launcher draws one key per cluster (`new_control_key`) and hands it to the router and every
node. Each PUSH socket signs what it sends with a `FrameSigner`, each PULL socket opens what it
receives with a `FrameVerifier`. A frame is

    version (1 byte) | sender id (8 bytes) | counter (8 bytes) | message | HMAC-SHA256 (32 bytes)

integers big-endian, `message` the bytes of `metadata.messages.encode`. The HMAC covers the
destination endpoint (which both ends know, and which does not travel) and every byte before it:
a frame is good for one socket only. The sender id is drawn at random per PUSH socket and the
counter counts its frames from 1; a verifier takes a sender's frame only if its counter is above
the last one it took from that sender, so a frame captured and sent again is refused.

A verifier drops anything else (too short, another version, a wrong HMAC: unsigned, tampered, or
signed with another key; replayed), counts it in `rejected`, and logs at most one line per
REJECT_LOG_INTERVAL_S, so a flood of bad frames cannot flood the log. Only frames with a good
HMAC enter its table of senders: its size is bounded by the cluster's sockets."""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import struct
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

KEY_BYTES = 32
FRAME_VERSION = 1
REJECT_LOG_INTERVAL_S = 10.0
_HEADER = struct.Struct(">BQQ")  # version, sender id, counter
_TAG_BYTES = hashlib.sha256().digest_size


def new_control_key() -> bytes:
    """A fresh cluster key."""
    return secrets.token_bytes(KEY_BYTES)


def _checked_key(key: bytes) -> bytes:
    if not isinstance(key, bytes) or len(key) < KEY_BYTES:
        raise ValueError(f"a control-plane key is at least {KEY_BYTES} bytes (new_control_key)")
    return key


def _tag(key: bytes, endpoint: bytes, signed: memoryview | bytes) -> bytes:
    mac = hmac.new(key, struct.pack(">H", len(endpoint)) + endpoint, hashlib.sha256)
    mac.update(signed)
    return mac.digest()


class FrameSigner:
    """Signs the frames of one PUSH socket, connected to `endpoint`. One thread only."""

    def __init__(self, key: bytes, endpoint: str) -> None:
        self._key = _checked_key(key)
        self._endpoint = endpoint.encode()
        self.sender_id = secrets.randbits(64)
        self._counter = 0

    def sign(self, message: bytes) -> bytes:
        self._counter += 1
        signed = _HEADER.pack(FRAME_VERSION, self.sender_id, self._counter) + message
        return signed + _tag(self._key, self._endpoint, signed)


class FrameVerifier:
    """Opens the frames that reach one PULL socket, bound at `endpoint`. One thread only; read
    `rejected` from any."""

    def __init__(
        self,
        key: bytes,
        endpoint: str,
        *,
        log_interval_s: float = REJECT_LOG_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        on_reject: Callable[[], None] | None = None,
    ) -> None:
        """`on_reject`: told of every message dropped (a metrics counter)."""
        self._key = _checked_key(key)
        self._on_reject = on_reject
        self.endpoint = endpoint
        self._endpoint = endpoint.encode()
        self._last_counter: dict[int, int] = {}
        self.rejected = 0
        self._log_interval_s = log_interval_s
        self._clock = clock
        self._logged_at = float("-inf")
        self._unlogged = 0

    def open(self, frame: bytes) -> bytes | None:
        """The message of an authentic frame not seen before; None for anything else, which
        is counted and (throttled) logged."""
        if len(frame) < _HEADER.size + _TAG_BYTES:
            return self.reject(f"a frame of {len(frame)} bytes is too short")
        view = memoryview(frame)
        signed, tag = view[:-_TAG_BYTES], view[-_TAG_BYTES:]
        if frame[0] != FRAME_VERSION:
            return self.reject(f"frame version {frame[0]}, expected {FRAME_VERSION}")
        if not hmac.compare_digest(tag, _tag(self._key, self._endpoint, signed)):
            return self.reject("unsigned, tampered with, or signed with another key")
        _, sender, counter = _HEADER.unpack_from(frame)
        if counter <= self._last_counter.get(sender, 0):
            return self.reject(f"replayed (sender {sender:#018x}, counter {counter})")
        self._last_counter[sender] = counter
        return bytes(signed[_HEADER.size :])

    def reject(self, reason: str) -> None:
        """Count a dropped message; log it unless a line went out less than the log interval
        ago, in which case the next line counts it."""
        self.rejected += 1
        self._unlogged += 1
        if self._on_reject is not None:
            self._on_reject()
        now = self._clock()
        if now - self._logged_at < self._log_interval_s:
            return None
        log.warning(
            "%s: dropped %d control message(s) since the last report (%d in all); latest: %s",
            self.endpoint,
            self._unlogged,
            self.rejected,
            reason,
        )
        self._logged_at, self._unlogged = now, 0
        return None
