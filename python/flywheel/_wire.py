"""The binary batch of the training service ("FWB1", docs/TRAINING_API.md, "The binary batch").

Layout, byte by byte::

    "FWB1"            4 bytes
    header_bytes      u32, little-endian
    header            UTF-8 JSON object, header_bytes long
    arrays            back to back, in the order header["arrays"] lists them, no padding

``header["arrays"]`` lists ``{"name", "dtype", "count"}``; dtype is ``i32``, ``f32`` or
``u64`` (4, 4 and 8 bytes per element, little-endian). The rest of the header is the call's
(``lengths``, ``seq``, ``loss``, ...), carried as it is.

:func:`encode` takes flat arrays as lists, ``array.array``, ``memoryview``/``bytes`` of the
element type, or numpy arrays; :func:`decode` returns numpy arrays when numpy is importable
(``array.array`` otherwise). With numpy, neither direction loops over elements in Python.
:func:`decode` checks everything a peer could get wrong (magic, header size and JSON, each
array's name, dtype and count against the body's size, ``lengths``) and raises
:class:`WireError` naming what and where.
"""

from __future__ import annotations

import array
import json
import math
import struct
import sys
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from .errors import FlywheelError

try:  # numpy is optional: the fast path when present
    import numpy as _np
except ImportError:  # pragma: no cover - exercised where numpy is missing
    _np = None

MAGIC = b"FWB1"
CONTENT_TYPE = "application/x-flywheel-batch"
_PREFIX = struct.Struct("<4sI")  # magic, header_bytes

#: dtype -> (bytes per element, numpy little-endian dtype, array typecode)
DTYPES: Dict[str, Tuple[int, str, str]] = {
    "i32": (4, "<i4", ""),
    "f32": (4, "<f4", "f"),
    "u64": (8, "<u8", ""),
}


def _typecode(size: int, signed: bool) -> str:
    """The array module's typecode of an integer of ``size`` bytes (C's sizes vary)."""
    for code in ("i", "l", "q") if signed else ("I", "L", "Q"):
        if array.array(code).itemsize == size:
            return code
    raise RuntimeError(f"this Python's array module has no {size}-byte integer")  # pragma: no cover


DTYPES["i32"] = (4, "<i4", _typecode(4, True))
DTYPES["u64"] = (8, "<u8", _typecode(8, False))
_LIMITS = {"i32": (-(1 << 31), (1 << 31) - 1), "u64": (0, (1 << 64) - 1)}


class WireError(FlywheelError, ValueError):
    """A batch that does not follow the FWB1 layout, or values that do not fit a dtype."""


def have_numpy() -> bool:
    return _np is not None


def _use_numpy(use_numpy: Optional[bool]) -> bool:
    if use_numpy and _np is None:
        raise WireError("use_numpy=True but numpy is not importable")
    return _np is not None if use_numpy is None else bool(use_numpy)


def array_bytes(name: str, dtype: str, values: Any, use_numpy: Optional[bool] = None) -> bytes:
    """The little-endian bytes of the flat array ``values`` as ``dtype``.

    Integers must fit the dtype (a token id above 2^31 is an error, not wrapped); floats are
    rounded to f32. Raises WireError naming the array.
    """
    if dtype not in DTYPES:
        raise WireError(f"array {name!r}: unknown dtype {dtype!r} (i32, f32, u64)")
    size, np_dtype, typecode = DTYPES[dtype]
    if isinstance(values, (bytes, bytearray, memoryview)):
        data = bytes(values)
        if len(data) % size:
            raise WireError(f"array {name!r}: {len(data)} bytes is not a whole number of "
                            f"{dtype} elements")
        return data  # taken as already little-endian
    if _use_numpy(use_numpy):
        source = values if isinstance(values, _np.ndarray) else _np.asarray(values)
        # A list of Python ints that numpy could only hold as float or object (beyond int64):
        # checked exactly, value by value, below.
        if source.dtype.kind not in "Of" or dtype == "f32" or isinstance(values, _np.ndarray):
            return _numpy_bytes(name, dtype, source, np_dtype)
    try:
        if isinstance(values, array.array) and values.typecode == typecode:
            packed = array.array(typecode, values)
        else:
            packed = array.array(typecode, _python_values(name, dtype, values))
    except WireError:
        raise
    except (OverflowError, TypeError, ValueError) as error:
        raise WireError(f"array {name!r}: values do not fit {dtype}: {error}") from None
    if sys.byteorder == "big":  # pragma: no cover - no big-endian CI
        packed.byteswap()
    return packed.tobytes()


