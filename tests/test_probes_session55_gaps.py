"""Session 55: gaps closed (warmup --estimate refusing what a load refuses, float32 GPTQ scales below float16's
normal range, Gemma 2's soft-capped attention in the estimate, counters across sleep, checkpoint name prefixes, a
draft model's decode attention warmed, bench's details off or cold)."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from infer.cli.main import app

from quant_helpers import make_gptqmodel_checkpoint, needs_gptqmodel

QUANTIZE = ["--group-size", "32", "--num-samples", "8", "--seq-len", "32"]


@pytest.fixture(scope="module")
def gptq(tmp_path_factory):
    """tiny-llama quantized by infer (4-bit, group size 32)."""
    out = tmp_path_factory.mktemp("q") / "tiny-llama-gptq"
    res = CliRunner().invoke(app, ["quantize", "tiny-llama", "-o", str(out), *QUANTIZE])
    assert res.exit_code == 0, res.output
    return out


def _copy(src, dst, config=None, tensors=None):
    shutil.copytree(src, dst)
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        state = load_file(dst / "model.safetensors")
        tensors(state)
        save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _dynamic(cfg):
    cfg["quantization_config"]["dynamic"] = {r"+:.*q_proj": {"bits": 8}}


def _no_qzeros(state):
    del state["model.layers.1.mlp.down_proj.qzeros"]


def _extra(state):
    state["model.layers.0.mlp.extra.weight"] = state["model.norm.weight"].clone()


# --------------------------------------------------------------------------- 1. warmup --estimate refuses as a load
@pytest.mark.parametrize("case, edit, message", [
    ("dynamic", dict(config=_dynamic), r"dynamic quantizes model\.layers\.0\.self_attn\.q_proj and "
                                       r"model\.layers\.0\.self_attn\.k_proj with different settings"),
    ("missing", dict(tensors=_no_qzeros), r"no tensor model\.layers\.1\.mlp\.down_proj\.qzeros"),
    ("extra", dict(tensors=_extra), r"tensors config\.json has no place for: model\.layers\.0\.mlp\.extra\.weight")])
def test_warmup_estimate_refuses_a_checkpoint_the_loader_refuses_with_the_same_error(gptq, tmp_path, case, edit,
                                                                                     message):
    """`infer warmup --estimate` read sizes from the headers and printed a plan (exit 0) for a GPTQ checkpoint whose
    `dynamic` rules quantize q_proj and k_proj apart (one matmul in infer), or that lacks a layer's qzeros, or holds
    a tensor config.json has no place for: every load refuses them. It now runs the loader's checks on the meta
    device first: the same error, the same exit code, as the measured warmup."""
    import re
    path = _copy(gptq, tmp_path / case, **edit)
    measured = CliRunner().invoke(app, ["warmup", str(path), "--max-length", "64", "--concurrency", "2"])
    estimate = CliRunner().invoke(app, ["warmup", str(path), "--estimate", "--max-length", "64", "--concurrency",
                                        "2"])
    assert measured.exit_code not in (0, 1), measured.output
    assert re.search(message, " ".join(measured.output.split())), measured.output
    assert estimate.exit_code == measured.exit_code, estimate.output
    assert " ".join(estimate.output.split()) == " ".join(measured.output.split())
    ok = CliRunner().invoke(app, ["warmup", str(gptq), "--estimate", "--max-length", "64", "--concurrency", "2"])
    assert ok.exit_code == 0, ok.output


# --------------------------------------------------------------------------- 2. float32 scales below float16's range
def _float32_scales(state):
    import torch
    for k in [k for k in state if k.endswith(".scales")]:
        state[k] = state[k].float()
    s = state["model.layers.0.self_attn.k_proj.scales"]
    s[1, :5] = 3e-7  # float16 subnormals: fewer bits
    s[1, 5:7] = 1e-9  # below half float16's least subnormal: 0
    assert torch.all(s.half()[1, 5:7] == 0) and not torch.all(s.half()[1, :5].float() == s[1, :5])


def test_float32_scales_below_float16s_normal_range_are_named_in_a_warning_with_the_count(gptq, tmp_path, caplog):
    """float32 scales (a checkpoint quantized from a float32 model) were cast to the float16 scales infer's int4
    layers hold without a word, however far below float16's normal range: subnormals keep fewer bits, the smallest
    become 0 (the group's weights 0). As bfloat16 ones, they are named in a warning with their count and how many
    become 0; float32 scales of the normal range (every other tensor here) round as any cast does, unnamed."""
    from infer import LLM
    path = _copy(gptq, tmp_path / "f32", tensors=_float32_scales)
    with caplog.at_level("WARNING", logger="infer"):
        LLM(str(path)).close()
    warned = [r.message for r in caplog.records if "scales" in r.message]
    assert len(warned) == 1, warned
    assert warned[0].startswith("model.layers.0.self_attn.k_proj.scales: 7 float32 scales below float16's normal "
                                "range (6.1e-05) lose bits"), warned
    assert "2 of them becoming 0" in warned[0] and "whatever --dtype" in warned[0], warned


def test_the_float32_scales_check_is_the_load_shards_whatever_the_device(caplog):
    """The check runs on the tensor as it is read, before it is copied into the layer's float16 buffer on the CPU or
    the GPU (GPTQLinearMethod.load_shard, whatever the buffer's device): the layer's own load warns."""
    import torch
    from infer.models.layers import MergedLinear
    from infer.quant.config import GPTQConfig
    from infer.quant.gptq_linear import GPTQLinearMethod
    layer = MergedLinear(64, [32], ["x"], False, GPTQLinearMethod(GPTQConfig(bits=4, group_size=32)), torch.float16)
    scales = torch.full((2, 32), 0.01)
    scales[0, 0] = 1e-6
    with caplog.at_level("WARNING", logger="infer"):
        layer.load_shard("scales", 0, scales)
    assert "x.scales: 1 float32 scale below float16's normal range" in caplog.text, caplog.text
    assert layer.scales.dtype == torch.float16 and layer.scales[0, 0] != 0


# --------------------------------------------------------------------------- 3. Gemma 2's soft-capped decode
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_activation_formula_counts_gemma2s_soft_capped_decode_within_10_percent(dtype):
    """The CPU's soft-capped attention (kernels.reference._sdpa, which SDPA cannot do) holds its scores twice more,
    K and V in float32 (bfloat16), and, for a padded batch of sequences, the contiguous copy of K and of V its
    matmuls take: the estimate counted the plain SDPA's decode (tiny-gemma2, 16 x 4096: 12.8 MB by the formula,
    19.3 MB measured in float32, 25.3 MB in bfloat16). Measured in a fresh process as test_memory's test, the
    prefill small (256 tokens a step) so that the decode is the peak."""
    from infer.cli.warmup_plan import estimate_plan
    from infer.engine.config import EngineConfig
    from helpers import measured_warmup
    args = ["tiny-gemma2", "--max-length", "4096", "--concurrency", "16", "--max-num-batched-tokens", "256",
            "--dtype", dtype]
    measured = measured_warmup(args)
    peak, formula = measured["activation_peak_bytes"], measured["activation_estimate_bytes"]
    assert abs(formula - peak) <= 0.10 * peak, (formula, peak)
    cfg = EngineConfig(model="tiny-gemma2", max_num_seqs=16, max_model_len=4096, max_num_batched_tokens=256,
                       dtype=dtype)
    assert estimate_plan(cfg, 4096, 16)[0].activation_peak_bytes == formula


# --------------------------------------------------------------------------- 4. counters across sleep
@pytest.mark.parametrize("draft", [False, True])
def test_the_graph_counters_carry_on_across_sleep_and_wake_up_as_vllms(draft):
    """stats()' cuda_graph_replays, piecewise_graph_steps and a draft model's draft_cuda_graph_replays,
    draft_eager_forwards and draft_context_skipped_steps went back to 0 at wake_up (the graphs captured again, the
    draft's stats reset): counters that went down (infer serve's Prometheus counters are cumulative, as vLLM's,
    which sleep and wake_up never reset). They now carry on, as num_steps and the prefix cache's counters did. On a
    CPU with emulated graphs (decode and piecewise), with and without a draft model (whose verify steps replace
    the decode graphs' steps)."""
    from infer import LLM, SamplingParams
    keys = ["num_steps", "cuda_graph_replays", "piecewise_graph_steps"]
    kw = {}
    if draft:
        keys += ["draft_cuda_graph_replays", "draft_eager_forwards"]
        kw["speculative_config"] = {"method": "draft_model", "model": "tiny-llama", "num_speculative_tokens": 2}
    grow = ["piecewise_graph_steps", "draft_cuda_graph_replays", "draft_eager_forwards"] if draft else \
        ["piecewise_graph_steps", "cuda_graph_replays"]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = [[5, 9, 13, 21], [7, 3, 2, 8, 11, 40]]
    with LLM("tiny-llama", block_size=4, max_model_len=64, max_num_seqs=4, enable_sleep_mode=True, **kw) as llm:
        engine = llm.llm_engine
        engine.runner.capture_graphs(64, emulate=True)
        assert engine.runner.pieces is not None
        engine.runner.pieces.replays.clear()
        llm.generate(prompts, params)
        before = {k: engine.stats()[k] for k in keys}
        assert all(before[k] > 0 for k in grow), before
        for level in (1, 2):
            llm.sleep(level)
            llm.wake_up()
            if level == 2:
                llm.collective_rpc("reload_weights")
            assert engine.runner.graphs is not None and engine.runner.graphs.emulate
            assert {k: engine.stats()[k] for k in keys} == before, level
            llm.generate(prompts, params)
            after = {k: engine.stats()[k] for k in keys}
            assert all(after[k] > before[k] for k in grow), (before, after)
            before = after


# --------------------------------------------------------------------------- 5. checkpoints without `model.`
def _unprefixed(state):
    for k in list(state):
        if k.startswith("model."):
            state[k.removeprefix("model.")] = state.pop(k)


def _eight_bit_down_proj(state):
    """layer 0's down_proj repacked as 8-bit fields holding the same integers (the same weights), g_idx dropped
    everywhere (each layer's width then read from the config's bits, as GPTQ allows)."""
    from infer.quant.packing import pack_cols, pack_rows, unpack_cols, unpack_rows
    name = "model.layers.0.mlp.down_proj"
    state[f"{name}.qweight"] = pack_rows(unpack_rows(state[f"{name}.qweight"], 4), 8)
    state[f"{name}.qzeros"] = pack_cols(unpack_cols(state[f"{name}.qzeros"], 4), 8)
    for k in [k for k in state if k.endswith(".g_idx")]:
        del state[k]


def _anchored_rule(cfg):
    cfg["quantization_config"]["dynamic"] = {r"+:model\.layers\.0\.mlp\.down_proj": {"bits": 8}}


def test_the_estimate_matches_a_checkpoint_without_the_model_prefix_as_the_loader_does(gptq, tmp_path):
    """A checkpoint saved from the base model stores `layers.0...` (no `model.`): the loader maps it to the same
    modules (and matches the config's `dynamic` rules against their `model.`-prefixed names); the estimate matched
    the rules against the stored name, so a rule anchored at `model.` (8-bit down_proj of layer 0, no g_idx) was
    missed and the layer read as 4-bit words (twice its inputs). Both layouts now give the same figures, and load
    to the same tokens."""
    from infer import LLM, SamplingParams
    from infer.cli.warmup_plan import estimate_plan
    from infer.engine.config import EngineConfig

    def both(state):
        _eight_bit_down_proj(state)
        _unprefixed(state)
    paths = [_copy(gptq, tmp_path / "prefixed", config=_anchored_rule, tensors=_eight_bit_down_proj),
             _copy(gptq, tmp_path / "bare", config=_anchored_rule, tensors=both)]
    assert "layers.0.mlp.down_proj.qweight" in load_file(paths[1] / "model.safetensors")
    figures = [estimate_plan(EngineConfig(model=str(p), max_num_seqs=2, max_model_len=64), 64, 2)[0].weights_bytes
               for p in paths]
    assert figures[0] == figures[1], figures
    prompts = [[5, 9, 13, 21], [7, 3, 2, 8, 11, 40]]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    tokens = []
    for p in [gptq, *paths]:
        with LLM(str(p)) as llm:
            if p != gptq:
                assert llm.llm_engine.runner.model.layers[0].mlp.down_proj.method.config.bits == 8
            tokens.append([list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)])
    assert tokens[0] == tokens[1] == tokens[2]


@needs_gptqmodel
def test_a_split_phi3_checkpoint_without_the_model_prefix_reads_its_dynamic_rules_as_the_prefixed_one(tmp_path):
    """GPTQModel's split Phi-3 layout (mlp.gate_proj and mlp.up_proj apart, each 8-bit by its own `dynamic` rule)
    with its names stored without `model.`: the loader looked for `model.layers.0.mlp.gate_proj` among the stored
    modules, found `layers.0.mlp.gate_proj` only, and matched the rules against the fused gate_up_proj (no rule: 4
    bits), refusing the 8-bit tensors' shapes. It now compares the names as place_weights maps them: the same model,
    the same tokens, as the prefixed checkpoint."""
    from infer import LLM, SamplingParams
    from test_probes_session53_phi3 import build
    build(tmp_path / "f", num_hidden_layers=1, seed=4)
    path = make_gptqmodel_checkpoint(tmp_path / "f", tmp_path / "q", bits=4, group_size=32, seq_len=32,
                                     dynamic={r"+:.*\.gate_proj": {"bits": 8}, r"+:.*\.up_proj": {"bits": 8}})
    bare = _copy(path, tmp_path / "bare", tensors=_unprefixed)
    prompts = [[5, 9, 13, 21], [7, 3, 2, 8, 11, 40]]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    tokens = []
    for p in (path, bare):
        with LLM(str(p), block_size=4) as llm:
            assert llm.llm_engine.runner.model.layers[0].mlp.gate_up_proj.method.config.bits == 8
            tokens.append([list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)])
    assert tokens[0] == tokens[1]


