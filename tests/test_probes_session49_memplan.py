"""Probes of the memory plan's CUDA-graph pool (memory.plan.cuda_graph_bytes), session 49: the formula `infer warmup`
proves a config by, and that an engine start reserves, must be an upper bound of what the capture keeps.

With EngineConfig.graph_priority None (the default) and adapters, the graphs of PRIORITY_AUTO_TOKENS tokens or more
are recorded on a high-priority stream and the smaller ones on torch's own capture stream (engine.cuda_graphs). The
caching allocator keys a pool's free blocks by stream, so neither stream's graphs reuse what the other's freed: the
pool then also holds the largest graph of the second stream, which the formula did not count. These are formulas:
no GPU (use_cuda_graphs is stood in for)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from infer.engine.config import EngineConfig
from infer.memory.graph_buckets import PRIORITY_AUTO_TOKENS, batch_buckets, token_buckets
from infer.memory.plan import _decode_graph_bytes, cuda_graph_bytes, graph_inputs_bytes
from infer.memory.sizes import activation_bytes

CFG = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096)
RANK = 16


def _engine(seqs: int, tokens: int, priority, adapters: bool = True, **kw) -> EngineConfig:
    return EngineConfig("m", max_num_seqs=seqs, cuda_graph_max_tokens=tokens, graph_priority=priority,
                        enable_lora=adapters, max_lora_rank=RANK, max_model_len=2048, **kw)


def _pool(seqs: int, tokens: int, priority, adapters: bool = True) -> int:
    return cuda_graph_bytes(_engine(seqs, tokens, priority, adapters), CFG, torch.float16)


def _below(buckets: list[int]) -> int:
    """The largest bucket recorded on torch's own stream where auto priority splits them."""
    return max(b for b in buckets if b < PRIORITY_AUTO_TOKENS)


@pytest.fixture(autouse=True)
def _graphs(monkeypatch):
    monkeypatch.setattr(EngineConfig, "use_cuda_graphs", lambda self: True)


@pytest.mark.parametrize("seqs", [PRIORITY_AUTO_TOKENS, 64, 256])
def test_auto_priority_counts_the_second_streams_largest_decode_graph(seqs):
    """Decode graphs only (--cuda-graph-max-tokens 0), adapters, max_num_seqs >= 48: the graphs of 48 sequences
    or more on the high-priority stream, those below on the default one. The pool is what a one-stream engine's
    holds plus the largest default-stream graph's own (an engine of that many sequences: its step and attention
    partials). It was the one-stream figure."""
    one_stream = _pool(seqs, 0, False)
    small = _below(batch_buckets(seqs))
    assert small == 40
    second = _decode_graph_bytes(_engine(seqs, 0, None), CFG, torch.float16, RANK, small)
    assert second == _decode_graph_bytes(_engine(small, 0, None), CFG, torch.float16, RANK)  # an engine of 40's
    assert _pool(seqs, 0, None) - one_stream == second > 0


@pytest.mark.parametrize("seqs,tokens", [(64, 512), (64, 48), (16, 512), (64, 32)])
def test_auto_priority_counts_the_second_streams_largest_graph_of_each_kind(seqs, tokens):
    """With the piecewise graphs too, each kind's largest bucket on the second stream counts (the pool counts the
    decode graphs' and the pieces' temporaries on top of each other, as an upper bound, so a stream's each kind's):
    the pieces of 16 and 32 tokens share the default stream with the small decode graphs. 32-token pieces beside
    decode graphs of up to 16 sequences (all on the default stream) hold more than the 16's step, and decode
    graphs of 40 sequences beside pieces of 32 tokens more than the pieces."""
    one_stream = _pool(seqs, tokens, False)
    want = 0
    if seqs >= PRIORITY_AUTO_TOKENS:  # the decode graphs span both streams
        want += _decode_graph_bytes(_engine(seqs, 0, None), CFG, torch.float16, RANK, _below(batch_buckets(seqs)))
    if tokens >= PRIORITY_AUTO_TOKENS:  # the pieces span both streams
        want += activation_bytes(CFG, torch.float16, _below(token_buckets(tokens)), 1, 1, RANK, penalties=False)
    assert want > 0
    assert _pool(seqs, tokens, None) - one_stream == want


@pytest.mark.parametrize("seqs,tokens", [(64, 0), (64, 512), (16, 512), (40, 0)])
def test_one_stream_pools_are_unchanged(seqs, tokens):
    """Where every graph shares one stream the figure is the one-stream formula: graph_priority True (all at high
    priority) or False (none), no adapters (auto records nothing at high priority), or auto priority with every
    bucket below 48 (max_num_seqs 40, no pieces)."""
    one_stream = _pool(seqs, tokens, False)
    assert _pool(seqs, tokens, True) == one_stream
    assert _pool(seqs, tokens, None, adapters=False) == _pool(seqs, tokens, False, adapters=False)
    if seqs < PRIORITY_AUTO_TOKENS and tokens < PRIORITY_AUTO_TOKENS:
        assert _pool(seqs, tokens, None) == one_stream


