"""The wire format between ``rolloutpipe.train``'s proxies and the worker hosts, for hosts
written in Python (the vLLM engines and the PyTorch trainer).

A frame is ``b"RPW1"``, u32 LE part count n, n u64 LE part lengths, then the parts; part 0 is
a JSON header (serde's externally tagged enums: ``"OptStep"`` or ``{"Step": {...}}``), the
others binary (safetensors blobs). Floats that feed training (log-probs, rewards) travel as
their f32 bit patterns. ``harness/src/train/wire.rs`` is the reference; a frame this module
cannot read raises :class:`WireFormatError`, never anything else.
"""

import json
import struct

import numpy as np

MAGIC = b"RPW1"
MAX_PARTS = 16


class WireFormatError(ValueError):
    """A frame that is not a RolloutPipe wire frame, or whose header is not JSON."""


def encode(header, parts=()):
    """One frame: ``header`` as compact JSON, then the binary ``parts``."""
    head = json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
    parts = [head] + [bytes(p) for p in parts]
    table = struct.pack(f"<4sI{len(parts)}Q", MAGIC, len(parts), *map(len, parts))
    return b"".join([table] + parts)


def decode(frame):
    """``(header, parts)`` of a frame: the JSON header as Python values and the binary parts
    as memoryviews into ``frame``."""
    frame = bytes(frame) if not isinstance(frame, (bytes, bytearray)) else frame
    if len(frame) < 8 or frame[:4] != MAGIC:
        raise WireFormatError("not a RolloutPipe wire frame: no RPW1 magic")
    n = int.from_bytes(frame[4:8], "little")
    if not 1 <= n <= MAX_PARTS:
        raise WireFormatError("not a RolloutPipe wire frame: part count out of range")
    if len(frame) < 8 + 8 * n:
        raise WireFormatError("not a RolloutPipe wire frame: truncated part table")
    view, at, parts = memoryview(frame), 8 + 8 * n, []
    for length in struct.unpack_from(f"<{n}Q", frame, 8):
        if at + length > len(frame):
            raise WireFormatError("not a RolloutPipe wire frame: truncated part")
        parts.append(view[at:at + length])
        at += length
    if at != len(frame):
        raise WireFormatError("not a RolloutPipe wire frame: trailing bytes after the last part")
    try:
        header = json.loads(bytes(parts[0]))
    except ValueError as e:
        raise WireFormatError(f"bad message header: {e}") from None
    return header, parts[1:]


def variant(header):
    """``(name, body)`` of an externally tagged enum value: ``"OptStep"`` -> ``("OptStep",
    None)``, ``{"Step": {...}}`` -> ``("Step", {...})``."""
    if isinstance(header, str):
        return header, None
    if isinstance(header, dict) and len(header) == 1:
        (name, body), = header.items()
        return name, body
    raise WireFormatError(f"bad message header: not an enum value: {str(header)[:80]}")


def f32_bits(values):
    """f32 values as their u32 bit patterns (exact through JSON, NaN included)."""
    return np.asarray(values, dtype=np.float32).view(np.uint32).tolist()


def f32_from_bits(bits):
    """The f32 values of u32 bit patterns, as a float32 array."""
    return np.asarray(bits, dtype=np.uint32).view(np.float32)


def f32_bit(value):
    """One f32's bit pattern."""
    return int(np.float32(value).view(np.uint32))


def f32_from_bit(bit):
    """One f32 from its bit pattern (as a Python float)."""
    return float(np.uint32(bit).view(np.float32))
