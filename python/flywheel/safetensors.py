"""A small safetensors writer and reader, and the checkpoint layouts the push API accepts.

Format (https://github.com/huggingface/safetensors): an unsigned 64-bit little-endian
length N, then N bytes of UTF-8 JSON, then the data section. The JSON object maps each
tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to
the data section) plus an optional ``"__metadata__"`` object of string to string. The
tensors tile the data section exactly: contiguous from 0, no gap, no overlap, the last
one ending at the end of the file. The JSON starts with ``{`` and is padded with spaces
so that the data section starts at a multiple of 8 bytes.

:func:`write_state_dict` writes every floating tensor of a mapping as ``BF16`` (what the
fleet serves), in name order. Tensors may be ``torch.Tensor`` or ``numpy.ndarray``; the
conversion rounds to nearest even, as ``tensor.to(torch.bfloat16)`` does.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import IO, Any, Dict, List, Mapping, Optional, Tuple

SINGLE_FILE_NAME = "model.safetensors"
INDEX_FILE_NAME = "model.safetensors.index.json"

#: Bytes per element of each safetensors dtype (sub-byte dtypes are not listed).
DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}

_MAX_HEADER_BYTES = 100_000_000  # the reference reader's limit


class SafetensorsError(ValueError):
    """A file is not a valid safetensors file, or a tensor cannot be written as one."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file: ``begin``/``end`` are absolute file offsets."""

    name: str
    dtype: str
    shape: Tuple[int, ...]
    begin: int
    end: int


# ---------------------------------------------------------------------------------------
# Writing


def _bf16_bytes_torch(name: str, tensor: Any) -> Tuple[Tuple[int, ...], bytes]:
    import torch  # only reached for torch tensors, so torch is importable

    if not tensor.is_floating_point():
        raise SafetensorsError(
            f"tensor '{name}' has dtype {tensor.dtype}; only floating tensors are pushed "
            "(as bf16): leave it out of the mapping")
    converted = tensor.detach().to(device="cpu", dtype=torch.bfloat16).contiguous()
    # numpy has no bfloat16: reinterpret the 16-bit words. Little-endian, as the file.
    words = converted.view(torch.int16).numpy()
    return tuple(converted.shape), words.astype("<i2", copy=False).tobytes()


def _bf16_bytes_numpy(name: str, array: Any) -> Tuple[Tuple[int, ...], bytes]:
    import numpy as np

    if array.dtype.kind != "f":
        raise SafetensorsError(
            f"tensor '{name}' has dtype {array.dtype}; only floating arrays are pushed "
            "(as bf16): leave it out of the mapping")
    bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)
    # Round to nearest even on the upper 16 bits; NaNs stay NaNs (quiet bit set).
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
               >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(array.astype(np.float32, copy=False))
    if nan.any():
        rounded[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return tuple(int(d) for d in array.shape), rounded.astype("<u2", copy=False).tobytes()


def _bf16_bytes(name: str, tensor: Any) -> Tuple[Tuple[int, ...], bytes]:
    module = type(tensor).__module__
    if module.startswith("torch"):
        return _bf16_bytes_torch(name, tensor)
    if module.startswith("numpy"):
        return _bf16_bytes_numpy(name, tensor)
    raise SafetensorsError(
        f"tensor '{name}' is a {type(tensor).__name__}; expected a torch.Tensor or numpy.ndarray")


def encode_header(entries: List[Tuple[str, str, Tuple[int, ...], int]],
                  metadata: Optional[Mapping[str, str]] = None) -> bytes:
    """The length prefix and padded JSON header for tensors laid out in the given order.

    ``entries`` are ``(name, dtype, shape, byte_length)``; their data is contiguous from
    offset 0 in that order. Returns ``8 + N`` bytes with ``8 + N`` a multiple of 8.
    """
    header: Dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, dtype, shape, length in entries:
        if name == "__metadata__":
            raise SafetensorsError("tensor name '__metadata__' is reserved by safetensors")
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + length]}
        offset += length
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-(8 + len(text)) % 8)
    return struct.pack("<Q", len(text)) + text


def write_state_dict(state_dict: Mapping[str, Any], path: str,
                     metadata: Optional[Mapping[str, str]] = None) -> int:
    """Writes every tensor of ``state_dict`` as BF16 to the safetensors file ``path``.

    Names are kept as they are; tensors are laid out in sorted name order. ``metadata``
    becomes ``__metadata__`` (values converted to strings). The file is written under a
    temporary name in the same directory and renamed into place. Returns its size.
    Raises :class:`SafetensorsError` for a non-floating tensor or an unknown type.
    """
    if not state_dict:
        raise SafetensorsError("the state_dict is empty: nothing to write")
    names = sorted(state_dict)
    for name in names:
        if not isinstance(name, str):
            raise SafetensorsError(f"tensor name {name!r} is not a string")
    encoded = [(name, *_bf16_bytes(name, state_dict[name])) for name in names]
    header = encode_header([(name, "BF16", shape, len(data)) for name, shape, data in encoded],
                           metadata)
    temp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(temp, "wb") as out:
            out.write(header)
            for _, _, data in encoded:
                out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, path)
    except BaseException:
        if os.path.exists(temp):
            os.unlink(temp)
        raise
    return len(header) + sum(len(data) for _, _, data in encoded)


# ---------------------------------------------------------------------------------------
# Reading


