"""Review probes of draft-model speculative decoding (session 47): the draft model's KV cache where a stale copy would
only lower acceptance (prefix-cache hits on a finished request's blocks, ...), and the option's refusals."""

from __future__ import annotations

import pytest
import torch

from infer import LLM, SamplingParams
from infer.models.tiny import ensure_builtin

from helpers import random_prompts


@pytest.fixture(scope="module")
def path():
    return str(ensure_builtin("tiny-llama"))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


def counters(llm) -> tuple[int, int]:
    s = llm.engine.stats()
    return s["spec_decode_num_draft_tokens"], s["spec_decode_num_accepted_tokens"]


def test_a_prefix_hit_on_a_finished_requests_blocks_feeds_the_draft_what_it_never_wrote(path):
    """The target as its own draft accepts every draft. A request whose last step accepted all its drafts and stopped
    left its cached blocks without the draft KV of that last accepted draft (it is fed the step after, and there was
    none): the next turn of the conversation, whose prompt hits those blocks, must feed the draft from there, not take
    the stale slot as its KV (every draft still accepted, as in an engine without the cache)."""
    spec = {"model": path, "num_speculative_tokens": 3}
    llm = LLM(path, block_size=4, speculative_config=spec)
    prompt = random_prompts(llm.engine.model_config.vocab_size, (10,), seed=11)[0]
    first = llm.generate([prompt], greedy(11))[0].token_ids  # its last step accepts all 3 drafts and stops
    turn = prompt + first + [5]
    before = counters(llm)
    out = llm.generate([turn], greedy(12))[0].token_ids
    after = counters(llm)
    assert llm.engine.block_manager.prefix_hits == 20
    cold = LLM(path, block_size=4, speculative_config=spec, enable_prefix_caching=False)
    assert cold.generate([turn], greedy(12))[0].token_ids == out
    drafted, accepted = after[0] - before[0], after[1] - before[1]
    assert (drafted, accepted) == counters(cold) and accepted == drafted


def test_an_adapter_folder_as_the_draft_is_refused_with_a_draft_hint(tmp_path, path):
    """A LoRA adapter given as the draft: the hint says how to make a draft of it (merge it), not to pass it with
    --lora (which would apply it to the target)."""
    from infer.errors import ModelLoadError
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4, "lora_alpha": 8, '
                                                  '"target_modules": ["q_proj"], "base_model_name_or_path": "x"}')
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError) as e:
        LLM(path, block_size=4, speculative_config={"model": str(tmp_path), "num_speculative_tokens": 2})
    assert "LoRA adapter" in e.value.message and "--speculative-config model" in e.value.message
    assert "--merge-lora" in e.value.hint and "--lora NAME" not in e.value.hint


def test_method_ngram_with_a_draft_model_names_the_conflict_not_an_unknown_key(path):
    from infer.engine.speculative import parse_speculative_config
    from infer.errors import ConfigError
    with pytest.raises(ConfigError) as e:
        parse_speculative_config({"method": "ngram", "model": path, "num_speculative_tokens": 2})
    assert "unknown" not in e.value.message and "takes no draft model" in e.value.message
    assert '"method": "draft_model"' in e.value.hint
    with pytest.raises(ConfigError, match="unknown key"):  # a key of neither method is still unknown
        parse_speculative_config({"method": "ngram", "model": "ngram", "num_speculative_tokens": 2, "foo": 1})
    assert parse_speculative_config({"method": "ngram", "model": "[ngram]", "num_speculative_tokens": 2})["method"] \
        == "ngram"


def test_warmup_takes_lengths_past_a_shorter_draft_context(tmp_path, path):
    """An engine with a draft of a shorter context takes a longer max_model_len (its sequences go on without drafts
    past the draft's context, as vLLM's): warmup's default length, its 'largest max_length' figure and a
    --max-length above the draft's context are the target's (session 50; they were capped at the draft's)."""
    import json
    import shutil

    from infer.cli.warmup_plan import check_length, default_length, estimate_plan
    from infer.engine.config import EngineConfig
    from infer.errors import ConfigError
    draft = tmp_path / "short"
    shutil.copytree(path, draft)
    config = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 256}))
    cfg = EngineConfig(model=path, memory_limit="64MB", block_size=4,
                       speculative_config={"model": str(draft), "num_speculative_tokens": 2})
    assert default_length(cfg) == min(4096, config["max_position_embeddings"]) > 256
    plan, _ = estimate_plan(cfg, 128, 4)
    assert plan.max_length_limit == config["max_position_embeddings"] > 256
    check_length(cfg, 300)  # taken
    with pytest.raises(ConfigError, match="model's context of"):
        check_length(cfg, config["max_position_embeddings"] + 1)


def test_the_int4_dequantize_scratch_is_planned_and_reserved_for_the_draft_too(path, monkeypatch):
    """On a GPU a long prefill dequantizes its biggest int4 layer into one scratch buffer, reserved before the CUDA
    graphs record its address. An int4 draft uses the same buffer: the plan and the reservation must take its
    layers too (the larger), or the draft's first long prefill reallocates it (memory outside the plan, and graphs
    writing into freed memory). Layer sizes faked: int4 layers compute this way on CUDA only."""
    from infer.engine import model_runner
    from infer.engine.config import EngineConfig
    from infer.engine.setup import load_engine_parts
    from infer.kernels import gptq_dequant
    from infer.memory import plan as plan_mod
    from infer.memory import sizes
    kw = dict(block_size=4, max_num_batched_tokens=512, max_model_len=64,
              speculative_config={"model": path, "num_speculative_tokens": 2})
    parts = load_engine_parts(EngineConfig(model=path, **kw))
    draft = parts.draft.model
    monkeypatch.setattr(sizes, "int4_layer_bytes", lambda model, dtype: 3 << 20 if model is draft else 1 << 20)
    cfg = EngineConfig(model=path, **kw)
    with_draft = plan_mod.start_activation_bytes(cfg, parts.model_config, parts.model, parts.dtype, 64,
                                                 parts.draft.model_config, draft)
    alone = plan_mod.start_activation_bytes(cfg, parts.model_config, parts.model, parts.dtype, 64,
                                            parts.draft.model_config)
    assert with_draft - alone == 2 << 20  # the larger of the two, not both
    reserved = []
    monkeypatch.setattr(gptq_dequant, "reserve_scratch", lambda device, dtype, numel: reserved.append(numel))
    from infer.engine.draft import DraftRunner
    runner = model_runner.ModelRunner(cfg, parts.model, dtype=parts.dtype, device=parts.device, num_blocks=8)
    runner.draft = DraftRunner(parts.draft, parts.dtype, 8, 4, parts.device)
    for m in draft.modules():  # a module with a qweight, as an int4 layer has
        if isinstance(m, torch.nn.Linear):
            m.qweight = m.weight
            break
    runner._reserve_dequant_scratch()
    assert reserved and reserved[0] * torch.empty((), dtype=parts.dtype).element_size() == 3 << 20
