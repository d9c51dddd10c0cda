"""Request bodies sent compressed (`Content-Encoding`): bytes as sent -> the body's bytes.

    decode_content(raw, header, max_bytes) -> bytes

`gzip` (also `x-gzip`), `deflate` (zlib's format, RFC 9110) and `identity` are decoded, several
in the order they were applied (`gzip, gzip`). The size limit applies to what decoding yields,
and decoding stops as soon as it is passed, so a small body that inflates to gigabytes (a zip
bomb) costs at most `max_bytes` of memory. Errors: `UnsupportedEncodingError` for any other
coding (the server's 415), `BodyTooLargeError` (413), `InvalidRequestError` for a body that is
not what its header says (400): such a body is never read as plain JSON.

It decodes bytes and nothing else.
"""

from __future__ import annotations

import zlib

from dspark_trt.errors import DsparkError, InvalidRequestError

_WINDOW_BITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


class UnsupportedEncodingError(DsparkError):
    """A Content-Encoding this server does not decode."""


class BodyTooLargeError(DsparkError):
    """The decoded body is larger than the server's limit."""


def decode_content(raw: bytes, header: str | None, max_bytes: int) -> bytes:
    codings = [coding.strip().lower() for coding in (header or "").split(",") if coding.strip()]
    for coding in reversed(codings):  # the last applied is undone first
        if coding == "identity":
            continue
        if coding not in _WINDOW_BITS:
            raise UnsupportedEncodingError(f"unsupported Content-Encoding {coding!r}: this server decodes gzip, "
                                           "deflate or identity")
        raw = _inflate(raw, coding, max_bytes)
    return raw


def _inflate(raw: bytes, coding: str, max_bytes: int) -> bytes:
    out, rest = [], raw
    size = 0
    while True:  # a gzip body may hold several members, one after another (RFC 1952)
        inflater = zlib.decompressobj(_WINDOW_BITS[coding])
        try:
            chunk = inflater.decompress(rest, max_bytes - size + 1)
        except zlib.error as e:
            raise InvalidRequestError(f"the request body is not valid {coding} data ({e})") from None
        size += len(chunk)
        if size > max_bytes:
            raise BodyTooLargeError(f"the request body decodes to more than this server's limit of {max_bytes} bytes "
                                    "(serve --max-body-bytes)")
        out.append(chunk)
        if not inflater.eof:
            raise InvalidRequestError(f"the request body is truncated {coding} data")
        rest = inflater.unused_data
        if coding == "deflate" or not rest:
            break
    if rest:
        raise InvalidRequestError(f"the request body has bytes after its {coding} data")
    return b"".join(out)