def read_header(source: IO[bytes], size: int, where: str = "safetensors") -> Tuple[
        List[TensorInfo], Dict[str, str]]:
    """Parses and validates the header of a safetensors image of ``size`` bytes.

    ``source`` is positioned at the image's first byte. Returns the tensors in offset order
    (absolute offsets within the image) and the ``__metadata__``. Raises
    :class:`SafetensorsError` naming ``where`` and the tensor for every violation of the
    format (the same checks as the reference reader).
    """
    prefix = source.read(8)
    if len(prefix) < 8:
        raise SafetensorsError(f"{where}: {size} bytes, shorter than the 8-byte length prefix")
    (header_length,) = struct.unpack("<Q", prefix)
    if header_length > _MAX_HEADER_BYTES or 8 + header_length > size:
        raise SafetensorsError(f"{where}: header length {header_length} is beyond the file "
                               f"({size} bytes) or the {_MAX_HEADER_BYTES}-byte limit")
    text = source.read(header_length)
    if not text.startswith(b"{"):
        raise SafetensorsError(f"{where}: header does not start with '{{'")
    try:
        header = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise SafetensorsError(f"{where}: header is not JSON: {error}") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{where}: header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise SafetensorsError(f"{where}: __metadata__ is not an object of strings")
    data_start = 8 + header_length
    tensors = []
    for name, entry in header.items():
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise SafetensorsError(f"{where}: tensor '{name}': malformed entry {entry!r}") from None
        if dtype not in DTYPE_SIZES:
            raise SafetensorsError(f"{where}: tensor '{name}': unknown dtype {dtype!r}")
        if not all(isinstance(d, int) and d >= 0 for d in shape):
            raise SafetensorsError(f"{where}: tensor '{name}': bad shape {shape!r}")
        count = 1
        for d in shape:
            count *= d
        if end - begin != count * DTYPE_SIZES[dtype] or begin < 0:
            raise SafetensorsError(f"{where}: tensor '{name}': data_offsets [{begin}, {end}] do "
                                   f"not hold {dtype} {shape}")
        tensors.append(TensorInfo(name, dtype, tuple(shape), data_start + begin, data_start + end))
    tensors.sort(key=lambda t: (t.begin, t.end))
    expected = data_start
    for tensor in tensors:
        if tensor.begin != expected:
            raise SafetensorsError(f"{where}: tensor '{tensor.name}' starts at {tensor.begin}, "
                                   f"expected {expected} (gap or overlap)")
        expected = tensor.end
    if expected != size:
        raise SafetensorsError(f"{where}: tensors end at {expected} but the file has {size} bytes")
    return tensors, metadata


def read_file(path: str) -> Tuple[Dict[str, Tuple[str, Tuple[int, ...], bytes]], Dict[str, str]]:
    """Reads a whole safetensors file: ``{name: (dtype, shape, raw bytes)}`` and metadata."""
    with open(path, "rb") as source:
        size = os.fstat(source.fileno()).st_size
        tensors, metadata = read_header(source, size, path)
        out = {}
        for tensor in tensors:
            source.seek(tensor.begin)
            out[tensor.name] = (tensor.dtype, tensor.shape, source.read(tensor.end - tensor.begin))
    return out, metadata


# ---------------------------------------------------------------------------------------
# Checkpoint layouts


@dataclass(frozen=True)
class CheckpointFile:
    """One file of an upload body: its plain ``name`` in the upload and its local path."""

    name: str
    path: str
    size: int


def checkpoint_files(path: str) -> List[CheckpointFile]:
    """The files of the checkpoint at ``path``, in body order.

    ``path`` is a ``.safetensors`` file (uploaded as ``model.safetensors``) or a directory
    holding ``model.safetensors.index.json`` (its shards, in sorted order, then the index)
    or a single ``model.safetensors``. Raises ``FileNotFoundError`` or ``ValueError`` with
    the path when it is none of these or the index names a shard that is not a plain file
    name in the same directory.
    """
    if os.path.isfile(path):
        if not path.endswith(".safetensors"):
            raise ValueError(f"{path}: expected a .safetensors file or a checkpoint directory")
        return [CheckpointFile(SINGLE_FILE_NAME, path, os.path.getsize(path))]
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: no such checkpoint file or directory")
    index_path = os.path.join(path, INDEX_FILE_NAME)
    if os.path.isfile(index_path):
        try:
            with open(index_path, "rb") as index_file:
                weight_map = json.load(index_file)["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"{index_path}: not a safetensors index ({error})") from None
        files = []
        for shard in shards:
            plain = isinstance(shard, str) and shard not in ("", ".", "..") and \
                not any(separator in shard for separator in ("/", "\\"))
            if not plain:
                raise ValueError(f"{index_path}: shard name {shard!r} is not a plain file name")
            shard_path = os.path.join(path, shard)
            if not os.path.isfile(shard_path):
                raise FileNotFoundError(f"{index_path}: shard {shard} does not exist")
            files.append(CheckpointFile(shard, shard_path, os.path.getsize(shard_path)))
        files.append(CheckpointFile(INDEX_FILE_NAME, index_path, os.path.getsize(index_path)))
        return files
    single = os.path.join(path, SINGLE_FILE_NAME)
    if os.path.isfile(single):
        return [CheckpointFile(SINGLE_FILE_NAME, single, os.path.getsize(single))]
    raise FileNotFoundError(
        f"{path}: holds neither {INDEX_FILE_NAME} nor {SINGLE_FILE_NAME}")