# --------------------------------------------------------------------------- 6. a draft model's decode attention
def test_engine_start_compiles_a_draft_models_decode_attention_too(monkeypatch):
    """warm_kernels compiled the decode attention's variants on the target's layers only: a draft model
    (speculative_config {"model": ...}), whose one-token forwards decode over its own cache with its own heads,
    compiled its kernels on the first request. One layer of each model is compiled now (the Triton path forced on
    a CPU, as test_probes_session54_window's warm-up test does)."""
    from infer import LLM, kernels
    from infer.models.llama import Attention
    spec = {"method": "draft_model", "model": "tiny-qwen2", "num_speculative_tokens": 2}
    with LLM("tiny-llama", block_size=4, speculative_config=spec) as llm:
        engine = llm.llm_engine
        owner = {id(m): "target" for m in engine.runner.model.modules()}
        owner.update({id(m): "draft" for m in engine.drafter.model.modules()})
        compiled = []
        monkeypatch.setattr(kernels, "use_triton", lambda t: True)
        monkeypatch.setattr(Attention, "compile_decode", lambda self, delta=None: compiled.append(owner[id(self)]))
        engine._warm_decode_attention()
        assert compiled == ["target", "draft"], compiled
        monkeypatch.undo()
        from infer.kernels import attention  # the real compiles (interpreted): each model's two variants
        warmups = []
        warmup = attention._decode_kernel.warmup
        monkeypatch.setattr(kernels, "use_triton", lambda t: True)
        monkeypatch.setattr(attention._decode_kernel, "warmup", lambda *a, **k: warmups.append(1) or warmup(*a, **k))
        engine._warm_decode_attention()
        assert len(warmups) == 4, warmups