def test_engine_start_warmup_and_measured_plan_count_the_same_pool(monkeypatch):
    """The engine start's reserve (start_activation_bytes), warmup's formula (_formula) and the measured plan
    (engine.profile, which reads cuda_graph_bytes itself) all take the pool from cuda_graph_bytes: with auto
    priority's two streams each grows by the same second-stream graph."""
    from infer.cli.warmup_plan import _formula
    from infer.memory.plan import start_activation_bytes
    auto, forced = _engine(64, 0, None), _engine(64, 0, False)
    extra = _decode_graph_bytes(auto, CFG, torch.float16, RANK, 40)
    model = torch.nn.Linear(1, 1)  # no int4 layer: no dequantize scratch
    start = [start_activation_bytes(e, CFG, model, torch.float16, 2048) for e in (auto, forced)]
    assert start[0] - start[1] == extra
    warm = [_formula(e, CFG, torch.float16, 64, 2048, RANK) for e in (auto, forced)]
    assert warm[0] - warm[1] == extra


def test_the_engine_records_the_buckets_and_streams_the_plan_counts():
    """engine.cuda_graphs records the buckets and picks the streams by the very functions the plan sizes the pool
    by (memory.graph_buckets): a copy of either on one side would let the two drift apart."""
    from infer.engine import cuda_graphs
    from infer.memory import graph_buckets
    assert cuda_graphs.batch_buckets is graph_buckets.batch_buckets
    assert cuda_graphs.token_buckets is graph_buckets.token_buckets
    assert cuda_graphs.records_high is graph_buckets.records_high
    assert cuda_graphs.PRIORITY_AUTO_TOKENS == graph_buckets.PRIORITY_AUTO_TOKENS


@pytest.mark.parametrize("draft", [False, True], ids=["target", "draft"])
def test_the_pool_counts_the_hidden_states_every_decode_graph_keeps(draft, monkeypatch):
    """Every decode graph keeps its output ([bucket, hidden], DecodeGraphs.outputs) in the pool for its replays, so
    the smaller recordings after the largest cannot reuse that memory: the pool counts them on top of the largest
    step's temporaries (which hold its own output). The bytes are the ones an (emulated) capture of tiny-llama keeps,
    for the target's decode graphs and a draft model's alike. It counted the largest step only: at 256 sequences of
    a 7B model the kept rows (3,975) alone outweigh that step's temporaries."""
    from infer import LLM
    from infer.engine.cuda_graphs import DecodeGraphs
    from infer.memory.plan import draft_graph_bytes
    from infer.models.tiny import ensure_builtin
    seqs = 64
    monkeypatch.setattr(EngineConfig, "use_cuda_graphs", lambda self: False)  # an engine on this CPU
    llm = LLM(str(ensure_builtin("tiny-llama")), max_num_seqs=seqs, max_num_batched_tokens=seqs, block_size=4,
              num_kv_blocks=64, max_model_len=32, cuda_graph_max_tokens=0)
    try:
        runner = llm.engine.runner
        graphs = DecodeGraphs(runner.model, seqs, 8, runner.device, None, emulate=True)
        graphs.capture()
        kept = sum(o.numel() * o.element_size() for b, o in graphs.outputs.items() if b != seqs)
        assert kept == sum(batch_buckets(seqs)[:-1]) * runner.model.config.hidden_size * 4  # float32 on CPU
        config, model_config, dtype = llm.engine.config, runner.model.config, runner.dtype
        monkeypatch.setattr(EngineConfig, "use_cuda_graphs", lambda self: True)  # its formula as on a GPU
        if draft:
            pool = draft_graph_bytes(config, model_config, dtype)
        else:
            pool = cuda_graph_bytes(config, model_config, dtype)
        inputs = graph_inputs_bytes(config, model_config, False)  # (the static inputs: the test below)
        assert pool - _decode_graph_bytes(config, model_config, dtype, 0) - inputs == kept
    finally:
        llm.close()


