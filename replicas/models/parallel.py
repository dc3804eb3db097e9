"""Tensor-parallel building blocks: column/row-parallel linears, a vocab-parallel embedding and head.

Every parameter carries a `weight_loader` that narrows the full checkpoint tensor to this rank's
shard, so loading is one loop over the checkpoint. With tp_size 1 they are plain layers. Their
matmuls go through `linear`: once loaded, `pack_weights` repacks weights for the native CPU
kernels, which then multiply at every size: bf16 weights for AVX512-BF16's dot products, and
float32 weights whose values are all bf16 (a bf16 checkpoint computing in float32 elsewhere) back
to bf16, widened in registers; block-quantized weights arrive packed from the loader
(`quant.pack`, uint8); torch multiplies everything else."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from replicas import kernels, quant


def tp_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def tp_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def linear(x: torch.Tensor, weight: torch.Tensor, out_features: int,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    if weight.dtype == torch.uint8:  # block-quantized, packed by the loader (quant.pack)
        return kernels.linear_q(x, weight, out_features, bias)
    if weight.dim() == 4:  # packed by pack_weights for bf16 dot products
        return kernels.linear(x, weight, out_features, bias)
    if weight.dim() == 3:  # packed by pack_weights as bf16 for float32 compute
        return kernels.linear_mixed(x, weight, out_features, bias)
    return F.linear(x, weight, bias)


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size ({d})")
    return n // d


class ColumnParallelLinear(nn.Module):
    """Output features split across ranks; the input is replicated. Fused projections (qkv, gate/up)
    list their parts' full output sizes in `shard_sizes` and load each part by index."""

    quant_format: quant.BlockFormat | None = None  # set by the loader with a packed weight

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool = False) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.local_sizes = [_divide(s, self.tp_size, "output features") for s in shard_sizes]
        self.in_features, self.out_features = in_features, sum(self.local_sizes)
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int = 0) -> None:
        size = self.local_sizes[shard]
        offset = sum(self.local_sizes[:shard])
        part = loaded.narrow(0, self.tp_rank * size, size)
        param.data.narrow(0, offset, size).copy_(part)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.out_features, self.bias)


class RowParallelLinear(nn.Module):
    """Input features split across ranks; partial products are summed with an all-reduce."""

    quant_format: quant.BlockFormat | None = None  # set by the loader with a packed weight

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.local_in = _divide(in_features, self.tp_size, "input features")
        self.in_features, self.out_features = self.local_in, out_features
        self.weight = nn.Parameter(torch.empty(out_features, self.local_in), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            # the bias is added once, on rank 0, not once per rank
            self.bias.weight_loader = lambda p, w, shard=0: p.data.copy_(w)
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int = 0) -> None:
        param.data.copy_(loaded.narrow(1, self.tp_rank * self.local_in, self.local_in))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.out_features)
        if self.tp_size > 1:
            dist.all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y


class VocabParallelEmbedding(nn.Module):
    # set by the loader where the weight is GGUF's block-quantized rows (one rank only)
    quant_format: quant.BlockFormat | None = None

    def __init__(self, vocab_size: int, hidden: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.vocab_size = vocab_size
        self.local_vocab = -(-vocab_size // self.tp_size)  # ceil: the last shard is zero-padded
        self.start = self.tp_rank * self.local_vocab
        self.weight = nn.Parameter(torch.zeros(self.local_vocab, hidden), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int = 0) -> None:
        part = loaded[self.start:self.start + self.local_vocab]
        param.data.zero_()
        param.data[: part.shape[0]].copy_(part)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant_format is not None:
            return quant.embedding(ids, self.weight, self.quant_format)
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        inside = (local >= 0) & (local < self.local_vocab)
        y = F.embedding(local.clamp(0, self.local_vocab - 1), self.weight) * inside.unsqueeze(-1)
        dist.all_reduce(y)
        return y


class ParallelLMHead(VocabParallelEmbedding):
    """Each rank computes its vocabulary slice of the logits; they are gathered to full width."""

    def __init__(self, vocab_size: int, hidden: int) -> None:
        super().__init__(vocab_size, hidden)
        self.in_features, self.out_features = hidden, self.local_vocab

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        logits = linear(hidden, self.weight, self.out_features)
        if self.tp_size > 1:
            parts = [torch.empty_like(logits) for _ in range(self.tp_size)]
            dist.all_gather(parts, logits)
            logits = torch.cat(parts, dim=-1)
        return logits[..., : self.vocab_size]


LINEARS = (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)


def pack_weights(model: nn.Module) -> int:
    """Packs, in place, the weight of every linear layer (and the LM head) that a native CPU
    kernel multiplies (`kernels.packs_linear`, `kernels.packs_mixed`); returns how many. Call
    once, after loading: the packed weight replaces the [out, in] one, which nothing reads
    afterwards (a tied float LM head is packed apart from the embedding, which keeps its rows;
    a quantized one's panels serve both: `loader`)."""
    packed = 0
    for module in model.modules():
        if not isinstance(module, LINEARS):
            continue
        weight = module.weight.data
        if kernels.packs_linear(weight):
            module.weight = nn.Parameter(kernels.pack_linear(weight), requires_grad=False)
        elif kernels.packs_mixed(weight):
            module.weight = nn.Parameter(kernels.pack_mixed(weight), requires_grad=False)
        else:
            continue
        packed += 1
    return packed
