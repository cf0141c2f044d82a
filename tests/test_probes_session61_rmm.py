"""Session 61 (rmm): review of the multimodal checkpoints' text model (models.multimodal) and Ministral 3: GPTQModel's
`dynamic` rules of a multimodal checkpoint, which name the language model's modules as the checkpoint stores them
(model.language_model.layers.N...); `infer bench --baseline hf` on a Mistral 3 folder (no causal LM class in
transformers) and the LoRA benchmark's adapters of a multimodal base; a config.json's top-level torch_dtype (as
transformers 4 wrote the hub's) and eos_token_id; `infer quantize`'s tied-head checks on a multimodal folder (its
head tied by transformers' default, or a different head stored under the language model's prefix); an adapter
without target_modules on a base peft has no default for (a multimodal one, Ministral 3)."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from infer import LLM
from infer.cli.main import app
from infer.models.tiny import ensure_builtin

from helpers import greedy_tokens, random_prompts
from quant_helpers import needs_gptqmodel


@needs_gptqmodel
def test_dynamic_rules_naming_the_language_model_are_read(tmp_path):
    """GPTQModel 7.6 quantizes tiny-gemma3-mm with `dynamic` rules naming the modules as it names them
    (model.language_model.layers.N.mlp...): layer 1's MLP left in float, layer 0's in 8 bits. infer reads them so
    (the float MLP was refused as an unexpected tensor of a GPTQ layer), gives GPTQModel's own load's greedy tokens,
    and `warmup --estimate` sizes it as loaded."""
    from infer.memory.sizes import weights_bytes
    from quant_helpers import gptqmodel_greedy, make_gptqmodel_checkpoint
    out = make_gptqmodel_checkpoint(ensure_builtin("tiny-gemma3-mm"), tmp_path / "q", num_samples=4, seq_len=32,
                                    dynamic={r"-:model\.language_model\.layers\.1\.mlp\..*": {},
                                             r"+:model\.language_model\.layers\.0\.mlp\..*": {"bits": 8}})
    tensors = load_file(out / "model.safetensors")
    assert "model.language_model.layers.1.mlp.down_proj.weight" in tensors
    assert tensors["model.language_model.layers.0.mlp.down_proj.qweight"].shape[0] == 128 * 8 // 32
    res = CliRunner().invoke(app, ["warmup", str(out), "--estimate", "--json", "--max-length", "256"])
    assert res.exit_code == 0, res.output
    plan = json.loads(res.stdout.strip().splitlines()[-1])
    prompts = random_prompts(512, (4, 11, 23), seed=11)
    with LLM(str(out), block_size=4, max_model_len=256) as llm:
        layers = llm.engine.runner.model.layers
        assert getattr(layers[1].mlp.down_proj, "qweight", None) is None
        assert layers[0].mlp.down_proj.qweight.shape[0] * 32 // 8 == 128
        assert plan["weights_bytes"] == weights_bytes(llm.engine.runner.model)
        got = greedy_tokens(llm, prompts, 8)
    assert got == gptqmodel_greedy(out, prompts, 8)


@pytest.mark.parametrize("name", ["tiny-mistral3", "tiny-ministral3"])
def test_bench_hf_baseline_of_a_mistral3_folder(name):
    """The transformers baseline of `infer bench` loads a Mistral3ForConditionalGeneration (AutoModelForCausalLM
    has no class for it: the baseline failed) and generates infer's greedy text of each prompt."""
    from infer.bench.datasets import BenchRequest
    from infer.bench.hf_baseline import load_hf, run_hf_generate
    path = str(ensure_builtin(name))
    prompts = random_prompts(512, (5, 9, 3), seed=3)
    res = run_hf_generate(load_hf(path, dtype="float32", device="cpu"),
                          [BenchRequest(None, p, 6, ignore_eos=True) for p in prompts], batch_size=2, progress=False)
    with LLM(path, block_size=4) as llm:
        want = [llm.tokenizer.decode(t, skip_special_tokens=True) for t in greedy_tokens(llm, prompts, 6)]
    assert [r.success for r in res.records] == [True] * 3 and [r.text for r in res.records] == want


