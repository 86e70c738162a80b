"""The stored response: `Response`, which of its headers are stored (`storable_headers`), the
snapshot format they are stored in (`encode_snapshot`, `decode_snapshot`: versioned binary, never
pickle), the replay (`replayed`) and capturing the app's response (`ResponseCapture`). Pure
functions, no I/O; `oncely.http._semantics` exports them with the rest of the HTTP contract."""

from __future__ import annotations

import functools
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import TYPE_CHECKING, Final

from oncely.http._request import HOP_BY_HOP, Header

if TYPE_CHECKING:
    from oncely.http._policy import HttpPolicy


# -- responses ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Response:
    """A complete response: what is stored, replayed, or answered by the middleware itself.

    Attributes:
        status: The status code.
        headers: (name, value) byte pairs, in order, duplicates kept.
        body: The body.
        reason: The reason phrase the app gave (WSGI), or ``b""`` for the standard one.
    """

    status: int
    headers: tuple[Header, ...]
    body: bytes
    reason: bytes = b""

    def status_line(self) -> str:
        """The WSGI status line, ``"201 Created"``."""
        reason = self.reason.decode("latin-1") if self.reason else _phrase(self.status)
        return f"{self.status} {reason}"


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"


def storable_headers(headers: Iterable[Header], policy: HttpPolicy) -> tuple[Header, ...]:
    """The response headers that are stored and replayed.

    Hop-by-hop headers, those the ``Connection`` header names, and `HttpPolicy.unreplayed_headers`
    (``set-cookie`` by default) are left out.
    """
    headers = tuple(headers)
    dropped_names = policy.dropped_headers
    kept = []
    for header in headers:
        name = header[0].lower()
        if name == b"connection":
            return _storable_after_connection(headers, policy)
        if name not in dropped_names:
            kept.append(header)
    # Without a Connection header, the names dropped are the policy's, all ASCII: comparing
    # ASCII-lower-cased bytes agrees with comparing latin-1 text lower-cased.
    return tuple(kept)


def _storable_after_connection(
    headers: tuple[Header, ...], policy: HttpPolicy
) -> tuple[Header, ...]:
    dropped: set[str] = set(HOP_BY_HOP)
    dropped.update(policy.unreplayed_headers)
    for name, value in headers:
        if name.lower() == b"connection":
            dropped.update(token.strip().lower() for token in value.decode("latin-1").split(","))
    return tuple(
        (name, value) for name, value in headers if name.decode("latin-1").lower() not in dropped
    )


def replayed(snapshot: bytes, policy: HttpPolicy) -> Response:
    """The response for a repeat: the stored one, byte for byte, plus the replay marker.

    Raises:
        ValueError: *snapshot* is not a response snapshot (a foreign or damaged record).
    """
    if policy.replay_header is None:
        return decode_snapshot(snapshot)
    return _decode(snapshot, _marker(policy.replay_header))  # one Response, the marker last


@functools.lru_cache(maxsize=32)
def _marker(replay_header: tuple[str, str]) -> Header:
    name, value = replay_header
    return (name.lower().encode("ascii"), value.encode("ascii"))


# -- the stored response snapshot -----------------------------------------------------------------

_MAGIC: Final = b"oncely-http"
_VERSION: Final = 1
_HEAD: Final = struct.Struct(">11sBHBH")  # magic, version, status, reason length, header count
_NAME: Final = struct.Struct(">H")
_VALUE: Final = struct.Struct(">I")
_BODY: Final = struct.Struct(">Q")


def encode_snapshot(response: Response) -> bytes:
    """Serialise *response* into the stored snapshot format (version 1).

    Layout, big-endian: ``b"oncely-http"``, version (u8), status (u16), reason length (u8),
    header count (u16), the reason, then per header the name length (u16), name, value length
    (u32) and value, then the body length (u64) and the body. Binary-safe: the body is stored
    as is.

    Raises:
        ValueError: A field is out of range (status, a reason over 255 bytes...).
    """
    return _encode(response.status, response.headers, response.body, response.reason)


