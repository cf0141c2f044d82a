"""The memory planner's arithmetic against hand formulas: KV bytes per token from the Hugging Face config (and the
published figures of real models), the fit decision of `infer warmup` at its boundary, where the budget goes, and
the weights of a float and of an int4 GPTQ checkpoint (qweight, qzeros, fp16 scales, g_idx) counted from config.json
alone."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig, LlamaConfig, Qwen2Config

from infer.memory.checkpoint import checkpoint_weights_bytes
from infer.memory.plan import MemoryPlan, make_plan
from infer.memory.sizes import kv_bytes_per_token
from infer.models.tiny import ensure_builtin

from quant_helpers import needs_gptqmodel

NO_PREPACK = torch.device("cuda")  # only its type is read: no CPU prepacked copies in the count


def _widths(cfg) -> tuple[int, int]:
    """(query width, key width) = (heads x head_dim, KV heads x head_dim), read from the config."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    return cfg.num_attention_heads * head_dim, kv_heads * head_dim


def _by_hand(cfg, elem: int) -> int:
    """K and V of every layer: 2 x layers x KV heads x head_dim x bytes."""
    return 2 * cfg.num_hidden_layers * _widths(cfg)[1] * elem


@pytest.mark.parametrize("cfg, dtype, published", [
    # Llama-2-7B: 32 layers x 32 heads x 128, fp16: 512 KiB per token
    (LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32),
     torch.float16, 512 * 1024),
    # Qwen2.5-7B: 28 layers, GQA with 4 KV heads of 128, bf16: 56 KiB per token
    (Qwen2Config(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4),
     torch.bfloat16, 56 * 1024),
    (LlamaConfig(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8),
     torch.float32, None),
])
def test_kv_bytes_per_token_match_the_hand_formula(cfg, dtype, published):
    elem = torch.finfo(dtype).bits // 8
    assert kv_bytes_per_token(cfg, dtype) == _by_hand(cfg, elem)
    if published is not None:
        assert kv_bytes_per_token(cfg, dtype) == published


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_kv_bytes_of_the_builtin_models(name):
    cfg = AutoConfig.from_pretrained(ensure_builtin(name))
    assert kv_bytes_per_token(cfg, torch.float32) == _by_hand(cfg, 4)


def _plan(kv_blocks: int, block_size: int = 16, max_length: int = 100, concurrency: int = 3) -> MemoryPlan:
    return MemoryPlan("cpu", 0, 0, 0, 0, 0, 0, 1, block_size, block_size, kv_blocks, max_length, concurrency,
                      max_length_limit=4096)


def test_fit_decision_at_the_boundary():
    """100 tokens in blocks of 16 take 7 blocks; 3 sequences take 21: 21 blocks fit, 20 do not."""
    assert _plan(21).blocks_for(100) == 7 and _plan(21).blocks_for(96) == 6 and _plan(21).blocks_for(97) == 7
    exact = _plan(21)
    assert exact.fits and exact.max_concurrency_at_max_length == 3
    short = _plan(20)
    assert not short.fits and short.max_concurrency_at_max_length == 2
    assert short.max_length_at_concurrency == 96  # 20 blocks // 3 sequences = 6 blocks of 16 tokens
    assert "lower --max-length to 96" in short.advice() and "lower --concurrency to 2" in short.advice()


