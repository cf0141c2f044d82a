"""Session 44 probes of known gaps (vLLM parity of options, request bodies, checkpoints, kernel tables)."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from infer.cli.main import app
from infer.engine.config import EngineConfig
from infer.errors import ConfigError


def test_max_cpu_loras_below_max_loras_is_refused_by_the_api(tmp_path):
    """vLLM refuses max_cpu_loras < max_loras ("max_cpu_loras (1) must be >= max_loras (2)"); infer took it."""
    with pytest.raises(ConfigError) as e:
        EngineConfig("tiny-llama", enable_lora=True, max_loras=2, max_cpu_loras=1)
    assert "--max-cpu-loras 1" in str(e.value) and "--max-loras 2" in str(e.value)
    with pytest.raises(ConfigError, match="--max-cpu-loras 1 is below --max-loras 2"):
        EngineConfig("tiny-llama", loras={"a": str(tmp_path)}, max_loras=2, max_cpu_loras=1)
    EngineConfig("tiny-llama", enable_lora=True, max_loras=2, max_cpu_loras=2)  # equal is fine, as in vLLM
    EngineConfig("tiny-llama", max_loras=2, max_cpu_loras=1)  # no adapters at all: unused, as vLLM ignores it


def test_max_cpu_loras_alone_lowers_the_default_slots_on_the_command_line():
    """vLLM's default --max-loras (1) is never above a --max-cpu-loras; infer's (4) was: `--enable-lora
    --max-cpu-loras 2` must not be refused for a --max-loras nobody gave."""
    import typer

    from infer.cli import options as o

    seen = {}
    cli = typer.Typer()

    @cli.command()
    @o.engine_options()
    def show(model: str, engine: EngineConfig = None):
        seen["engine"] = engine

    res = CliRunner().invoke(cli, ["tiny-llama", "--enable-lora", "--max-cpu-loras", "2"])
    assert res.exit_code == 0, res.output
    assert (seen["engine"].max_loras, seen["engine"].max_cpu_loras) == (2, 2)
    res = CliRunner().invoke(cli, ["tiny-llama", "--enable-lora", "--max-cpu-loras", "8"])
    assert (seen["engine"].max_loras, seen["engine"].max_cpu_loras) == (4, 8)
    res = CliRunner().invoke(cli, ["tiny-llama", "--enable-lora", "--max-loras", "3", "--max-cpu-loras", "2"])
    assert res.exit_code != 0 and "--max-cpu-loras 2 is below --max-loras 3" in str(res.exception or res.output)


@pytest.mark.parametrize("command", ["run", "serve", "bench", "warmup"])
def test_max_cpu_loras_below_max_loras_is_refused_by_every_command(command, tmp_path):
    model = str(tmp_path / "no-model")  # without the check, the command fails on it (serve would not start serving)
    args = {"run": ["run", model, str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "o.jsonl")],
            "serve": ["serve", model], "bench": ["bench", model, "--out", str(tmp_path / "b")],
            "warmup": ["warmup", model]}[command]
    (tmp_path / "in.jsonl").write_text('{"prompt": "hi"}\n')
    res = CliRunner().invoke(app, [*args, "--device", "cpu", "--enable-lora", "--max-loras", "3", "--max-cpu-loras",
                                   "2"])
    assert res.exit_code != 0
    assert "--max-cpu-loras 2 is below --max-loras 3" in " ".join(res.output.split()), res.output


def test_bench_checks_max_cpu_loras_against_its_own_max_loras(tmp_path):
    """bench sets --max-loras itself (default: max(4, adapters)): its check must not compare with the engine's 4."""
    from infer.bench.plan import BenchPlan
    from infer.cli.bench import set_target

    plan = BenchPlan(model="tiny-llama", levels=[1], out=tmp_path)
    engine = EngineConfig("tiny-llama", enable_lora=True, max_loras=1, max_cpu_loras=1)
    set_target(plan, engine, None, None, None)  # by default no more slots than CPU copies
    assert plan.engine.max_loras == 1
    set_target(plan, engine, None, None, 1)
    with pytest.raises(ConfigError, match="--max-cpu-loras 1 is below --max-loras 2"):
        set_target(plan, engine, None, None, 2)