def _encode(
    status: int,
    headers: Sequence[Header],
    body: bytes,
    reason: bytes,
    policy: HttpPolicy | None = None,
    prefix: bytes = b"",
) -> bytes:
    """`encode_snapshot`; with a *policy*, of the `storable_headers` of *headers* only (filtered
    as they are written: this runs on every stored response), behind *prefix* (the stored
    outcome's frame: the snapshot is joined once, not copied again to be framed)."""
    if not 100 <= status <= 999:
        raise ValueError(f"status {status} is out of range")
    if len(reason) > 255:
        reason = b""
    dropped = () if policy is None else policy.dropped_headers
    parts = [prefix, b"", reason]  # the head second, once the headers kept are counted
    count = 0
    name_length, value_length = _NAME.pack, _VALUE.pack
    for name, value in headers:
        if dropped:
            lowered = name.lower()
            if lowered in dropped:
                if lowered == b"connection" and policy is not None:  # it names more to drop
                    kept = storable_headers(headers, policy)
                    return _encode(status, kept, body, reason, None, prefix)
                continue
        parts += (name_length(len(name)), name, value_length(len(value)), value)
        count += 1
    parts += (_BODY.pack(len(body)), body)
    parts[1] = _HEAD.pack(_MAGIC, _VERSION, status, len(reason), count)
    return b"".join(parts)


def decode_snapshot(data: bytes) -> Response:
    """Rebuild a response from `encode_snapshot`'s bytes.

    Raises:
        ValueError: *data* is not a snapshot of a known version, or is truncated or padded.
    """
    return _decode(data, None)


def _decode(data: bytes, marker: Header | None) -> Response:
    """`decode_snapshot`, with *marker* (if any) after the stored headers."""
    data = bytes(data)
    size = len(data)
    if size < _HEAD.size:
        raise ValueError("the stored response is truncated")
    magic, version, status, reason_length, count = _HEAD.unpack_from(data)
    if magic != _MAGIC:
        raise ValueError("the stored value is not an oncely HTTP response")
    if version != _VERSION:
        raise ValueError(f"the stored response has unknown format version {version}")
    offset = _HEAD.size + reason_length
    reason = data[_HEAD.size : offset]
    headers: list[Header] = []
    # Each field is its length, then its bytes. A length read past the end raises
    # struct.error; a field cut short leaves the offset past the end, for the check below.
    name_length, value_length = _NAME.unpack_from, _VALUE.unpack_from
    try:
        for _ in range(count):
            start = offset + _NAME.size
            end = start + name_length(data, offset)[0]
            offset = end + _VALUE.size
            following = offset + value_length(data, end)[0]
            headers.append((data[start:end], data[offset:following]))
            offset = following
        start = offset + _BODY.size
        offset = start + _BODY.unpack_from(data, offset)[0]
    except struct.error:
        raise ValueError("the stored response is truncated") from None
    body = data[start:offset]
    if offset != size:  # past the end when the reason or the last field is truncated
        raise ValueError(
            "the stored response has trailing bytes"
            if offset < size
            else "the stored response is truncated"
        )
    if marker is not None:
        headers.append(marker)
    return Response(status, tuple(headers), body, reason)


# -- capturing the app's response ---------------------------------------------------------------


@dataclass(slots=True, eq=False)
class ResponseCapture:
    """Accumulates the response an app sends, deciding what is stored as it goes.

    The body is kept only while the status is one that is stored and the size is within
    `HttpPolicy.max_response_bytes`; past the limit the kept bytes are dropped (`overflowed`).

    Attributes:
        limit: The largest body kept.
        status: The status, once started.
        reason: The reason phrase (WSGI), or ``b""``.
        headers: The response headers as sent.
        size: Body bytes seen so far.
        overflowed: The body grew past *limit*.
        complete: The app sent its final body chunk.
    """

    limit: int
    keep: bool = True
    status: int = 0
    reason: bytes = b""
    headers: tuple[Header, ...] = ()
    chunks: list[bytes] = field(default_factory=list)
    size: int = 0
    overflowed: bool = False
    complete: bool = False

    @property
    def started(self) -> bool:
        """Whether the app has started its response."""
        return self.status != 0

    def start(
        self, status: int, headers: Iterable[Header], policy: HttpPolicy, reason: bytes = b""
    ) -> None:
        """Record the response's status line and headers."""
        self.status = status
        self.reason = reason
        self.headers = tuple(headers)
        self.keep = status in policy.stored_statuses  # `HttpPolicy.stores`, one call less
        self.chunks.clear()
        self.size = 0
        self.overflowed = False

    def add(self, chunk: bytes) -> None:
        """Record a body chunk."""
        if not chunk:
            return
        self.size += len(chunk)
        if self.size > self.limit:
            if not self.overflowed:
                self.overflowed = True
                self.chunks.clear()
        elif self.keep:
            self.chunks.append(bytes(chunk))

    def snapshot(self, policy: HttpPolicy, prefix: bytes = b"") -> bytes:
        """The stored form of the captured response (headers filtered for storage), behind
        *prefix*."""
        body = b"".join(self.chunks)
        return _encode(self.status, self.headers, body, self.reason, policy, prefix)