def test_kv_gets_exactly_what_weights_activations_adapters_and_reserve_leave():
    cfg = AutoConfig.from_pretrained(ensure_builtin("tiny-llama"))
    opts = SimpleNamespace(block_size=16)
    budget, weights, act, lora = 64 << 20, 9 << 20, 5 << 20, 3 << 20
    plan = make_plan(opts, cfg, torch.float32, torch.device("cpu"), weights, act, 256, 2, 2048, lora=lora,
                     budget=budget)
    block = 16 * _by_hand(cfg, 4)
    assert plan.kv_block_bytes == block and plan.reserve_bytes == max(4 << 20, budget // 100)
    used = weights + act + lora + plan.reserve_bytes + plan.kv_blocks * block
    assert used <= budget < used + block


# ---------------------------------------------------------------------------------------------- weights
def _float_params(cfg) -> int:
    """Parameters of a Llama-style model from its config: embeddings, per layer q/k/v/o, gate/up/down and two
    norms, the final norm, and an untied output head."""
    h, inter, v, n = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers
    q, kv = _widths(cfg)
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * inter + 2 * h
    return v * h + n * per_layer + h + (0 if cfg.tie_word_embeddings else v * h)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-llama3"])
def test_float_checkpoint_weights_in_the_engine_dtype(name):
    path = ensure_builtin(name)
    cfg = AutoConfig.from_pretrained(path)
    files = sorted(path.glob("*.safetensors"))
    assert checkpoint_weights_bytes(files, cfg, torch.float16, NO_PREPACK) == 2 * _float_params(cfg)


def _gptq_linear_bytes(k: int, n: int, bits: int, group_size: int) -> int:
    """qweight int32 [k / pack, n], qzeros int32 [groups, n / pack], scales fp16 [groups, n], g_idx int32 [k]."""
    groups = 1 if group_size == -1 else -(-k // group_size)
    return k * n * bits // 8 + groups * n * bits // 8 + groups * n * 2 + k * 4


@needs_gptqmodel
def test_int4_checkpoint_weights_count_scales_zeros_and_g_idx(tmp_path):
    """A GPTQModel export of tiny-llama: int4 linears as stored (scales stay fp16 whatever the engine dtype),
    embeddings, norms and head in the engine dtype."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    out = tmp_path / "q"
    res = CliRunner().invoke(app, ["quantize", "tiny-llama", "-o", str(out), "--group-size", "32",
                                   "--num-samples", "4", "--seq-len", "32"])
    assert res.exit_code == 0, res.output
    cfg = AutoConfig.from_pretrained(out)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (qc["bits"], qc["group_size"]) == (4, 32)
    h, inter, n = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    q, kv = _widths(cfg)
    shapes = [(h, q), (h, kv), (h, kv), (q, h), (h, inter), (h, inter), (inter, h)]
    int4 = n * sum(_gptq_linear_bytes(k, m, 4, 32) for k, m in shapes)
    int4 -= n * 3 * h * 4  # one g_idx per merged layer: k, v share q's, up shares gate's
    floats = cfg.vocab_size * h + n * 2 * h + h + (0 if cfg.tie_word_embeddings else cfg.vocab_size * h)
    files = sorted(out.glob("*.safetensors"))
    for dtype in (torch.float16, torch.float32):
        elem = torch.finfo(dtype).bits // 8
        assert checkpoint_weights_bytes(files, cfg, dtype, NO_PREPACK) == int4 + elem * floats, dtype
    # On a CPU each int4 layer is dequantized at load and prepacked: --estimate counted a third of the weights
    from infer.cli.warmup_plan import estimate_plan, measured_plan
    from infer.engine.config import EngineConfig
    engine = EngineConfig(model=str(out), device="cpu", max_num_seqs=2, max_model_len=128)
    est, _ = estimate_plan(engine, 128, 2)
    measured, _ = measured_plan(engine, 128, 2)
    from infer.models.rope import build_cos_sin_cache
    rope = build_cos_sin_cache(cfg, 128).nbytes  # the rotary table of a 128-token context: loaded with the weights
    assert rope == 128 * cfg.head_dim * 4
    assert abs(est.weights_bytes - measured.weights_bytes) <= 0.02 * measured.weights_bytes, \
        (est.weights_bytes, rope, measured.weights_bytes)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_estimate_counts_the_lora_slots_the_engine_allocates(tmp_path, name):
    """`infer warmup --estimate --lora ...` takes the adapters' device slots from the budget, as many bytes as the
    loaded engine's LoRAManager allocates (the measured plan's lora_bytes)."""
    from infer.cli.demo import make_random_adapter
    from infer.cli.warmup_plan import estimate_plan, measured_plan
    from infer.engine.config import EngineConfig
    make_random_adapter(ensure_builtin(name), tmp_path / "a", 8, ["q_proj", "down_proj"], seed=1)
    cfg = EngineConfig(model=name, max_num_seqs=2, max_model_len=256, max_lora_rank=16, max_loras=3,
                       loras={"a": str(tmp_path / "a")})
    est, _ = estimate_plan(cfg, 256, 2)
    measured, _ = measured_plan(cfg, 256, 2)
    assert est.lora_bytes == measured.lora_bytes > 0
    plain, _ = estimate_plan(EngineConfig(model=name, max_num_seqs=2, max_model_len=256), 256, 2)
    assert plain.lora_bytes == 0


def test_enable_lora_without_adapters_budgets_the_slots_and_their_activations(monkeypatch):
    """`--enable-lora` (adapters added while running) reserves the same slots as a --lora would, in the estimate and
    in the measured plan; the measured worst case adds the LoRA path's activations by formula, since no adapter
    exists yet to run it with (the measured peak is pinned here: on CPU it varies from run to run). Both add the
    sampler's penalty table, which the measured worst case (no penalties) does not use."""
    from infer.cli.warmup_plan import estimate_plan, measured_plan
    from infer.engine import profile
    from infer.engine.config import EngineConfig
    from infer.memory.sizes import activation_bytes, penalty_table_bytes
    from infer.models.loader import load_config
    monkeypatch.setattr(profile, "_peak_activations", lambda *a, **k: 1_000_000)
    mc = load_config(ensure_builtin("tiny-llama"))
    table = penalty_table_bytes(mc, 2)
    assert table == 3 * mc.vocab_size * 4
    kw = dict(model="tiny-llama", max_num_seqs=2, max_model_len=256, max_lora_rank=16, max_loras=3)
    cfg = EngineConfig(enable_lora=True, **kw)
    est, _ = estimate_plan(cfg, 256, 2)
    measured, extra = measured_plan(cfg, 256, 2)
    assert est.lora_bytes == measured.lora_bytes > 0 and extra["lora_adapter"] is None
    plain, _ = measured_plan(EngineConfig(**kw), 256, 2)
    assert plain.lora_bytes == 0 and plain.activation_peak_bytes == 1_000_000 + table
    tokens = 2 * 256  # two sequences of 256 tokens: the most one step holds under the 4,096-token budget
    path = activation_bytes(mc, torch.float32, tokens, 2, 256, 16) - \
        activation_bytes(mc, torch.float32, tokens, 2, 256, 0)
    assert path > 0 and measured.activation_peak_bytes == 1_000_000 + table + path


@pytest.mark.parametrize("kv_heads", [1, 2, 12])
@pytest.mark.parametrize("num_seqs", [1, 3, 16, 40])
@pytest.mark.parametrize("max_len", [60, 127, 300, 600])
def test_decode_gather_bound_is_the_largest_batch_the_cpu_attention_pads(kv_heads, num_seqs, max_len):
    """The plan's decode term counts the K and V the CPU decode attention gathers at once (one sequence, or a batch
    padded to its longest when kernels.reference._per_sequence says so): over every batch shape up to the bound,
    the most it gathers, within one token per sequence (the rounding of the longest batched length)."""
    from infer.kernels.reference import _per_sequence, decode_gather_tokens, longest_batched_decode
    most = max_len
    for n in range(1, num_seqs + 1):
        for length in range(1, max_len + 1):
            if n * length > most and not all(_per_sequence(n, length, kv_heads, eq) for eq in (True, False)):
                most = n * length
    bound = decode_gather_tokens(num_seqs, max_len, kv_heads)
    assert most - num_seqs < bound <= most
    assert not _per_sequence(num_seqs, longest_batched_decode(num_seqs, max_len, kv_heads), kv_heads, True)


def test_profile_run_measures_the_largest_padded_decode_batch():
    """The warmup's worst case holds a decode of the full batch at max_length and, where the CPU attention would
    gather more at once as a padded batch of shorter sequences, that batch too."""
    from infer.engine.config import EngineConfig
    from infer.engine.profile import worst_case_batches
    from infer.kernels.reference import _per_sequence, decode_gather_tokens
    cfg = AutoConfig.from_pretrained(ensure_builtin("llama-100m"))
    kv_heads = cfg.num_key_value_heads
    eng = EngineConfig(model="llama-100m", max_num_seqs=32, max_model_len=2048, max_num_batched_tokens=512)
    _, decodes, _ = worst_case_batches(cfg, eng, 2048, 32, eng.block_size)
    shapes = [(len(d.seqs), len(d.seqs[0])) for d in decodes]
    assert shapes[0] == (32, 2048) and _per_sequence(32, 2048, kv_heads, True)
    assert len(shapes) == 2 and not _per_sequence(*shapes[1], kv_heads, True)
    assert shapes[1][0] * shapes[1][1] == decode_gather_tokens(32, 2048, kv_heads) > 2048


def test_a_step_holds_no_more_tokens_than_its_sequences():
    """The token budget (4,096 by default) bounds a step, and so do its sequences: 2 sequences of 64 tokens never
    make a step of more than 128 tokens. The plans counted the whole budget's prefill activations (32x here), and
    the measured worst case ran its prefill over KV blocks for the budget's tokens rather than the longest
    sequence's (a 7B's worst case at 8,192 tokens and max_length 512: 4 GiB of KV allocated for 256 MiB of use)."""
    from infer.cli.warmup_plan import estimate_plan
    from infer.engine.config import EngineConfig
    from infer.engine.profile import worst_case_batches
    from infer.memory.sizes import activation_bytes, penalty_table_bytes, step_tokens
    from infer.models.loader import load_config
    mc = load_config(ensure_builtin("tiny-llama"))
    cfg = EngineConfig(model="tiny-llama", max_num_seqs=2, max_model_len=64)
    assert cfg.max_num_batched_tokens == 4096
    assert (step_tokens(4096, 2, 64), step_tokens(100, 2, 64), step_tokens(4096, 0, 64)) == (128, 100, 1)
    plan, _ = estimate_plan(cfg, 64, 2)
    whole = activation_bytes(mc, torch.float32, 4096, 2, 64)
    assert plan.activation_peak_bytes == activation_bytes(mc, torch.float32, 128, 2, 64) < whole
    assert penalty_table_bytes(mc, 2) < plan.activation_peak_bytes
    prefill, decodes, blocks = worst_case_batches(mc, cfg, 64, 2, 16)
    assert blocks == 4 and sum(prefill.num_new_tokens) == 2 * 63 and len(prefill.seqs) == 2
    assert all(len(s) <= blocks * 16 and len(s.block_table) == blocks for d in (prefill, *decodes) for s in d.seqs)


def test_estimate_reads_bin_shapes_and_the_loaders_bits(tmp_path):
    """A .bin was estimated at its file size (no dequantized or prepacked weights: a 7B int4 model tens of GB short);
    its shapes are now read without its tensors. An 8-bit checkpoint whose bits are only in quantize_config.json
    was counted as 4-bit (twice the dequantized weights); the estimate takes the loader's bits."""
    from types import SimpleNamespace
    from safetensors.torch import save_file
    from infer.memory.checkpoint import checkpoint_weights_bytes
    t = {"model.layers.0.mlp.down_proj.qweight": torch.zeros(16, 64, dtype=torch.int32),
         "model.layers.0.mlp.down_proj.scales": torch.zeros(2, 64, dtype=torch.float16),
         "model.layers.0.mlp.up_proj.weight": torch.zeros(64, 32), "model.norm.weight": torch.zeros(64)}
    save_file(t, tmp_path / "model.safetensors")
    torch.save(t, tmp_path / "pytorch_model.bin")
    cfg, f32, cpu = SimpleNamespace(tie_word_embeddings=False), torch.float32, torch.device("cpu")
    st = checkpoint_weights_bytes([tmp_path / "model.safetensors"], cfg, f32, cpu)
    assert checkpoint_weights_bytes([tmp_path / "pytorch_model.bin"], cfg, f32, cpu) == st
    assert st > (tmp_path / "pytorch_model.bin").stat().st_size
    dequantized = 16 * 8 * 64 * 4  # the 4-bit reading: 8 values per int32 word, float32
    eight = checkpoint_weights_bytes([tmp_path / "model.safetensors"], cfg, f32, cpu, bits=8)
    g_idx = (16 * 8 - 16 * 4) * 4  # the layer's g_idx (int32 per input), of half the inputs at 8 bits
    assert st - eight - g_idx in (dequantized // 2, dequantized)  # half the values (and the prepacked copy's half)
