"""kestrel.runtime.checkpoint: safetensors headers, load planning, loading and atomic saving."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch

from kestrel.errors import OutputError
from kestrel.runtime import checkpoint as ckpt
from kestrel.runtime.checkpoint import (
    CheckpointError,
    Expected,
    TensorInfo,
    checkpoint_files,
    load_tensors,
    plan_load,
    read_header,
    read_headers,
    safetensors_dtype,
    save_tensors,
)

transformers = pytest.importorskip("transformers")


# ------------------------------------------------------------------------------------------------------------
# Fixtures: a tiny ViT saved by transformers itself


@pytest.fixture(scope="module")
def vit():
    torch.manual_seed(0)
    config = transformers.ViTConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        image_size=32,
        patch_size=8,
    )
    return transformers.ViTModel(config).eval()


@pytest.fixture(scope="module")
def checkpoint_state(vit) -> dict[str, torch.Tensor]:
    """The state dict as save_pretrained writes it to disk.

    transformers 5 renames some modules internally (``layers.0.attention.q_proj``) and reverts to the
    original checkpoint names (``encoder.layer.0.attention.attention.query``) when saving, so the file is
    compared with the reverted state dict.
    """
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(vit, vit.state_dict())


@pytest.fixture(scope="module")
def saved(vit, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vit")
    dirs = {"single": root / "single", "sharded": root / "sharded", "native": root / "native"}
    vit.save_pretrained(dirs["single"])
    vit.save_pretrained(dirs["sharded"], max_shard_size="20KB")
    vit.save_pretrained(dirs["native"], save_original_format=False)
    return dirs


def expected_from(state: dict[str, torch.Tensor]) -> dict[str, Expected]:
    return {name: Expected(tuple(t.shape), safetensors_dtype(t.dtype)) for name, t in state.items()}


def assert_headers_match(headers: dict[str, TensorInfo], state: dict[str, torch.Tensor]) -> None:
    assert sorted(headers) == sorted(state)
    for name, tensor in state.items():
        assert headers[name].name == name
        assert headers[name].shape == tuple(tensor.shape), name
        assert headers[name].dtype == safetensors_dtype(tensor.dtype), name


# ------------------------------------------------------------------------------------------------------------
# Reading headers of real checkpoints


def test_single_file_headers_match_state_dict(saved, checkpoint_state):
    files = checkpoint_files(saved["single"])
    assert files == [saved["single"] / "model.safetensors"]
    headers = read_headers(saved["single"])
    assert_headers_match(headers, checkpoint_state)
    assert {info.file for info in headers.values()} == {files[0]}


def test_headers_agree_with_safetensors_itself(saved):
    file = saved["single"] / "model.safetensors"
    ours = read_header(file)
    with safetensors.safe_open(str(file), framework="pt") as f:
        assert sorted(f.keys()) == sorted(ours)
        for name in f.keys():
            piece = f.get_slice(name)
            assert tuple(piece.get_shape()) == ours[name].shape
            assert piece.get_dtype() == ours[name].dtype


def test_native_format_headers_match_model_state_dict(saved, vit):
    assert_headers_match(read_headers(saved["native"]), vit.state_dict())


def test_sharded_checkpoint_is_the_union_of_its_shards(saved, checkpoint_state):
    files = checkpoint_files(saved["sharded"])
    assert len(files) > 1
    index = json.loads((saved["sharded"] / "model.safetensors.index.json").read_text())
    assert sorted(f.name for f in files) == sorted(set(index["weight_map"].values()))

    headers = read_headers(saved["sharded"])
    assert_headers_match(headers, checkpoint_state)
    for name, info in headers.items():
        assert info.file.name == index["weight_map"][name]
    # every shard contributes, and the union is the disjoint union of the per-shard headers
    per_shard = [read_header(f) for f in files]
    assert all(per_shard)
    assert sum(len(h) for h in per_shard) == len(headers)
    single = read_headers(saved["single"])
    assert {n: (i.shape, i.dtype) for n, i in headers.items()} == {
        n: (i.shape, i.dtype) for n, i in single.items()
    }


def test_plan_and_load_round_trip(saved, checkpoint_state):
    for kind in ("single", "sharded"):
        headers = read_headers(saved[kind])
        plan = plan_load(headers, expected_from(checkpoint_state), lambda name: name)
        assert plan == headers
        tensors = load_tensors(plan)
        assert sorted(tensors) == sorted(checkpoint_state)
        for name, tensor in checkpoint_state.items():
            torch.testing.assert_close(tensors[name], tensor, rtol=0, atol=0)


def test_load_converts_float_dtype_and_renames(saved, checkpoint_state):
    headers = read_headers(saved["single"])
    # the model wants BF16 and its own parameter paths; the pooler is deliberately not loaded
    expected = {
        "model." + name: Expected(tuple(t.shape), "BF16")
        for name, t in checkpoint_state.items()
        if not name.startswith("pooler.")
    }

    def bindings(name: str) -> str | None:
        return None if name.startswith("pooler.") else "model." + name

    plan = plan_load(headers, expected, bindings)
    assert sorted(plan) == sorted(expected)
    tensors = load_tensors(plan, dtype=torch.bfloat16)
    for path, tensor in tensors.items():
        assert tensor.dtype == torch.bfloat16
        torch.testing.assert_close(tensor, checkpoint_state[path.removeprefix("model.")].to(torch.bfloat16))


def test_load_keeps_integer_tensors(tmp_path):
    path = tmp_path / "mixed.safetensors"
    save_tensors({"ids": torch.arange(5), "w": torch.ones(2, dtype=torch.float16)}, path)
    headers = read_headers(path)
    plan = plan_load(headers, {"ids": Expected((5,), "I64"), "w": Expected((2,), "F32")}, lambda n: n)
    out = load_tensors(plan, dtype=torch.float32)
    assert out["ids"].dtype == torch.int64 and out["w"].dtype == torch.float32
    with pytest.raises(ValueError, match="floating-point"):
        load_tensors(plan, dtype=torch.int32)


# ------------------------------------------------------------------------------------------------------------
# plan_load errors


def plan_error(headers, expected, bindings) -> list[str]:
    with pytest.raises(CheckpointError) as info:
        plan_load(headers, expected, bindings)
    return str(info.value).splitlines()


def only(lines: list[str], kind: str) -> str:
    found = [line for line in lines if line.strip().startswith(kind)]
    assert len(found) == 1, lines
    return found[0]


QUERY = "encoder.layer.0.attention.attention.query.weight"


def test_missing_parameter(saved, checkpoint_state):
    headers = read_headers(saved["single"])
    expected = expected_from(checkpoint_state) | {"head.weight": Expected((10, 32), "F32")}
    lines = plan_error(headers, expected, lambda n: n)
    assert len(lines) == 2  # summary + one problem
    line = only(lines, "missing")
    assert "'head.weight'" in line and "(10, 32)" in line and "F32" in line
    assert str(saved["single"] / "model.safetensors") in lines[0]
    # an optional parameter may be absent
    expected["head.weight"] = Expected((10, 32), "F32", optional=True)
    assert plan_load(headers, expected, lambda n: n) == headers


def test_unexpected_tensor(saved, checkpoint_state):
    headers = read_headers(saved["single"])
    expected = expected_from(checkpoint_state)
    del expected["pooler.dense.bias"]
    mapping = {n: n for n in expected}
    line = only(plan_error(headers, expected, mapping.__getitem__), "unexpected")
    assert "'pooler.dense.bias'" in line and "(32,)" in line and "F32" in line
    assert str(saved["single"] / "model.safetensors") in line
    # bound to a path the model does not have: also unexpected
    line = only(plan_error(headers, expected, lambda n: n), "unexpected")
    assert "'pooler.dense.bias'" in line and "not a parameter" in line
    # deliberately unused: fine
    plan = plan_load(headers, expected, lambda n: None if n == "pooler.dense.bias" else n)
    assert "pooler.dense.bias" not in plan


def test_misshapen_tensor(saved, checkpoint_state):
    headers = read_headers(saved["single"])
    expected = expected_from(checkpoint_state)
    expected["q.weight"] = Expected((32, 16), "F32")
    del expected[QUERY]
    line = only(plan_error(headers, expected, lambda n: "q.weight" if n == QUERY else n), "shape mismatch")
    assert "'q.weight'" in line and repr(QUERY) in line
    assert "(32, 16)" in line and "(32, 32)" in line
    assert line.index("(32, 16)") < line.index("(32, 32)")  # expected first, then actual
    assert str(saved["single"] / "model.safetensors") in line


def test_integer_vs_float_is_an_error_but_float_conversion_is_not(saved, checkpoint_state):
    headers = read_headers(saved["single"])
    expected = expected_from(checkpoint_state)
    expected["embeddings.cls_token"] = Expected((1, 1, 32), "I64")
    line = only(plan_error(headers, expected, lambda n: n), "dtype mismatch")
    assert "'embeddings.cls_token'" in line and "I64" in line and "F32" in line
    assert "integer vs float" in line
    for float_dtype in ("F16", "BF16", "F64"):
        expected["embeddings.cls_token"] = Expected((1, 1, 32), float_dtype)
        assert "embeddings.cls_token" in plan_load(headers, expected, lambda n: n)


def test_two_tensors_for_one_parameter(saved, checkpoint_state):
    headers = read_headers(saved["single"])
    expected = expected_from(checkpoint_state)
    del expected["encoder.layer.0.attention.attention.key.weight"]
    key = "encoder.layer.0.attention.attention.key.weight"
    line = only(plan_error(headers, expected, lambda n: QUERY if n == key else n), "duplicate")
    assert repr(QUERY) in line and repr(key) in line
    assert str(saved["single"] / "model.safetensors") in line


def test_all_problems_are_reported_at_once(saved, checkpoint_state):
    headers = read_headers(saved["single"])
    expected = expected_from(checkpoint_state)
    del expected["pooler.dense.bias"]  # -> unexpected
    expected["head.weight"] = Expected((10, 32), "F32")  # -> missing
    expected["embeddings.cls_token"] = Expected((1, 1, 64), "F32")  # -> shape mismatch
    expected["embeddings.position_embeddings"] = Expected((1, 17, 32), "I32")  # -> dtype mismatch
    key = "encoder.layer.0.attention.attention.key.weight"
    del expected[key]

    def bindings(name: str) -> str:
        if name == "pooler.dense.bias":
            raise KeyError(name)
        return QUERY if name == key else name  # -> duplicate

    lines = plan_error(headers, expected, bindings)
    assert "5 problems" in lines[0]
    for kind in ("missing", "unexpected", "shape mismatch", "dtype mismatch", "duplicate"):
        only(lines, kind)


def test_expected_validates_dtype_spelling():
    with pytest.raises(ValueError, match="safetensors dtype"):
        Expected((1,), "float32")
    assert Expected(torch.Size([2, 3]), "F32").shape == (2, 3)


# ------------------------------------------------------------------------------------------------------------
# Malformed files: our header parser refuses them, and so does safetensors itself


def write_raw(path: Path, header: dict | bytes, data: bytes = b"", length: int | None = None) -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


def assert_refused(path: Path, *fragments: str) -> str:
    with pytest.raises(CheckpointError) as info:
        read_header(path)
    message = str(info.value)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message, message
    with pytest.raises(safetensors.SafetensorError):  # we are not stricter than the format
        with safetensors.safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                f.get_tensor(name)
    return message


def test_truncated_file(saved, tmp_path):
    source = saved["single"] / "model.safetensors"
    cut = tmp_path / "model.safetensors"
    cut.write_bytes(source.read_bytes()[:-100])
    assert_refused(cut, "truncated")


def test_truncated_shard_is_named(saved, tmp_path):
    directory = tmp_path / "sharded"
    directory.mkdir()
    for f in saved["sharded"].iterdir():
        (directory / f.name).write_bytes(f.read_bytes())
    victim = checkpoint_files(directory)[1]
    victim.write_bytes(victim.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="truncated") as info:
        read_headers(directory)
    assert str(victim) in str(info.value)


def test_file_cut_inside_the_header(saved, tmp_path):
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes((saved["single"] / "model.safetensors").read_bytes()[:50])
    assert_refused(cut, "header length", "exceeds")


def test_garbage_header(tmp_path):
    assert_refused(write_raw(tmp_path / "g.safetensors", b"this is not json at all"), "not valid")
    assert_refused(write_raw(tmp_path / "l.safetensors", b"[1, 2, 3]"), "expected an object")
    random = tmp_path / "r.safetensors"
    random.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 64)
    assert_refused(random, "header length")


def test_header_length_larger_than_file(tmp_path):
    path = write_raw(tmp_path / "h.safetensors", b"{}", length=1 << 20)
    assert_refused(path, "header length 1048576", "exceeds")


def test_tiny_and_missing_files(tmp_path):
    tiny = tmp_path / "tiny.safetensors"
    tiny.write_bytes(b"\x02\0\0")
    with pytest.raises(CheckpointError, match="3 bytes") as info:
        read_header(tiny)
    assert str(tiny) in str(info.value)
    with pytest.raises(CheckpointError, match="does not exist"):
        read_header(tmp_path / "nope.safetensors")


F32_2x3 = {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}


@pytest.mark.parametrize(
    ("header", "data", "fragments"),
    [
        ({"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]}}, bytes(20), ["needs 24"]),
        ({"a": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 1]}}, bytes(1), ["unknown dtype 'Q7'"]),
        ({"a": {"dtype": "F32", "shape": [2, 3]}}, bytes(24), ["lacks data_offsets"]),
        ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}, b"", ["non-negative"]),
        (
            {"a": F32_2x3, "b": {"dtype": "F32", "shape": [1], "data_offsets": [20, 24]}},
            bytes(24),
            ["overlap"],
        ),
        ({"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [8, 32]}}, bytes(32), ["gap"]),
        ({"a": F32_2x3}, bytes(30), ["6 trailing bytes"]),
        ({"a": F32_2x3}, bytes(10), ["truncated"]),
    ],
    ids=["size", "dtype", "keys", "shape", "overlap", "gap", "trailing", "short"],
)
def test_inconsistent_headers(tmp_path, header, data, fragments):
    message = assert_refused(write_raw(tmp_path / "bad.safetensors", header, data), *fragments)
    assert "'a'" in message or "'b'" in message or "trailing" in message


def test_duplicate_json_keys_are_refused(tmp_path):
    raw = b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, "a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}'  # noqa: E501
    with pytest.raises(CheckpointError, match="duplicate key 'a'"):
        read_header(write_raw(tmp_path / "d.safetensors", raw, b"\0"))


def test_parser_agrees_with_safetensors_on_odd_but_valid_files(tmp_path):
    tensors = {
        "scalar": torch.tensor(3.0),
        "empty": torch.zeros(0, 4),
        "bf16": torch.ones(3, dtype=torch.bfloat16),
        "i8": torch.ones(5, dtype=torch.int8),
        "bool": torch.tensor([True, False, True]),
        "f8": torch.zeros(4, dtype=torch.float8_e4m3fn),
        "u8": torch.ones(7, dtype=torch.uint8),
    }
    path = tmp_path / "odd.safetensors"
    safetensors.torch.save_file(tensors, str(path), metadata={"format": "pt", "note": "hi"})
    ours = read_header(path)
    with safetensors.safe_open(str(path), framework="pt") as f:
        assert sorted(f.keys()) == sorted(ours)
        for name in f.keys():
            assert tuple(f.get_slice(name).get_shape()) == ours[name].shape
            assert f.get_slice(name).get_dtype() == ours[name].dtype


# ------------------------------------------------------------------------------------------------------------
# Directories


def test_pickled_only_directory_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"never unpickled")
    with pytest.raises(CheckpointError) as info:
        checkpoint_files(tmp_path)
    message = str(info.value)
    assert str(tmp_path) in message and "pytorch_model.bin" in message
    assert "pickle" in message and "refused" in message and "safetensors" in message
    assert "save_pretrained" in message  # the conversion hint
    with pytest.raises(CheckpointError, match="refused"):
        read_headers(tmp_path)


def test_index_naming_a_missing_shard(saved, tmp_path):
    directory = tmp_path / "sharded"
    directory.mkdir()
    for f in saved["sharded"].iterdir():
        (directory / f.name).write_bytes(f.read_bytes())
    gone = checkpoint_files(directory)[-1]
    gone.unlink()
    with pytest.raises(CheckpointError) as info:
        checkpoint_files(directory)
    assert gone.name in str(info.value) and "model.safetensors.index.json" in str(info.value)


def test_index_that_disagrees_with_shards(tmp_path):
    save_tensors({"a": torch.zeros(1)}, tmp_path / "s1.safetensors")
    save_tensors({"b": torch.zeros(1)}, tmp_path / "s2.safetensors")
    index = {
        "metadata": {},
        "weight_map": {"a": "s2.safetensors", "b": "s2.safetensors", "c": "s1.safetensors"},
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as info:
        read_headers(tmp_path)
    assert "'a'" in str(info.value) and "'c'" in str(info.value)


def test_tensor_in_two_shards(tmp_path):
    save_tensors({"a": torch.zeros(1), "x": torch.zeros(2)}, tmp_path / "s1.safetensors")
    save_tensors({"a": torch.zeros(1), "y": torch.zeros(2)}, tmp_path / "s2.safetensors")
    index = {"weight_map": {"a": "s1.safetensors", "x": "s1.safetensors", "y": "s2.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="stored twice") as info:
        read_headers(tmp_path)
    assert "s1.safetensors" in str(info.value) and "s2.safetensors" in str(info.value)


def test_index_cannot_point_outside_the_directory(tmp_path):
    index = {"weight_map": {"a": "../elsewhere.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="outside"):
        checkpoint_files(tmp_path)


def test_directory_without_weights(tmp_path):
    with pytest.raises(CheckpointError, match="neither"):
        checkpoint_files(tmp_path)
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint_files(tmp_path / "absent")
    single = tmp_path / "weights.safetensors"
    save_tensors({"a": torch.zeros(1)}, single)
    with pytest.raises(CheckpointError, match="pass the file itself"):
        checkpoint_files(tmp_path)
    assert checkpoint_files(single) == [single]


def test_load_wraps_safetensors_errors(tmp_path):
    path = tmp_path / "w.safetensors"
    save_tensors({"a": torch.zeros(4), "b": torch.ones(4)}, path)
    plan = plan_load(read_headers(path), {"a": Expected((4,), "F32"), "b": Expected((4,), "F32")}, str)
    path.write_bytes(path.read_bytes()[:-8])  # corrupted after planning
    with pytest.raises(CheckpointError) as info:
        load_tensors(plan)
    assert str(path) in str(info.value)
    path.unlink()
    with pytest.raises(CheckpointError, match=str(path)):
        load_tensors(plan)


# ------------------------------------------------------------------------------------------------------------
# Atomic saving


def test_save_round_trip_with_metadata(tmp_path):
    path = tmp_path / "out.safetensors"
    tensors = {"w": torch.randn(3, 4), "b": torch.arange(3)}
    save_tensors(tensors, path, metadata={"format": "pt", "source": "kestrel"})
    assert sorted(os.listdir(tmp_path)) == ["out.safetensors"]
    with safetensors.safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "source": "kestrel"}
        for name, tensor in tensors.items():
            assert torch.equal(f.get_tensor(name), tensor)


def test_save_failure_leaves_nothing_behind(tmp_path):
    path = tmp_path / "out.safetensors"
    with pytest.raises(CheckpointError) as info:
        save_tensors({"w": torch.zeros(2), "bad": [1, 2, 3]}, path)  # type: ignore[dict-item]
    assert str(path) in str(info.value)
    assert os.listdir(tmp_path) == []


def test_failure_mid_write_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "out.safetensors"
    save_tensors({"w": torch.zeros(2)}, path)
    before = path.read_bytes()

    def half_write(tensors, filename, metadata=None):
        Path(filename).write_bytes(safetensors.torch.save(tensors)[:20])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", half_write)
    with pytest.raises(CheckpointError, match="No space left") as info:
        save_tensors({"w": torch.ones(1000)}, path)
    assert str(path) in str(info.value)
    assert os.listdir(tmp_path) == ["out.safetensors"]
    assert path.read_bytes() == before


def test_failure_at_rename_leaves_nothing_behind(tmp_path, monkeypatch):
    path = tmp_path / "out.safetensors"

    def broken_replace(src, dst):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OutputError, match="Permission denied"):  # the destination's fault, not the tensors'

        save_tensors({"w": torch.zeros(2)}, path)
    assert os.listdir(tmp_path) == []


def test_interrupt_mid_write_cleans_up_and_propagates(tmp_path, monkeypatch):
    def interrupted(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_tensors({"w": torch.zeros(2)}, tmp_path / "out.safetensors")
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------------------------------------------------
# The hard rule


def test_no_unpickling_anywhere_in_the_runtime():
    for module in (ckpt, pytest.importorskip("kestrel.runtime.hub")):
        source = Path(module.__file__).read_text()
        for forbidden in ("torch.load", "import pickle", "pickle.load", "weights_only"):
            assert forbidden not in source, (module.__name__, forbidden)
