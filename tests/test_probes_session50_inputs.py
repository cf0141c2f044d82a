"""Probes of inputs and feature combinations (session 50): a seeded request with speculative decoding and a chunked
prompt, a bench workload naming an adapter no --lora gives, a bad prompt_lookup value given alone, and a config.json
implying more layers than the checkpoint holds."""

from __future__ import annotations

import pytest

from infer import LLM, SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.mark.parametrize("n", [1, 2])
def test_a_seeded_request_samples_the_same_tokens_whether_its_prompt_was_chunked(n):
    """With speculative decoding, the last chunk of a prompt prefilled in several steps (a prompt longer than
    --max-num-batched-tokens) got n-gram drafts from the prompt, so a seeded request drew from its generator for
    rows that the same prompt prefilled in one step did not have: the same request with the same seed sampled other
    tokens on an engine with a smaller token budget (or the first time, before the prefix cache held its prompt)."""
    prompt = [7, 8, 9, 7, 8, 9, 7, 8, 9]  # 9 tokens: a budget of 8 prefills 8, then the last one alone
    params = SamplingParams(max_new_tokens=8, temperature=0.8, seed=7, n=n, ignore_eos=True)
    runs = []
    for budget in ({"max_num_batched_tokens": 8, "max_num_seqs": 8}, {}):
        with LLM("tiny-llama", block_size=4, max_model_len=64, speculative_config=SPEC, enable_prefix_caching=False,
                 **budget) as llm:
            runs.append([[c.token_ids for c in o.outputs] for o in llm.generate([prompt], params)])
    assert runs[0] == runs[1]


def test_bench_refuses_a_jsonl_adapter_that_no_lora_gives_before_it_measures(tmp_path):
    """A jsonl workload line naming an adapter that no --lora registered was measured as a failed request, after the
    model had loaded and the level had run, and each failure told the user to pass LLM(..., loras=...), the Python
    API's spelling, not the command's --lora."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    data = tmp_path / "w.jsonl"
    data.write_text('{"prompt": "hello", "max_tokens": 2}\n\n{"prompt": "hi", "lora": "sql"}\n')
    res = CliRunner().invoke(app, ["bench", "tiny-llama", "--dataset", f"jsonl:{data}", "-c", "1", "-q",
                                   "--max-model-len", "64", "-o", str(tmp_path / "out")])
    assert res.exit_code == 2, res.output
    assert "'sql'" in res.output and "no --lora gives" in res.output and "--lora sql=" in res.output
    assert "LLM(" not in res.output


@pytest.mark.parametrize("given,named", [({"prompt_lookup_max": 0}, "prompt_lookup_max"),
                                         ({"prompt_lookup_max": 1e9}, "prompt_lookup_max"),
                                         ({"prompt_lookup_min": "2"}, "prompt_lookup_min")])
def test_a_bad_prompt_lookup_value_given_alone_is_named_by_its_own_key(given, named):
    """A prompt_lookup_max given alone takes the place of the prompt_lookup_min left out (vLLM's rule) before the
    values were checked, so a bad one was refused as "prompt_lookup_min must be an integer of at least 1", naming
    the key the user did not write."""
    from infer.engine.speculative import parse_speculative_config
    from infer.errors import ConfigError
    with pytest.raises(ConfigError) as e:
        parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3, **given})
    assert f"{named} must be an integer" in e.value.message
    other = ({"prompt_lookup_min", "prompt_lookup_max"} - {named}).pop()
    assert other not in e.value.message
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}) == {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 2}


@pytest.mark.parametrize("layers", [4, None])
def test_a_config_with_more_layers_than_the_weights_names_the_layer_count(tmp_path, layers):
    """config.json implying more layers than the checkpoint holds (one of another model size, or one without
    num_hidden_layers, whose transformers default is 32) was refused as "the checkpoint has no tensors for
    model.layers.2.self_attn.q_proj: the model folder is incomplete", sending the user after a missing file."""
    import json
    import shutil

    from infer.errors import ModelLoadError
    from infer.models.tiny import ensure_builtin
    folder = tmp_path / "m"
    shutil.copytree(ensure_builtin("tiny-llama"), folder)
    cfg = json.loads((folder / "config.json").read_text())
    have = cfg["num_hidden_layers"]
    if layers is None:
        del cfg["num_hidden_layers"]
    else:
        cfg["num_hidden_layers"] = layers
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError) as e:
        LLM(str(folder), max_model_len=64)
    assert f"weights for {have} layers, config.json implies {layers or 32}" in e.value.message
    assert f"num_hidden_layers: {have}" in e.value.hint