@pytest.mark.parametrize("hidden,heads,kv_heads,block_size,max_len,seqs", [
    (3200, 32, 32, 16, 2048, 16),  # head_dim 100 (OpenLLaMA 3B): the partials' rows are padded to 128
    (4096, 16, 8, 256, 300, 4),  # head_dim 256, 256-token blocks: the tables hold 512 keys, not 300
    (4096, 32, 32, 16, 2048, 64),  # the common case (head_dim 128): already covered, still covered
])
def test_the_decode_partials_are_counted_as_the_kernel_allocates_them(hidden, heads, kv_heads, block_size, max_len,
                                                                       seqs):
    """The decode attention's partial results (kernels.attention._decode: [B, Hq, parts, BLOCK_D] and [B, Hq,
    parts, 2] float32, temporaries of every decode graph) as the kernel sizes them for each bucket: BLOCK_D is the
    head_dim padded to a power of two, and the partitions follow the block tables' width (whole blocks of
    block_size keys) and the kernel's key block (BLOCK_N, from _meta). The formula counted head_dim and
    max_model_len keys, below the kernel's where head_dim is not a power of two, or where the blocks pass the length
    and the context bounds the partitions."""
    from infer.kernels.attention import _meta
    from infer.kernels.intmath import PROGRAMS_PER_SM, cdiv, decode_parts
    from infer.memory.sizes import activation_bytes
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=2, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, vocab_size=1000, max_position_embeddings=max_len)
    head_dim = hidden // heads
    engine = EngineConfig("m", max_num_seqs=seqs, block_size=block_size, max_model_len=max_len,
                          cuda_graph_max_tokens=0)
    meta = _meta(torch.empty(1, heads, head_dim), torch.empty(1, block_size, kv_heads, head_dim))
    width = cdiv(max_len, block_size) * block_size  # DecodeGraphs.block_tables: whole blocks of max_model_len
    most = 0
    for sms in (132, 256):  # an H100 / H200 and the formula's bound
        for b in batch_buckets(seqs):
            parts = decode_parts(b, kv_heads, width, meta["BLOCK_N"], PROGRAMS_PER_SM * sms)
            if parts > 1:  # (one partition: none allocated)
                most = max(most, b * heads * parts * (meta["BLOCK_D"] + 2) * 4)
    step = activation_bytes(cfg, torch.float16, seqs, 1, 1, 0, penalties=False)
    assert most > 0
    assert _decode_graph_bytes(engine, cfg, torch.float16, 0) - step >= most


def _rounded(tensors) -> int:
    return sum(-(-t.numel() * t.element_size() // 512) * 512 for t in tensors)


@pytest.mark.parametrize("adapters", [False, True], ids=["base", "adapters"])
def test_the_graphs_static_inputs_are_counted(adapters, monkeypatch):
    """The static inputs the graphs read (input ids, positions, KV slots, the adapter map; the decode graphs' seq
    lens, query starts and block tables [max_num_seqs, blocks of max_model_len]) are device memory the capture adds
    beside the pool (warmup measures it in the reserved bytes) and an engine start must leave room for: as many
    bytes as an (emulated) capture of tiny-llama allocates, the target's decode graphs, its pieces and a draft's.
    Only the pieces' query, attention output, residual and hidden buffers were counted."""
    from infer import LLM
    from infer.engine.cuda_graphs import DecodeGraphs, PiecewiseGraphs
    from infer.memory.plan import draft_graph_bytes
    from infer.models.tiny import ensure_builtin
    seqs, length, tokens = 16, 64, 32
    monkeypatch.setattr(EngineConfig, "use_cuda_graphs", lambda self: False)  # an engine on this CPU
    llm = LLM(str(ensure_builtin("tiny-llama")), max_num_seqs=seqs, block_size=4, num_kv_blocks=64,
              max_model_len=length, cuda_graph_max_tokens=tokens, enable_lora=adapters, max_lora_rank=8)
    try:
        runner = llm.engine.runner
        manager = runner.lora_manager
        decode = DecodeGraphs(runner.model, seqs, length // 4, runner.device, manager, emulate=True)
        pieces = PiecewiseGraphs(runner.model, tokens, runner.device, manager, emulate=True)
        static = [decode.input_ids, decode.positions, decode.slot_mapping, decode.seq_lens, decode.query_start_loc,
                  decode.block_tables]
        static += [pieces.input_ids, pieces.positions, pieces.slot_mapping]
        if adapters:
            static += [g.token_slots for g in (decode, pieces)] + [g.lora_order for g in (decode, pieces)] \
                + [g.lora_starts for g in (decode, pieces)]
        config, model_config = llm.engine.config, runner.model.config
        assert graph_inputs_bytes(config, model_config, adapters) \
            + graph_inputs_bytes(config, model_config, adapters, tokens) == _rounded(static)
        draft = DecodeGraphs(runner.model, seqs, length // 4, runner.device, None, emulate=True)  # no adapters
        assert graph_inputs_bytes(config, model_config, False) == _rounded(
            [draft.input_ids, draft.positions, draft.slot_mapping, draft.seq_lens, draft.query_start_loc,
             draft.block_tables])
    finally:
        llm.close()


def test_the_pool_grows_with_the_block_tables(monkeypatch):
    """The decode graphs' block tables [max_num_seqs, blocks of max_model_len] int32 are the largest static input:
    8 MiB at 256 sequences of 128k tokens in blocks of 16, for the target's graphs and again for a draft's. Where
    nothing else the graphs hold grows with the length (the attention partials at their programs' bound), the
    pool's figure grows by exactly the tables' bytes. It did not grow."""
    from infer.memory.plan import draft_graph_bytes
    cfg = LlamaConfig(**{**CFG.to_dict(), "max_position_embeddings": 131072})
    pools = []
    for length in (4096, 131072):
        engine = EngineConfig("m", max_num_seqs=256, max_num_batched_tokens=4096, max_model_len=length,
                              cuda_graph_max_tokens=0)
        pools.append((cuda_graph_bytes(engine, cfg, torch.float16), draft_graph_bytes(engine, cfg, torch.float16)))
    tables = 256 * (131072 - 4096) // 16 * 4
    assert pools[1][0] - pools[0][0] == tables
    assert pools[1][1] - pools[0][1] == tables
