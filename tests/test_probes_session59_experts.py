"""Session 59: reload_weights compiles the fused MoE's variants of a new experts' layout (act-order or not, gptq or
gptq_v2, group size) as the engine's start does (LLMEngine._warm_moe_blocks), not on the first long prefill;
transformers 4's per-expert adapters served as peft 0.21 computes them (or refused where peft's conversion breaks
them); `infer run --resume --retry-failed`."""

from __future__ import annotations

import pytest
import torch

from infer import LLM, SamplingParams

from helpers import random_prompts, stopped_after_each_record

interpreted = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the real kernels (pytest -m gpu)")


def record_int4_launches(monkeypatch) -> list:
    """Each int4 fused MoE matmul launched from now on as its compiled variant's key: its weight's shape, group size,
    act-order (a permutation) and zero points' format, BLOCK_M, ROW_DIV, WEIGHTED, x's dtype, a tuned entry's tiles,
    warps and stages."""
    from infer.kernels import moe
    launched = []
    real = moe._gemm_int4

    def gemm(a, w, out, weights, aligned, top_k, row_div, weighted, cfg=None, **epilogue):  # (bias, act: gpt-oss)
        launched.append((w.out_features, w.in_features, w.group_size, w.perm is None, bool(w.zeros_v1),
                         aligned.block_m, row_div, weighted, a.dtype,
                         tuple(sorted((k, v) for k, v in (cfg or {}).items() if k != "BLOCK_M"))))
        return real(a, w, out, weights, aligned, top_k, row_div, weighted, cfg, **epilogue)
    monkeypatch.setattr(moe, "_gemm_int4", gemm)
    return launched


@interpreted
def test_reload_weights_compiles_the_new_experts_layouts_variants_before_a_long_prefill(tmp_path, monkeypatch):
    """An engine that warmed its fused MoE at start (a GPU's; the GPU code path, interpreted) on act-order experts,
    reloaded with plain-group ones: the reload launches the plain layout's variants of every BLOCK_M a step can
    choose, so that a 130-token prefill and its decode then launch none it has not; a second reload of the same
    layout launches nothing. The tokens are a fresh engine's on the plain checkpoint."""
    import shutil

    from quant_helpers import int4_kernel_path
    from test_probes_session55_moe import build
    from test_probes_session56_review_moeq import rtn_gptq
    build(tmp_path / "base", "qwen3_moe", num_hidden_layers=1, norm_topk_prob=True)
    rtn_gptq(tmp_path / "base", tmp_path / "plain")
    rtn_gptq(tmp_path / "base", tmp_path / "act", act_order=True)
    shutil.copytree(tmp_path / "act", tmp_path / "m")
    int4_kernel_path(monkeypatch)
    launched = record_int4_launches(monkeypatch)
    prompt = random_prompts(512, (130, 131), seed=3)[0]
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    opts = dict(block_size=8, max_num_batched_tokens=136, max_num_seqs=2, max_model_len=160)
    with LLM(str(tmp_path / "plain"), **opts) as llm:
        want = llm.generate([prompt], params)[0].token_ids
    with LLM(str(tmp_path / "m"), **opts) as llm:
        launched.clear()
        llm.engine._warm_moe_blocks()  # (the start of an engine on a GPU: warm_kernels)
        warmed = set(launched)
        for f in ("model.safetensors", "config.json"):
            shutil.copy(tmp_path / "plain" / f, tmp_path / "m" / f)
        launched.clear()
        llm.engine.reload_weights()
        reloaded = set(launched)
        launched.clear()
        got = llm.generate([prompt], params)[0].token_ids
        steps = set(launched)
        launched.clear()
        llm.engine.reload_weights()
        again = list(launched)
    assert got == want
    assert {bm for *_, bm, _, _, _, _ in steps} == {16, 32}, steps  # (the prefill's blocks and the decode's)
    assert reloaded - warmed and steps <= warmed | reloaded, sorted(steps - warmed - reloaded)
    assert again == []


def _batch(cid: str, **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/completions",
            "body": {"prompt": f"The rain in Spain, {cid}", "max_tokens": 4, "temperature": 0, **body}}


RETRY_LINES = [_batch("support-1", model="support"), _batch("base"), _batch("support-2", model="support")]


