"""Streamed safetensors shards: two writers of one stream (as two trainer ranks export) each write their own
shards and keep only those tensors; together they give the standard sharded folder, the same tensors bitwise."""

import json

import torch
from safetensors.torch import load_file

from reflow.trainer.hf_shards import ShardWriter


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {f"model.layers.{i}.w": torch.randn(16, 8, generator=g) for i in range(7)}  # 512 bytes each


def _export(out, writers: int, shard_bytes: int) -> list[dict]:
    """Every writer sees the whole stream; returns what each one materialized."""
    materialized = []
    for writer in range(writers):
        sink = ShardWriter(str(out), shard_bytes, writer=writer, writers=writers)
        seen = {}
        for name, tensor in _tensors().items():
            sink.add(name, tensor.numel() * 4, lambda name=name, tensor=tensor: seen.setdefault(name, tensor))
        sink.close()
        materialized.append(seen)
    return materialized


def test_two_writers_write_alternate_shards_and_the_index_names_them_all(tmp_path):
    tensors = _tensors()
    materialized = _export(tmp_path, writers=2, shard_bytes=1024)  # two tensors a shard: 4 shards
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-{k:05d}-of-00004.safetensors" for k in range(1, 5)]
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in tensors.values())
    loaded = {}
    for name in files:
        loaded.update(load_file(str(tmp_path / name)))
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], v) for k, v in tensors.items())
    # each writer copied only its own shards' tensors (shards 1 and 3 for writer 0, 2 and 4 for writer 1)
    by_file = {k: index["weight_map"][k] for k in tensors}
    for writer, seen in enumerate(materialized):
        assert {by_file[k] for k in seen} == {files[writer], files[writer + 2]}
    assert not list(tmp_path.glob("*.tmp"))


def test_one_shard_is_model_safetensors_without_an_index_and_replaces_an_earlier_export(tmp_path):
    _export(tmp_path, writers=2, shard_bytes=1024)
    _export(tmp_path, writers=1, shard_bytes=1 << 30)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    assert load_file(str(tmp_path / "model.safetensors")).keys() == _tensors().keys()
