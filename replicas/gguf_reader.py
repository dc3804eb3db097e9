"""A GGUF file's metadata and tensor table, read fast.

gguf-py's `GGUFReader` makes a numpy view of every value it parses: the ~100,000 strings of a
Llama tokenizer's vocabulary and merges took it 4.4 s of a 2-core AMD EPYC Zen 3, on every
engine start of a GGUF model. The weights' loader needs none of them: this reads the same layout
(GGUF v2 and v3, little-endian) with `struct` over one memmap, walks arrays without decoding
them, keeps scalar and string values, and gives each tensor as a memmap slice of its raw bytes
(0.044 s for the default model's file there). transformers still reads the tokenizer with
gguf-py when a GGUF folder is first built (replicas/gguf_checkpoint.py)."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class TensorInfo:
    name: str
    tensor_type: int  # a GGMLQuantizationType value
    data: np.ndarray  # uint8 [..., bytes a row]: a view of the file, GGUF's rows as stored


class GGUFFile:
    """`metadata`: every key whose value is a scalar or a string (arrays are skipped);
    `tensors`: in the file's order. Raises ValueError for a file that is not GGUF, is truncated,
    or names a tensor type gguf-py does not know."""

    def __init__(self, path: str | Path) -> None:
        self._buf = np.memmap(path, dtype=np.uint8, mode="r")
        if bytes(self._buf[:4]) != MAGIC:
            raise ValueError(f"GGUF magic invalid: {bytes(self._buf[:4])!r}")
        self._pos = 4
        version = self._read("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 and 3 are"
                             + ("; a big-endian file" if version & 0xFFFF == 0 else "") + ")")
        n_tensors, n_kv = self._read("<Q"), self._read("<Q")
        self.metadata: dict[str, object] = {}
        for _ in range(n_kv):
            key = self._string()
            kind = self._read("<I")
            if kind == _ARRAY:
                self._skip_array()
            else:
                self.metadata[key] = self._value(kind)
        infos = [self._tensor_info() for _ in range(n_tensors)]
        alignment = int(self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        start = -(-self._pos // alignment) * alignment
        self.tensors: list[TensorInfo] = []
        seen: set[str] = set()
        for name, dims, kind, offset in infos:
            if name in seen:
                raise ValueError(f"tensor {name} appears twice")
            seen.add(name)
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            if dims[0] % block:
                raise ValueError(f"tensor {name}: a row of {dims[0]} is not whole blocks")
            row_bytes = dims[0] // block * type_size
            shape = (*reversed(dims[1:]), row_bytes)
            begin = start + offset
            end = begin + int(np.prod(shape))
            if end > len(self._buf):
                raise ValueError(f"the file is truncated: tensor {name} ends at byte {end}, "
                                 f"past its end ({len(self._buf)})")
            self.tensors.append(TensorInfo(name, kind, self._buf[begin:end].reshape(shape)))

    def _read(self, fmt: str) -> int:
        try:
            (value,) = struct.unpack_from(fmt, self._buf, self._pos)
        except struct.error as exc:
            raise ValueError(f"the file is truncated ({exc})") from exc
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._read("<Q")
        end = self._pos + n
        if end > len(self._buf):
            raise ValueError("the file is truncated: a string runs past its end")
        text = bytes(self._buf[self._pos:end]).decode("utf-8", errors="replace")
        self._pos = end
        return text

    def _value(self, kind: int) -> object:
        if kind == _STRING:
            return self._string()
        fmt = _SCALARS.get(kind)
        if fmt is None:
            raise ValueError(f"unknown GGUF value type {kind}")
        return self._read(fmt)

    def _skip_array(self) -> None:
        kind, count = self._read("<I"), self._read("<Q")
        if kind == _STRING:
            buf, pos = self._buf, self._pos
            try:
                for _ in range(count):  # each string: a u64 length, then its bytes
                    pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
            except struct.error as exc:
                raise ValueError(f"the file is truncated ({exc})") from exc
            self._pos = pos
        elif kind == _ARRAY:
            for _ in range(count):
                self._skip_array()
        elif kind in _SCALARS:
            self._pos += count * struct.calcsize(_SCALARS[kind])
        else:
            raise ValueError(f"unknown GGUF value type {kind}")
        if self._pos > len(self._buf):
            raise ValueError("the file is truncated: an array runs past its end")

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        n_dims = self._read("<I")
        dims = tuple(self._read("<Q") for _ in range(n_dims))
        return name, dims, self._read("<I"), self._read("<Q")