@pytest.fixture(scope="module")
def retry_setup(tmp_path_factory):
    """(tmp folder, the input, an adapter "support" of tiny-llama, the records of a run given it from the start by
    custom_id)."""
    import json

    from typer.testing import CliRunner

    from infer.cli.main import app
    from infer.models.tiny import ensure_builtin
    from lora_helpers import hf_float, save_adapter
    tmp = tmp_path_factory.mktemp("retry")
    adapter = save_adapter(hf_float(ensure_builtin("tiny-llama")), tmp / "support", seed=1, r=4, lora_alpha=8,
                           target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    inp = tmp / "in.jsonl"
    inp.write_text("".join(json.dumps(line) + "\n" for line in RETRY_LINES))
    res = CliRunner().invoke(app, ["run", "tiny-llama", str(inp), "-o", str(tmp / "ref.jsonl"), "-q",
                                   "--output-format", "openai", "--lora", f"support={adapter}"])
    assert res.exit_code == 0, res.output
    return tmp, inp, adapter, _by_id(tmp / "ref.jsonl")


def _by_id(path) -> dict:
    """An OpenAI batch output's records by custom_id (each id once), as (status, choices): what the line answered."""
    import json
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    assert len({r["custom_id"] for r in recs}) == len(recs), [r["custom_id"] for r in recs]
    return {r["custom_id"]: (r["response"]["status_code"], (r["response"]["body"] or {}).get("choices"))
            for r in recs}


def _run_retry(inp, out, *args):
    from typer.testing import CliRunner

    from infer.cli.main import app
    return CliRunner().invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "-q", "--output-format", "openai",
                                    *map(str, args)])


def test_retry_failed_reruns_the_error_records_lines_once_their_adapter_is_given(retry_setup, tmp_path):
    """Lines whose body.model names an adapter not given get vLLM's 404 record; `--resume` keeps them (an error
    record is final), and refuses the added --lora without --retry-failed; `--resume --retry-failed --lora
    support=PATH` runs exactly those lines again: the output ends with one record per id, the base line's record
    as it was, the retried lines' as a run given the adapter from the start writes them; the fingerprint takes the
    adapter, so a later --resume with it has nothing to do."""
    _, inp, adapter, ref = retry_setup
    out = tmp_path / "out.jsonl"
    assert _run_retry(inp, out).exit_code == 1
    first = out.read_bytes()
    assert {k: v[0] for k, v in _by_id(out).items()} == {"support-1": 404, "base": 200, "support-2": 404}
    res = _run_retry(inp, out, "--resume")
    assert res.exit_code == 1 and "2 error record(s) from before this resume" in res.output, res.output
    res = _run_retry(inp, out, "--resume", "--lora", f"support={adapter}")
    assert res.exit_code == 2 and "written with other options: loras" in res.output, res.output
    assert "add --retry-failed" in " ".join(res.output.split())
    assert out.read_bytes() == first
    res = _run_retry(inp, out, "--resume", "--retry-failed", "--lora", f"support={adapter}")
    assert res.exit_code == 0, res.output
    assert _by_id(out) == ref
    base_line = next(line for line in first.splitlines() if b'"base"' in line)
    assert base_line in out.read_bytes().splitlines()
    done = out.read_bytes()
    assert _run_retry(inp, out, "--resume", "--retry-failed", "--lora", f"support={adapter}").exit_code == 0
    assert _run_retry(inp, out, "--resume", "--lora", f"support={adapter}").exit_code == 0
    assert out.read_bytes() == done


def test_retry_failed_killed_midway_loses_nothing_and_the_next_resume_completes_it(retry_setup, tmp_path):
    """A --retry-failed run killed after its first retried record is on disk (the output holds that line's error
    and its new record): the next `--resume --retry-failed` keeps the new record in place of the error, runs the
    other failed line again, and ends with one record per id, a run's given the adapter from the start."""
    _, inp, adapter, ref = retry_setup
    out = tmp_path / "out.jsonl"
    assert _run_retry(inp, out).exit_code == 1
    with stopped_after_each_record():
        res = _run_retry(inp, out, "--resume", "--retry-failed", "--lora", f"support={adapter}")
    assert res.exit_code == 130, res.output
    assert len(out.read_text().splitlines()) == 4  # (the retried line's error and its new record)
    res = _run_retry(inp, out, "--resume", "--retry-failed", "--lora", f"support={adapter}")
    assert res.exit_code == 0 and "replaced 1 error record(s)" in res.output, res.output
    assert _by_id(out) == ref