def _python_values(name: str, dtype: str, values: Any) -> Any:
    """Values the array module takes for ``dtype``: integers checked to be integral."""
    if dtype == "f32":
        return [float(v) for v in values]
    out = []
    for v in values:
        if isinstance(v, float):
            if not v.is_integer():
                raise WireError(f"array {name!r}: {v!r} is not an integer ({dtype})")
            v = int(v)
        elif isinstance(v, bool) or not hasattr(v, "__index__"):
            raise WireError(f"array {name!r}: {v!r} is not an integer ({dtype})")
        out.append(v.__index__())
    return out


def _numpy_bytes(name: str, dtype: str, source: Any, np_dtype: str) -> bytes:
    if source.ndim != 1:
        source = source.reshape(-1)
    if source.size == 0:
        return b""
    if dtype == "f32":
        if source.dtype.kind not in "fiub":
            raise WireError(f"array {name!r}: dtype {source.dtype} is not numeric")
        return _np.ascontiguousarray(source, dtype=np_dtype).tobytes()
    kind = source.dtype.kind
    if kind == "f":
        if not _np.all(_np.isfinite(source)) or not _np.all(source == _np.round(source)):
            raise WireError(f"array {name!r}: non-integer values for {dtype}")
    elif kind not in "iub":
        raise WireError(f"array {name!r}: dtype {source.dtype} is not integral ({dtype})")
    low, high = _LIMITS[dtype]
    if kind == "f":
        in_range = float(source.min()) >= low and float(source.max()) <= high
    else:
        # int() of the extremes: no wrap-around in the comparison whatever the source type.
        in_range = int(source.min()) >= low and int(source.max()) <= high
    if not in_range:
        raise WireError(f"array {name!r}: values outside {dtype}'s range "
                        f"[{low}, {high}] (min {source.min()}, max {source.max()})")
    return _np.ascontiguousarray(source, dtype=np_dtype).tobytes()