ONE_OF_CASES = {  # name: (schema, whether a value may match two branches)
    "integer or number": ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, True),
    "touching ranges": ({"oneOf": [{"type": "integer", "maximum": 4}, {"type": "integer", "minimum": 4}]}, True),
    "open objects": ({"oneOf": [{"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"],
                                 "additionalProperties": True},
                                {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]}]}, True),
    "string or number": ({"oneOf": [{"type": "string"}, {"type": "number"}]}, False),
    "apart ranges": ({"oneOf": [{"type": "integer", "maximum": 3}, {"type": "integer", "exclusiveMinimum": 3}]}, False),
    "enums": ({"oneOf": [{"enum": ["a", "b"]}, {"const": "c"}, {"type": "integer"}]}, False),
    "null or union": ({"oneOf": [{"type": "null"}, {"anyOf": [{"type": "string"}, {"type": "integer"}]}]}, False),
    "objects as xgrammar writes them": ({"oneOf": [
        {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
        {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]}]}, False),
    "pydantic discriminated union": ({
        "$defs": {"Cat": {"type": "object", "properties": {"kind": {"const": "cat", "type": "string"},
                                                           "n": {"type": "integer"}}, "required": ["kind", "n"]},
                  "Dog": {"type": "object", "properties": {"kind": {"enum": ["dog"], "type": "string"},
                                                           "n": {"type": "integer"}}, "required": ["kind", "n"]}},
        "type": "object", "required": ["pet"],
        "properties": {"pet": {"oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
                               "discriminator": {"propertyName": "kind"}}}}, False),
}


@pytest.fixture(scope="module")
def grammars():
    pytest.importorskip("xgrammar")
    from transformers import AutoTokenizer

    from infer.engine.structured import GrammarBackend
    from infer.models.tiny import ensure_builtin

    tok = AutoTokenizer.from_pretrained(str(ensure_builtin("tiny-llama")))
    return GrammarBackend(tok, len(tok), [tok.eos_token_id])


@pytest.mark.parametrize("name", list(ONE_OF_CASES))
def test_a_one_of_whose_branches_one_value_may_match_is_refused(grammars, name):
    """xgrammar writes oneOf as anyOf: {"oneOf": [integer, number]} took 3, which matches both, so oneOf rejects it.
    Such a schema is refused naming the two branches; one whose branches are exclusive (types, consts, ranges, a
    discriminator, or objects xgrammar writes with only their own properties) is compiled as before."""
    from infer import StructuredOutputsParams as S
    from infer.errors import RequestError

    schema, overlaps = ONE_OF_CASES[name]
    if overlaps:
        with pytest.raises(RequestError, match=r"oneOf at #/oneOf whose schemas 0 and 1 one value may both match"):
            grammars.compile(S(json=schema))
    else:
        grammars.compile(S(json=schema))


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from infer.models.tiny import ensure_builtin

    return AutoTokenizer.from_pretrained(str(ensure_builtin("tiny-llama")))


WHOLE = {"max_tokens": 5.0, "n": 2.0, "top_k": 3.0, "logprobs": 2.0, "seed": 1.0, "min_tokens": 1.0,
         "stop_token_ids": [3.0], "prompt_logprobs": 1.0, "truncate_prompt_tokens": 4.0, "priority": 0.0}


def test_whole_floats_in_integer_fields_are_read_as_vllm_reads_them(tokenizer):
    """vLLM's pydantic request models (lax mode) take max_tokens 5.0 as 5 and refuse 5.5; infer answered every
    whole float in an integer field (max_tokens, n, top_k, logprobs, seed...) with a 400."""
    import json

    from infer.serve.body import BodyLimits
    from infer.serve.parse import parse_body
    from infer.serve.protocol import ApiError

    def parse(body: dict, chat: bool = False):
        return parse_body(json.dumps(body).encode(), chat, tokenizer, BodyLimits(), max_tokens=128)

    req = parse({"prompt": "hi", **WHOLE})
    params = req.params
    assert (req.n, params.max_new_tokens, params.top_k, params.logprobs, params.seed, params.min_tokens) \
        == (2, 5, 3, 2, 1, 1)
    assert (params.stop_token_ids, params.prompt_logprobs, params.truncate_prompt_tokens) == ([3], 1, 4)
    assert type(params.max_new_tokens) is int and type(params.seed) is int
    chat = parse({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5.0, "logprobs": True,
                  "top_logprobs": 2.0, "allowed_token_ids": [5.0, 6.0]}, chat=True).params
    assert (chat.max_new_tokens, chat.logprobs, chat.allowed_token_ids) == (5, 2, [5, 6])
    for field in ("max_tokens", "n", "top_k", "seed"):
        with pytest.raises(ApiError) as e:
            parse({"prompt": "hi", field: 2.5})
        assert e.value.status == 400 and e.value.param == field