def test_retry_failed_needs_resume_and_keeps_other_option_checks(retry_setup, tmp_path):
    """--retry-failed alone is refused before anything runs; with --resume, an adapter given before at another
    folder, or another option that changes outputs, is refused as ever."""
    _, inp, adapter, _ = retry_setup
    out = tmp_path / "out.jsonl"
    res = _run_retry(inp, out, "--retry-failed")
    assert res.exit_code == 2 and "--retry-failed" in res.output and "--resume" in res.output, res.output
    assert not out.exists()
    assert _run_retry(inp, out, "--lora", f"support={adapter}").exit_code == 0
    res = _run_retry(inp, out, "--resume", "--retry-failed", "--lora", f"support={tmp_path}")
    assert res.exit_code == 2 and "written with other options: loras" in res.output, res.output
    assert "add --retry-failed" not in " ".join(res.output.split())
    res = _run_retry(inp, out, "--resume", "--retry-failed", "--lora", f"support={adapter}", "--seed", "7")
    assert res.exit_code == 2 and "seed" in res.output, res.output


V4_NAMES = {"qwen3_moe": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}


@pytest.fixture(scope="module", params=list(V4_NAMES))
def v4_base(request, tmp_path_factory):
    """A tiny MoE (two sparse layers) of the parameter's model type: (its folder, transformers' model, the
    per-expert names transformers 4 gave its experts' projections)."""
    from lora_helpers import hf_float
    from test_probes_session55_moe import build
    root = tmp_path_factory.mktemp(f"v4-{request.param}")
    build(root / "base", request.param, num_hidden_layers=2, norm_topk_prob=True)
    return root / "base", hf_float(root / "base"), V4_NAMES[request.param]


def _peft_scalings(hf, path) -> dict[str, float]:
    """{stacked parameter: the scaling peft (0.21, on transformers 5) gives it} for an adapter as peft loads it."""
    from peft import PeftModel
    from peft.tuners.lora.layer import ParamWrapper
    model = PeftModel.from_pretrained(hf, str(path))
    try:
        return {m.parameter_name: m.scaling["default"] for m in model.modules() if isinstance(m, ParamWrapper)}
    finally:
        model.unload()