# --------------------------------------------------------------------------- 7. bench: details off, or cold
def _vllm_like(details: bool, metrics: bool):
    """A vLLM server as `infer bench --url` sees it: no /health figures; with `details` (--enable-prompt-tokens-
    details) a streamed usage chunk with prompt_tokens_details only when the prompt found some cached (32 tokens of
    any prompt seen before); with `metrics`, vLLM's Prometheus prefix cache counters (tokens) on /metrics."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from helpers import ModelsHandler
    state = {"seen": set(), "queries": 0, "hits": 0}
    lock = threading.Lock()

    class Handler(ModelsHandler, BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path != "/metrics" or not metrics:
                return super().do_GET()
            with lock:
                text = ("# TYPE vllm:prefix_cache_queries counter\n"
                        f'vllm:prefix_cache_queries_total{{engine="0",model_name="m"}} {float(state["queries"])}\n'
                        "# TYPE vllm:prefix_cache_hits counter\n"
                        f'vllm:prefix_cache_hits_total{{engine="0",model_name="m"}} {float(state["hits"])}\n')
            payload = text.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            key = tuple(body["prompt"])
            with lock:
                cached = 32 if key in state["seen"] else 0
                state["seen"].add(key)
                state["queries"] += len(key)
                state["hits"] += cached
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self.wfile.write(b'data: {"choices": [{"index": 0, "text": "t ", "finish_reason": "length"}]}\n\n')
            usage = {"prompt_tokens": len(key), "completion_tokens": 1, "total_tokens": len(key) + 1}
            if details and cached:
                usage["prompt_tokens_details"] = {"cached_tokens": cached}
            self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")
    return ThreadingHTTPServer(("127.0.0.1", 0), Handler)


@pytest.mark.parametrize("details, metrics, repeat, want, rate", [
    (True, True, False, "cold", 0.0),
    (False, True, True, "off", 64 / 120),
    (True, True, True, "reported", 64 / 120),
    (True, False, False, "unknown", None),
    (False, False, True, "unknown", None)])
def test_bench_tells_a_server_without_usage_details_from_a_cold_level(tmp_path, details, metrics, repeat, want,
                                                                     rate):
    """A --url level where no request reported its cached prompt tokens had no hit rate and no word why: a vLLM
    server started without --enable-prompt-tokens-details and a level that found nothing cached (vLLM sends no
    details then either) gave the same report. The bench now reads vLLM's prefix cache counters from /metrics (as
    an infer server's from /health), so a cold level's hit rate is 0 and a server without details gets the
    counters' rate, and each level says which it was (prefix_cache_usage_details: reported, off, cold, or unknown
    where the server has no counters), in results.json and report.md."""
    import threading

    from infer.bench.datasets import BenchRequest
    from infer.bench.http_driver import run_http
    from infer.bench.report import run_entry, write_report
    httpd = _vllm_like(details, metrics)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        prompts = [list(range(5, 45))] * 3 if repeat else [list(range(5 + 40 * i, 45 + 40 * i)) for i in range(3)]
        res = run_http(url, "m", [BenchRequest(None, p, 1, ignore_eos=True) for p in prompts], concurrency=1,
                       progress=False)
    finally:
        httpd.shutdown()
        httpd.server_close()
    e = run_entry(res)
    assert e["prefix_cache_usage_details"] == want, e
    if rate is None:
        assert "prefix_cache_hit_rate" not in e and "prefix_cache_source" not in e
    else:
        assert e["prefix_cache_hit_rate"] == pytest.approx(rate)
        assert e["prefix_cache_source"] == ("usage" if want == "reported" else "server")
    write_report(tmp_path, [res])
    text = (tmp_path / "report.md").read_text()
    assert "## Prefix cache" in text and {"cold": "a cold level", "off": "the server sends no usage details",
                                           "reported": "the requests reported their cached prompt tokens",
                                           "unknown": "either the server sends no usage details"}[want] in text