def test_whole_floats_in_a_batch_lines_integer_fields_are_read_too(tokenizer):
    from infer.engine.inputs import parse_request
    from infer.errors import RequestError

    line = {"custom_id": "r1", "url": "/v1/completions",
            "body": {"prompt": "hi", "max_tokens": 5.0, "top_k": 3.0, "seed": 7.0, "logprobs": 1.0, "n": 1.0}}
    params = parse_request(line, tokenizer, "0").params
    assert (params.max_new_tokens, params.top_k, params.seed, params.logprobs) == (5, 3, 7, 1)
    chat = {"custom_id": "r2", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2.0}}
    assert parse_request(chat, tokenizer, "0").params.logprobs == 2
    with pytest.raises(RequestError, match="max_tokens"):
        parse_request({"custom_id": "r3", "body": {"prompt": "hi", "max_tokens": 5.5}}, tokenizer, "0")


def ragged_copies(root, group: int, bits: int = 4):
    """(a GPTQ copy of tiny-llama whose group_size divides neither hidden_size 64 nor intermediate_size 128, as
    AutoGPTQ writes one: ceil(in / group) groups, the last one short; the float copy of its dequantized weights)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from infer.models.tiny import ensure_builtin
    from infer.quant import packing

    quant, plain = shutil.copytree(ensure_builtin("tiny-llama"), root / "q"), shutil.copytree(ensure_builtin(
        "tiny-llama"), root / "f")
    tensors, floats = {}, {}
    for name, t in load_file(quant / "model.safetensors").items():
        module = name[: -len(".weight")]
        if ".layers." in name and name.endswith("_proj.weight"):
            qw, qz, s, gi = packing.quantize_rtn(t.float(), bits, group, sym=False)
            assert s.shape[0] == -(-t.shape[1] // group) and t.shape[1] % group  # a short last group
            tensors.update({f"{module}.qweight": qw, f"{module}.qzeros": qz, f"{module}.scales": s,
                            f"{module}.g_idx": gi})
            floats[name] = packing.dequantize(qw, qz, s, gi, bits).to(t.dtype)
        else:
            tensors[name] = floats[name] = t
    save_file(tensors, quant / "model.safetensors", metadata={"format": "pt"})
    save_file(floats, plain / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((quant / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": False,
                                  "sym": False, "checkpoint_format": "gptq"}
    (quant / "config.json").write_text(json.dumps(cfg))
    return quant, plain


@pytest.mark.parametrize("bits", [4, 8])
def test_a_group_size_that_does_not_divide_the_input_gives_the_dequantized_models_tokens(tmp_path, bits):
    """group_size 48 with inputs of 64 and 128 (AutoGPTQ's ceil(in / group) groups, the last one short; vLLM refuses
    such a layer): infer reads the short group from g_idx and generates transformers' greedy tokens of the
    dequantized weights."""
    from helpers import hf_greedy

    from infer import LLM, SamplingParams

    quant, plain = ragged_copies(tmp_path, 48, bits)
    prompts = [[5, 17, 99, 230, 41], list(range(40, 60))]
    with LLM(str(quant), block_size=4, device="cpu") as llm:
        got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))]
    assert got == [hf_greedy(str(plain), p, 6) for p in prompts]


@pytest.mark.parametrize("bits", [4, 8])
def test_the_int4_kernels_read_a_short_last_group(bits):
    """K 96 with group_size 64 (the kernel path the GPU runs, interpreted here): each kernel kind matches the
    reference, which reads g_idx."""
    from helpers import interpreted_module

    from infer.kernels import reference as ref
    from infer.quant import packing

    gemm = next(interpreted_module("infer.kernels.gptq_gemm"))
    g = torch.Generator().manual_seed(44)
    qw, qz, s, gi = packing.quantize_rtn(torch.randn(40, 96, generator=g), bits, 64, sym=False)
    configs = [None, {"kernel": "gemv", "BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 2, "num_warps": 4, "num_stages": 2},
               {"kernel": "mma", "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": 1, "GROUP_M": 1,
                "num_warps": 4, "num_stages": 2}, {"kernel": "dequant"}]
    for cfg in configs:
        for m in (1, 19):
            x = torch.randn(m, 96, generator=g)
            want = ref.gptq_matmul(x, qw, qz, s, gi, bits, True)
            got = gemm.gptq_matmul(x, qw, qz, s, gi, bits, True, 64, 1, config=cfg)
            assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max())), (cfg, m)


def test_every_shipped_int4_table_config_computes_an_8_bit_layer_right():
    """The tuned tables are keyed by "N,K" only, so a layer of another bit width with a tuned shape (an 8-bit
    module of a `dynamic` rule, a quantized lm_head) launches a config tuned at 4 bits: each one must still compute
    the 8-bit matmul (the 4-bit-only options, PAIRS and byte fields, are dropped for it; BLOCK_K is capped)."""
    import json

    from helpers import interpreted_module

    from infer.kernels import gptq_configs
    from infer.kernels import reference as ref
    from infer.quant import packing

    gemm = next(interpreted_module("infer.kernels.gptq_gemm"))
    configs = {}
    for path in gptq_configs.SHIPPED.glob("*.json"):
        for by_m in json.loads(path.read_text()).values():
            for m, cfg in by_m.items():
                configs.setdefault(json.dumps(cfg, sort_keys=True), min(int(m), 33))
    assert configs
    g = torch.Generator().manual_seed(44)
    k, n, bits = 256, 128, 8
    qw, qz, s, gi = packing.quantize_rtn(torch.randn(n, k, generator=g), bits, 128, sym=False)
    wp = gptq_configs.interleave_for(128, k, 32 // bits)
    qwi = packing.interleave_rows(qw, bits, wp)
    for text, m in configs.items():
        x = torch.randn(m, k, generator=g).half()
        want = ref.gptq_matmul(x.float(), qw, qz, s, gi, bits, True)
        got = gemm.gptq_matmul(x, qwi, qz, s, gi, bits, True, 128, wp, config=json.loads(text)).float()
        assert float((got - want).abs().max() / want.abs().max()) < 3e-3, text


def test_a_large_one_of_is_checked_at_once_or_refused_quickly(grammars):
    """The oneOf proof compared every pair of branches: 2,000 labelled consts ({"const": i, "title": ...}, a common
    way to write an enum) took 16 s of a parse thread, a discriminated union of 2,000 objects 100 s. Branches told
    apart by their values (or a property's) are proven at once; others stop after a bounded number of comparisons."""
    from infer import StructuredOutputsParams as S
    from infer.engine.schema_overlap import CHECKS, overlapping
    from infer.errors import RequestError

    consts = [{"const": i, "title": f"n{i}"} for i in range(2000)]
    tagged = [{"type": "object", "properties": {"k": {"const": i}, "v": {"type": "string"}}, "required": ["k", "v"]}
              for i in range(2000)]
    calls = []
    import infer.engine.schema_overlap as so

    real = so.disjoint
    so.disjoint = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        assert overlapping(consts, {}) is None and overlapping(tagged, {}) is None and not calls
        assert overlapping(consts + [{"const": 5.0}], {}) is not None  # 5 and 5.0 are one JSON number
        opened = [{"type": "object", "properties": {f"k{i}": {"type": "string"}}, "required": [f"k{i}"]}
                  for i in range(300)]
        calls.clear()
        assert overlapping(opened, {}) == "large" and len(calls) <= CHECKS + 1
    finally:
        so.disjoint = real
    grammars.compile(S(json={"oneOf": consts[:300]}))
    with pytest.raises(RequestError, match="too large to prove its schemas exclusive"):
        grammars.compile(S(json={"type": "object", "properties": {"x": {"oneOf": opened}}}))
    assert CHECKS <= 10_000