@pytest.mark.parametrize("name", ["tiny-gemma3-mm", "tiny-mistral3"])
def test_top_level_torch_dtype_is_the_checkpoint_dtype(tmp_path, name):
    """A multimodal config.json as transformers 4 wrote it (the hub's Gemma 3 and Mistral 3: torch_dtype at the top,
    none in text_config) names the checkpoint's dtype as transformers' dtype="auto" reads it (bfloat16), which
    `--dtype auto` computes in on a GPU (EngineConfig.torch_dtype); it was read as no dtype: float16, where Gemma 3's
    activations overflow."""
    from transformers import AutoModelForImageTextToText

    from infer.engine.setup import checkpoint_dtype
    from infer.models.loader import load_config
    folder = tmp_path / name
    shutil.copytree(ensure_builtin(name), folder)
    config = json.loads((folder / "config.json").read_text())
    config.pop("dtype", None)
    config["text_config"].pop("dtype", None)
    (folder / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    want = AutoModelForImageTextToText.from_pretrained(folder, dtype="auto").dtype
    assert want == torch.bfloat16 and checkpoint_dtype(load_config(folder)) == want


def _gemma3_mm_head_variant(folder, tie: bool | None, head: bool):
    """A copy of tiny-gemma3-mm in `folder` with tie_word_embeddings `tie` at both levels (None: unset, as the
    hub's Gemma 3 configs) and its own (untied, random) lm_head stored or not."""
    from safetensors.torch import save_file
    shutil.copytree(ensure_builtin("tiny-gemma3-mm"), folder)
    config = json.loads((folder / "config.json").read_text())
    for level in (config, config["text_config"]):
        level.pop("tie_word_embeddings")
        if tie is not None:
            level["tie_word_embeddings"] = tie
    (folder / "config.json").write_text(json.dumps(config))
    tensors = load_file(folder / "model.safetensors")
    assert "language_model.lm_head.weight" in tensors
    if not head:
        tensors.pop("language_model.lm_head.weight")
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@needs_gptqmodel
@pytest.mark.parametrize("case", ["tied-by-default-lm-head", "tied-with-a-stored-head"])
def test_infer_quantize_checks_a_multimodal_tied_head(tmp_path, case):
    """`infer quantize` refuses before calibrating: --lm-head on a Gemma 3 multimodal folder whose config sets no
    tie_word_embeddings (transformers ties it by Gemma3Config's default; GPTQModel failed after loading), and a
    folder tied by its config that stores a different language_model.lm_head.weight, which transformers and infer
    use (GPTQModel tied it and dropped the head: the quantized model answered through the embeddings)."""
    from helpers import greedy_each, hf_model
    tied = case == "tied-with-a-stored-head"
    src = _gemma3_mm_head_variant(tmp_path / "src", True if tied else None, head=tied)
    if tied:  # the stored head is the one served
        prompts = random_prompts(512, (5, 9), seed=3)
        with LLM(str(src), block_size=4) as llm:
            assert greedy_tokens(llm, prompts, 5) == greedy_each(hf_model(str(src)), prompts, 5)
    args = ["quantize", str(src), "-o", str(tmp_path / "q"), "--group-size", "32", "--num-samples", "4",
            "--seq-len", "32", *([] if tied else ["--lm-head"])]
    res = CliRunner().invoke(app, args)
    want = "stores a different lm_head.weight" if tied else "--lm-head: .* ties lm_head to the embeddings \\(no tie"
    assert res.exit_code == 2 and re.search(want, " ".join(res.output.split())), res.output
    assert "Calibrating" not in res.output and not (tmp_path / "q").exists()


@pytest.mark.parametrize("base", ["tiny-gemma3-mm", "tiny-mistral3", "ministral3-text"])
def test_adapter_without_target_modules_on_a_base_peft_has_no_default_for(tmp_path, base):
    """An adapter_config.json without target_modules on a multimodal base (peft reads the wrapper's model_type,
    gemma3 or mistral3) or a Ministral3ForCausalLM: peft has no default target_modules for either and refuses to
    load it; infer refuses it naming that (it served it as q_proj and v_proj adapted), LLM and lora-validate."""
    from helpers import hf_model, save_random_model
    from lora_helpers import check_no_target_modules_refused_as_peft, save_adapter
    from test_probes_session61_mm import MINISTRAL3
    if base == "ministral3-text":
        hf = save_random_model(tmp_path / "base", "ministral3", "Ministral3ForCausalLM", MINISTRAL3)
        folder, kind = tmp_path / "base", "ministral3"
    else:
        folder = ensure_builtin(base)
        hf, kind = hf_model(str(folder)), {"tiny-gemma3-mm": "gemma3", "tiny-mistral3": "mistral3"}[base]
    out = save_adapter(hf, tmp_path / "a", seed=1, r=4, lora_alpha=4,
                       target_modules=r"(.*language_model)?.*\.(q_proj|v_proj)")
    copy = check_no_target_modules_refused_as_peft(folder, out, tmp_path / "copy", kind)
    res = CliRunner().invoke(app, ["lora-validate", str(folder), str(copy)])
    assert res.exit_code != 0 and f"peft has no default for a {kind} base" in " ".join(res.output.split()), res.output


def test_top_level_eos_token_id_stops_generation(tmp_path):
    """A multimodal config.json's top-level eos_token_id (the hub's Gemma 3's [1, 106]: <end_of_turn>) in a folder
    without generation_config.json: transformers' generation config stops at it (over text_config's), and so does
    the engine (it stopped at text_config's alone)."""
    from transformers import AutoModelForImageTextToText
    folder = tmp_path / "mm"
    shutil.copytree(ensure_builtin("tiny-gemma3-mm"), folder)
    (folder / "generation_config.json").unlink()
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "eos_token_id": [2, 7]}))
    want = AutoModelForImageTextToText.from_pretrained(folder).generation_config.eos_token_id
    assert want == [2, 7]
    with LLM(str(folder), block_size=4) as llm:
        assert set(llm.engine.eos_token_ids) == {*want, llm.get_tokenizer().eos_token_id}


@pytest.mark.parametrize("name", ["tiny-gemma3-mm", "tiny-mistral3"])
def test_the_lora_benchmark_makes_adapters_of_a_multimodal_language_model(tmp_path, name):
    """infer.bench.lora_compare's adapters of a multimodal base adapt its language model's projections alone (they
    adapted the vision tower's q_proj, k_proj, v_proj too, which infer refuses; Mistral 3's was not loaded at all):
    served mixed with the base, they give peft's tokens."""
    from helpers import hf_model
    from infer.bench.lora_compare import make_adapters
    from lora_helpers import check_mixed_adapters_equal_peft
    base = ensure_builtin(name)
    paths = make_adapters(name, tmp_path, num=2, rank=8)
    assert not [k for k in load_file(tmp_path / "lora0" / "adapter_model.safetensors") if "vision" in k]
    check_mixed_adapters_equal_peft(base, hf_model(str(base)), paths, random_prompts(512, (5, 9, 7), seed=2),
                                    ["lora0", None, "lora1"])
