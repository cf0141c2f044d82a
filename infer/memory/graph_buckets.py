"""The CUDA graphs' buckets and the stream each is recorded on (engine.cuda_graphs records them; memory.plan sizes
their pool from the same lists, which is why they live on this layer, below both).

PyTorch's caching allocator keys a pool's free blocks by stream: graphs recorded on two streams never reuse each
other's freed temporaries in their shared pool, so the plan counts the largest graph of each stream."""

from __future__ import annotations

# EngineConfig.graph_priority None (auto): with adapters, the graphs of at least this many tokens are recorded at high
# priority. On an H200 (2026-12-04, 7B int4, 16 mixed rank-16 adapters) high priority gave 0.835x the throughput at
# 16 concurrent and 0.937x at 32 (the expands waited for shrinks starved of SMs), 1.099x at 64 (the matmuls'
# programs placed first); without adapters 1.00x at all three.
PRIORITY_AUTO_TOKENS = 48


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then multiples of 8, up to and including max_num_seqs."""
    sizes = [b for b in [1, 2, 4] + list(range(8, max_num_seqs, 8)) if b < max_num_seqs]
    return sizes + [max_num_seqs]


def token_buckets(max_tokens: int) -> list[int]:
    """The piecewise graphs' step sizes in tokens: multiples of 16 to 128, of 32 to 256, of 64 to 512, then of
    128, up to and including max_tokens (a step of more than 64 tokens is padded by less than a quarter of its
    size, a shorter one by at most 15 rows)."""
    sizes = list(range(16, 129, 16)) + list(range(160, 257, 32)) + list(range(320, 513, 64)) \
        + list(range(640, max_tokens, 128))
    return [b for b in sizes if b < max_tokens] + [max_tokens]


def records_high(graph_priority: bool | None, adapters: bool, tokens: int) -> bool:
    """Whether the graph of a bucket of `tokens` is recorded on the high-priority stream (else on torch's own
    capture stream): EngineConfig.graph_priority True or False says so for every graph; None (auto) where there are
    adapters and the bucket has PRIORITY_AUTO_TOKENS tokens or more."""
    if graph_priority is None:
        return adapters and tokens >= PRIORITY_AUTO_TOKENS
    return bool(graph_priority)


def largest_per_stream(buckets: list[int], graph_priority: bool | None, adapters: bool) -> list[int]:
    """The largest bucket recorded on each stream the graphs of `buckets` use (records_high), largest first: one
    bucket where all share a stream, two where auto priority splits them."""
    high = [b for b in buckets if records_high(graph_priority, adapters, b)]
    low = [b for b in buckets if not records_high(graph_priority, adapters, b)]
    return sorted((max(s) for s in (high, low) if s), reverse=True)
