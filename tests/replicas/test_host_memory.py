"""Host memory: the KV cache zeroed, shaped, aligned to huge pages and alive as long as the tensor;
the weights moved into one huge-page mapping."""

from __future__ import annotations

import gc

import torch

from replicas import host_memory


def test_large_tensors_are_zeroed_aligned_and_outlive_the_call() -> None:
    t = host_memory.zeros((3, 2, 1024, 512), torch.bfloat16)  # 6 MiB
    assert t.shape == (3, 2, 1024, 512) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % (2 << 20) == 0
    assert not t.any()
    gc.collect()  # only the tensor holds the mapping now
    t[2, 1, -1, -1] = 7.0
    t[0].fill_(1.0)
    assert int((t == 1.0).sum()) == 2 * 1024 * 512 and float(t[2, 1, -1, -1]) == 7.0
    assert int((t != 0).sum()) == 2 * 1024 * 512 + 1


def test_small_tensors_are_plain_zeros() -> None:
    t = host_memory.zeros((4, 8), torch.float32)
    assert t.shape == (4, 8) and not t.any()


def test_weights_move_to_one_huge_page_mapping_in_order() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(2000, 512), torch.nn.Linear(512, 2000),
                                torch.nn.LayerNorm(2000))
    model[1].weight = model[0].weight  # one Parameter in two modules (tied embeddings)
    # the same storage under a Parameter of its own (tied by a loader that knew no better)
    model[2].register_parameter("alias", torch.nn.Parameter(model[0].weight.data))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    distinct = [model[0].weight, model[1].bias, model[2].weight, model[2].bias]
    moved = host_memory.weights_to_huge_pages(model)
    assert moved == sum(-(-p.numel() * p.element_size() // 64) * 64 for p in distinct)
    first = distinct[0].data_ptr()
    assert first % (2 << 20) == 0
    offsets = [p.data_ptr() - first for p in distinct]
    # one mapping, in registration order, each on a cache line
    assert offsets == sorted(offsets) and all(o % 64 == 0 for o in offsets)
    assert offsets[-1] < moved
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    assert model[1].weight is model[0].weight
    assert model[2].alias.data_ptr() == first  # not copied twice
    gc.collect()  # the parameters alone hold the mapping
    out = model(torch.tensor([[1, 2, 3]]))
    assert out.shape == (1, 3, 2000) and torch.isfinite(out).all()


def test_weights_under_a_huge_page_stay_where_they_are() -> None:
    model = torch.nn.Linear(16, 16)
    ptr = model.weight.data_ptr()
    assert host_memory.weights_to_huge_pages(model) == 0
    assert model.weight.data_ptr() == ptr


def test_a_loaded_models_weights_sit_in_one_huge_page_mapping() -> None:
    """What the worker does with every CPU model it loads (after packing)."""
    from replicas.model_files import resolve_model_path
    from replicas.worker import ShardWorker, WorkerConfig
    worker = ShardWorker(WorkerConfig(str(resolve_model_path("shardserve/tiny-llama")),
                                      "float32", num_blocks=8, block_size=16))
    params = list(worker.runner.model.parameters())
    first = params[0].data_ptr()
    ends = [p.data_ptr() + p.numel() * p.element_size() - first for p in params]
    assert first % (2 << 20) == 0
    assert all(p.data_ptr() >= first for p in params)
    assert max(ends) <= sum(-(-p.numel() * p.element_size() // 64) * 64 for p in params)


def test_loose_tensors_move_the_same_way() -> None:
    big = [torch.randn(1024, 1024), torch.arange(1000, dtype=torch.uint8)]
    moved = host_memory.tensors_to_huge_pages(big)
    assert all(torch.equal(a, b) for a, b in zip(big, moved))
    assert moved[0].data_ptr() % (2 << 20) == 0
    assert moved[1].data_ptr() - moved[0].data_ptr() == 4 * 1024 * 1024
    small = [torch.ones(4)]
    assert host_memory.tensors_to_huge_pages(small)[0].data_ptr() == small[0].data_ptr()
