"""replicas/gguf_reader.py reads what gguf-py's reader reads: each scalar and string value, each
tensor's name, type and bytes (arrays of strings, numbers and arrays walked past), and refuses
a file that is not GGUF or is cut short."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize

from replicas.gguf_reader import GGUFFile


def _write(path: Path) -> Path:
    rng = np.random.default_rng(3)
    writer = GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.block_count", 2)
    writer.add_int64("test.int64", -5)
    writer.add_float32("test.float32", 0.25)
    writer.add_float64("test.float64", 1e-300)
    writer.add_bool("test.bool", True)
    writer.add_string("test.text", "ünïcode ✓")
    writer.add_token_list([f"tok{i}" for i in range(3000)])
    writer.add_token_merges([f"t o{i}" for i in range(2000)])
    writer.add_array("test.ints", list(range(100)))
    writer.add_key_value("test.nested", [[1, 2], [3]], GGUFValueType.ARRAY,
                         sub_type=GGUFValueType.ARRAY)
    writer.add_uint8("test.after", 7)  # read right only if every array before was walked right
    writer.add_tensor("norm.weight", rng.standard_normal(64).astype(np.float32))
    writer.add_tensor("half", rng.standard_normal((3, 64)).astype(np.float16))
    writer.add_tensor("cube", rng.standard_normal((2, 3, 32)).astype(np.float32))
    w = rng.standard_normal((8, 256)).astype(np.float32)
    for kind in (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_1,
                 GGMLQuantizationType.BF16):
        writer.add_tensor(f"w.{kind.name}", quantize(w, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_reads_what_gguf_py_reads(tmp_path: Path) -> None:
    path = _write(tmp_path / "m.gguf")
    ours, theirs = GGUFFile(path), GGUFReader(str(path))
    scalars = {k: f.contents() for k, f in theirs.fields.items()
               if not k.startswith("GGUF.") and f.types[0] != GGUFValueType.ARRAY}
    assert ours.metadata == scalars
    assert ours.metadata["test.after"] == 7 and ours.metadata["test.text"] == "ünïcode ✓"
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, ref in zip(ours.tensors, theirs.tensors):
        assert mine.tensor_type == int(ref.tensor_type)
        assert mine.data.dtype == np.uint8 and mine.data.shape[:-1] == ref.data.shape[:-1]
        assert bytes(mine.data) == bytes(np.ascontiguousarray(ref.data)), mine.name


def test_a_file_not_gguf_or_cut_short_is_refused(tmp_path: Path) -> None:
    path = _write(tmp_path / "m.gguf")
    whole = path.read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + whole[4:])
    with pytest.raises(ValueError, match="GGUF magic"):
        GGUFFile(bad)
    for size in (6, 200, 30_000, len(whole) - 10):  # the header, an array, a string, a tensor
        bad.write_bytes(whole[:size])
        with pytest.raises(ValueError, match="truncated"):
            GGUFFile(bad)