def _check_refused(base, path, said: str, hint: str, tmp_path) -> None:
    """The adapter is refused when served, by lora-validate and by a merge, each saying `said` and `hint`."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    from infer.errors import LoRAError
    with pytest.raises(LoRAError) as err:
        LLM(str(base), loras={"a": str(path)}, max_lora_rank=16, block_size=4)
    assert said in str(err.value) and hint in str(err.value), str(err.value)
    for args in (["lora-validate", str(base), str(path), "--steps", "0"],
                 ["convert", str(base), "-o", str(tmp_path / "merged"), "--merge-lora", str(path)]):
        res = CliRunner().invoke(app, args)
        text = " ".join(res.output.split())
        assert res.exit_code != 0 and said in text and hint in text, res.output
    assert not (tmp_path / "merged" / "config.json").exists()


@pytest.mark.parametrize("case", ["gate-and-up-keys", "one-expert-key"])
def test_per_expert_alpha_keys_peft_does_not_apply_are_refused(v4_base, tmp_path, case):
    """transformers 4's per-expert adapters whose alpha_pattern keys name the experts' own modules: peft (read from
    its loaded layers) matches the keys against the stacked parameters' names, so it scales them otherwise than they
    were trained (the gate and up at lora_alpha / r, not 3 / r; every expert's down at lora_alpha / r, not expert
    0's at 5 / r), a model the adapter never computed. infer refuses it (served, lora-validate, merge), naming both
    scalings and the key to write where one stacked key can hold them."""
    from test_probes_session57_moelora import _v4_adapter
    base, hf, (gate, up, down) = v4_base
    alpha = {"gate-and-up-keys": {gate: 3, up: 3}, "one-expert-key": {f"experts.0.{down}": 5}}[case]
    path = _v4_adapter(hf, tmp_path / "a", (gate, up, down), seed=3, alpha_pattern=alpha)  # r 4, lora_alpha 8
    peft = _peft_scalings(hf, path)
    if case == "gate-and-up-keys":
        assert peft["gate_up_proj"] == 16 / 8 != 3 / 4
        said, hint = ("experts.gate_up_proj: peft (on transformers 5) converts transformers 4's per-expert modules "
                      f"into it at scaling 2, but model.layers.0.mlp.experts.0.{gate} was trained at 0.75",
                      'alpha_pattern {"experts.gate_up_proj": 6}')
    else:
        assert peft["down_proj"] == 8 / 4 != 5 / 4
        said, hint = (f"experts.down_proj: peft (on transformers 5) converts transformers 4's per-expert modules "
                      f"into it at scaling 2, but model.layers.0.mlp.experts.0.{down} was trained at 1.25",
                      "trained at different scalings, which one stacked parameter cannot hold")
    _check_refused(base, path, said, hint, tmp_path)


def test_per_expert_rslora_is_refused_and_the_hinted_config_serves_the_trained_model(v4_base, tmp_path):
    """use_rslora on transformers 4's per-expert gate and up: peft fuses them at rank 2r and alpha 2 x lora_alpha,
    which alpha / sqrt(r) scales sqrt(2) times as much as trained (read from peft's loaded layer): refused, served,
    by lora-validate and by a merge (it was served as trained, which no peft computes, and merged by peft
    otherwise). Its hint (use_rslora false, lora_alpha x sqrt(r)) gives an adapter whose tokens, served, are peft's
    and those of the per-expert deltas merged by hand at their trained scaling, and a merge that gives them too."""
    import json
    import math

    from safetensors.torch import load_file
    from typer.testing import CliRunner

    from helpers import greedy_each
    from infer.cli.main import app
    from lora_helpers import hf_float
    from test_probes_session57_moelora import _v4_adapter, peft_tokens
    base, hf, names = v4_base
    path = _v4_adapter(hf, tmp_path / "v4", names, seed=3)
    config = json.loads((path / "adapter_config.json").read_text())
    config.update(use_rslora=True, lora_alpha=40)
    (path / "adapter_config.json").write_text(json.dumps(config))
    trained = 40 / math.sqrt(config["r"])
    assert math.isclose(_peft_scalings(hf, path)["gate_up_proj"], math.sqrt(2) * trained)
    _check_refused(base, path, f"was trained at {trained:g} (use_rslora", "set use_rslora to false and lora_alpha to "
                   "80", tmp_path)
    config.update(use_rslora=False, lora_alpha=40 * math.sqrt(config["r"]))
    (path / "adapter_config.json").write_text(json.dumps(config))
    merged = hf_float(base)
    weights, tensors = merged.state_dict(), load_file(path / "adapter_model.safetensors")
    gate, up, down = names
    with torch.no_grad():  # each module's delta at its trained scaling, an expert's into its slice of the stack
        for key, a in tensors.items():
            if not key.endswith("lora_A.weight"):
                continue
            delta = trained * tensors[key.replace("lora_A", "lora_B")] @ a
            module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            if ".experts." not in module:
                weights[f"{module}.weight"] += delta
                continue
            stacked, expert, proj = module.rsplit(".", 2)
            inter = weights[f"{stacked}.down_proj"].shape[2]
            if proj == down:
                weights[f"{stacked}.down_proj"][int(expert)] += delta
            else:
                weights[f"{stacked}.gate_up_proj"][int(expert), slice(0, inter) if proj == gate else
                                                   slice(inter, 2 * inter)] += delta
    prompts = random_prompts(512, (6, 9), seed=8)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    with LLM(str(base), loras={"x": str(path)}, max_lora_rank=8, block_size=4) as llm:
        served = [o.token_ids for o in llm.generate(prompts, params, lora=["x", "x"])]
        plain = [o.token_ids for o in llm.generate(prompts, params)]
    assert served == greedy_each(merged, prompts, 6) == peft_tokens(hf, {"x": path}, prompts, ["x", "x"]) != plain
    res = CliRunner().invoke(app, ["convert", str(base), "-o", str(tmp_path / "m"), "--merge-lora", str(path)])
    assert res.exit_code == 0, res.output
    with LLM(str(tmp_path / "m"), block_size=4) as llm:
        assert [o.token_ids for o in llm.generate(prompts, params)] == served


def test_per_expert_modules_exclude_modules_names_are_adapted_as_peft_adapts_them(v4_base, tmp_path):
    """exclude_modules naming transformers 4's per-expert modules (a list, or a regex), whose weights the adapter
    has: peft converts target_modules into the stacked experts' parameters without consulting it and adapts them
    (infer refused the adapter, saying peft would leave them out); the tokens, mixed and alone, are peft's, not the
    base's; lora-validate passes it."""
    from lora_helpers import check_lora_validate_ok
    from test_probes_session57_moelora import _engine_tokens, _v4_adapter, peft_tokens
    base, hf, (gate, up, down) = v4_base
    paths = {"list": _v4_adapter(hf, tmp_path / "list", (gate, up, down), seed=3,
                                 exclude_modules=[gate, f"model.layers.1.mlp.experts.2.{down}"]),
             "experts": _v4_adapter(hf, tmp_path / "experts", (gate, up, down), seed=4, exclude_modules=["experts"])}
    prompts = random_prompts(512, (7, 5, 9), seed=15)
    names = ["list", None, "experts"]
    mixed, alone = _engine_tokens(base, paths, prompts, names)
    want = peft_tokens(hf, paths, prompts, names)
    assert mixed == want and alone == want
    from helpers import greedy_each
    assert want[0] != greedy_each(hf, prompts[:1], 6)[0]
    check_lora_validate_ok(base, paths["list"])