def encode(header: Mapping[str, Any], arrays: Sequence[Tuple[str, str, Any]],
           use_numpy: Optional[bool] = None) -> bytes:
    """One FWB1 body: ``header`` (without ``arrays``, which is filled in) and the flat arrays
    ``(name, dtype, values)`` in that order. Raises WireError for a bad dtype or value, or a
    header that is not JSON-serialisable; ``header`` may not carry ``arrays`` itself."""
    if "arrays" in header:
        raise WireError("the header's 'arrays' is written by encode(), not given")
    _use_numpy(use_numpy)  # refuses use_numpy=True without numpy, even for no arrays
    listing: List[Dict[str, Any]] = []
    chunks: List[bytes] = []
    seen = set()
    for name, dtype, values in arrays:
        if name in seen:
            raise WireError(f"array {name!r} given twice")
        seen.add(name)
        data = array_bytes(name, dtype, values, use_numpy)
        listing.append({"name": name, "dtype": dtype, "count": len(data) // DTYPES[dtype][0]})
        chunks.append(data)
    document = dict(header)
    document["arrays"] = listing
    try:
        text = json.dumps(document, allow_nan=False, separators=(",", ":")).encode("utf-8")
    except (TypeError, ValueError) as error:
        raise WireError(f"batch header is not JSON: {error}") from None
    return b"".join([_PREFIX.pack(MAGIC, len(text)), text] + chunks)


def decode(body: bytes, use_numpy: Optional[bool] = None
           ) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``(header, arrays)`` of an FWB1 body; ``arrays`` maps name to a flat numpy array
    (native byte order, writable) or ``array.array``.

    Checks, in order: the 8-byte prefix and magic, header_bytes against the body, the header
    (UTF-8 JSON object; ``arrays`` a list of {name, dtype, count}, names unique; ``lengths``,
    when present, a list of ints >= 1), and that the arrays fill the rest of the body
    exactly. Raises WireError naming the field or byte offset.
    """
    data = memoryview(body)
    if data.format != "B" or data.ndim != 1:
        data = data.cast("B")
    if len(data) < _PREFIX.size:
        raise WireError(f"batch of {len(data)} bytes is shorter than its 8-byte prefix")
    magic, header_bytes = _PREFIX.unpack_from(data, 0)
    if magic != MAGIC:
        raise WireError(f"bad magic {bytes(magic)!r} at byte 0 (expected {MAGIC!r})")
    header_end = _PREFIX.size + header_bytes
    if header_end > len(data):
        raise WireError(f"header_bytes {header_bytes} at byte 4 runs past the body's "
                        f"{len(data)} bytes")
    try:
        header = json.loads(bytes(data[_PREFIX.size:header_end]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise WireError(f"header (bytes 8..{header_end}) is not UTF-8 JSON: {error}") from None
    if not isinstance(header, dict):
        raise WireError(f"header is a JSON {type(header).__name__}, not an object")
    listing = header.get("arrays")
    if not isinstance(listing, list):
        raise WireError("header has no 'arrays' list")
    _check_lengths(header)
    numpy = _use_numpy(use_numpy)
    arrays: Dict[str, Any] = {}
    offset = header_end
    for index, entry in enumerate(listing):
        name, dtype, count = _array_entry(index, entry)
        if name in arrays:
            raise WireError(f"header arrays[{index}]: array {name!r} listed twice")
        size, np_dtype, typecode = DTYPES[dtype]
        end = offset + count * size
        if end > len(data):
            raise WireError(f"array {name!r} ({count} x {dtype}) at byte {offset} runs past the "
                            f"body's {len(data)} bytes")
        if numpy:
            view = _np.frombuffer(data, dtype=np_dtype, count=count, offset=offset)
            arrays[name] = view.astype(np_dtype[1:], copy=True)
        else:
            values = array.array(typecode)
            values.frombytes(data[offset:end])
            if sys.byteorder == "big":  # pragma: no cover
                values.byteswap()
            arrays[name] = values
        offset = end
    if offset != len(data):
        raise WireError(f"{len(data) - offset} bytes after the last array (byte {offset}); "
                        "the header's counts do not match the body")
    return header, arrays


def _check_lengths(header: Dict[str, Any]) -> None:
    if "lengths" not in header:
        return
    lengths = header["lengths"]
    if not isinstance(lengths, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 1 for t in lengths):
        raise WireError("header 'lengths' must be a list of integers >= 1")


def _array_entry(index: int, entry: Any) -> Tuple[str, str, int]:
    where = f"header arrays[{index}]"
    if not isinstance(entry, dict):
        raise WireError(f"{where} is not an object")
    name, dtype, count = entry.get("name"), entry.get("dtype"), entry.get("count")
    if not isinstance(name, str) or not name:
        raise WireError(f"{where}: 'name' must be a non-empty string")
    if dtype not in DTYPES:
        raise WireError(f"{where} ({name!r}): unknown dtype {dtype!r} (i32, f32, u64)")
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise WireError(f"{where} ({name!r}): 'count' must be an integer >= 0, got {count!r}")
    return name, dtype, count


# ---------------------------------------------------------------------------------------
# Per-datum fields: flat arrays <-> one sequence per datum


def concat(name: str, dtype: str, parts: Sequence[Any], use_numpy: Optional[bool] = None
           ) -> Tuple[bytes, List[int]]:
    """The bytes of ``parts`` back to back as ``dtype``, and each part's element count."""
    chunks = [array_bytes(name, dtype, part, use_numpy) for part in parts]
    size = DTYPES[dtype][0]
    return b"".join(chunks), [len(c) // size for c in chunks]


def split(name: str, flat: Any, lengths: Sequence[int], per_token: Optional[int] = 1
          ) -> List[Any]:
    """``flat`` cut into one piece per datum of ``lengths[i] * per_token`` elements.

    ``per_token=None`` infers it (routing: T x layers x top_k per datum): the count must be a
    whole multiple of sum(lengths). Raises WireError when the counts do not add up."""
    total = sum(lengths)
    count = len(flat)
    if per_token is None:
        if total == 0 or count % total:
            raise WireError(f"array {name!r}: {count} values is not a multiple of the "
                            f"{total} tokens of the batch")
        per_token = count // total
    if count != total * per_token:
        raise WireError(f"array {name!r}: {count} values, but the lengths need "
                        f"{total} x {per_token}")
    pieces, offset = [], 0
    for t in lengths:
        end = offset + t * per_token
        pieces.append(flat[offset:end])
        offset = end
    return pieces


def finite(values: Any) -> bool:
    """Whether every value of a flat float array is finite (no NaN or inf)."""
    if _np is not None and isinstance(values, _np.ndarray):
        return bool(_np.all(_np.isfinite(values)))
    return all(math.isfinite(v) for v in values)
