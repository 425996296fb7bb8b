"""Protobuf wire format, the little that streaming a message to a file needs.

A length-delimited field is its tag (field number, wire type 2), the payload's length as a
varint, and the payload. Protobuf lets a message's fields come in any order, and merges a message
field that appears twice, so large messages can be written piece by piece from buffers that are
never copied into one serialised string.
"""

from __future__ import annotations


def varint(value: int) -> bytes:
    """``value`` (non-negative) as a base-128 varint."""
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def tag(number: int) -> bytes:
    """The tag of length-delimited field ``number``."""
    return varint(number << 3 | 2)


def header(number: int, length: int) -> bytes:
    """What precedes a length-delimited field's ``length`` payload bytes."""
    return tag(number) + varint(length)


def field(number: int, payload: bytes) -> bytes:
    """A whole length-delimited field."""
    return header(number, len(payload)) + payload
