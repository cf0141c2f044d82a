"""Draft-model speculative decoding with a draft whose vocab_size differs from the target's by padding only (as
Qwen2.5-0.5B's 151,936 drafting Qwen2.5-7B's 152,064: one tokenizer, the larger embedding padded): taken at start and
by warmup (--estimate and measured), greedy tokens equal a run without speculation with a smaller or a larger draft,
a draft never proposes an id the target lacks, a token the draft cannot embed (a padding id of the target's, in a
prompt or sampled) is fed as a stand-in, a grammar's verify rows keep the target's width; a draft of another
tokenizer, or of a vocab_size below the tokenizer's ids, is still refused naming both."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from infer import LLM, SamplingParams
from infer.engine.config import EngineConfig
from infer.errors import ConfigError
from infer.models.tiny import ensure_builtin

from helpers import random_prompts

KW = dict(block_size=4, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64)


@pytest.fixture(scope="module")
def path():
    return ensure_builtin("tiny-llama")  # vocab_size 512, its tokenizer's 512 ids


def spec(model, k: int = 3) -> dict:
    return {"model": str(model), "num_speculative_tokens": k}


def _padded(src, dst, vocab: int, favour: bool = False):
    """A copy of `src` with vocab_size `vocab` (> its tokenizer's ids): its embedding and head padded with random
    rows, or (`favour`) head rows of the padding ids that win the argmax nearly everywhere (+-20x rows 0..3)."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    old = cfg["vocab_size"]
    (dst / "config.json").write_text(json.dumps({**cfg, "vocab_size": vocab}))
    g = torch.Generator().manual_seed(vocab)
    tensors = load_file(dst / "model.safetensors")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        w = tensors[name]
        extra = 0.15 * torch.randn(vocab - old, w.shape[1], generator=g, dtype=w.dtype)
        if favour and name == "lm_head.weight":
            half = (vocab - old) // 2
            extra[:half], extra[half:2 * half] = 20 * w[:half], -20 * w[:half]
        tensors[name] = torch.cat([w, extra])
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def big(path, tmp_path_factory):
    """tiny-llama padded to 520 ids: the target of a 512-id draft (tiny-llama itself)."""
    return _padded(path, tmp_path_factory.mktemp("big") / "big", 520)


def _outputs(llm, prompts, lengths, **kw):
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True, **kw) for n in lengths]
    return [o.token_ids for o in llm.generate(prompts, params)]


def _recording(monkeypatch) -> list:
    """Every draft the draft model proposes (DraftRunner.propose's, after it)."""
    from infer.engine.draft import DraftRunner
    seen, real = [], DraftRunner.propose

    def propose(self, batch):
        real(self, batch)
        seen.extend(t for s in batch.seqs for t in s.draft_token_ids)
    monkeypatch.setattr(DraftRunner, "propose", propose)
    return seen


def test_a_smaller_padded_draft_is_taken_and_greedy_equals_plain(path, big, monkeypatch):
    """A 512-id draft of a 520-id target (the same tokenizer): taken, its drafts nearly all accepted (the target is
    the draft with padding rows), the tokens those of no speculation; prompts holding the target's padding ids
    (512..519: the draft has no row for them) change nothing."""
    seen = _recording(monkeypatch)
    plain = LLM(str(big), **KW)
    llm = LLM(str(big), speculative_config=spec(path), **KW)
    assert llm.engine.drafter.vocab == 512 and llm.engine.drafter.target_vocab == 520
    prompts = random_prompts(512, (3, 17, 9, 5), seed=49) + [[5, 519, 6, 513], [512, 512, 512]]
    lengths = [9, 6, 11, 4, 7, 8]
    assert _outputs(llm, prompts, lengths) == _outputs(plain, prompts, lengths)
    s = llm.engine.stats()
    assert s["spec_decode_num_draft_tokens"] > 0 and s["spec_decode_num_accepted_tokens"] > 0
    assert seen and max(seen) < 520


def test_a_target_sampling_a_padding_id_the_draft_lacks(path, big):
    """The target made to emit padding ids (logit_bias on 515, and on 517 for a while), which the draft cannot
    embed: fed to it as a stand-in, never an index past its embedding; greedy tokens as without speculation."""
    plain = LLM(str(big), **KW)
    llm = LLM(str(big), speculative_config=spec(path), **KW)
    prompts = random_prompts(512, (6, 11, 4), seed=7)
    for bias in ({515: 100.0}, {517: 8.0}):
        want = _outputs(plain, prompts, [8, 10, 5], logit_bias=bias)
        assert any(t >= 512 for ids in want for t in ids)
        assert _outputs(llm, prompts, [8, 10, 5], logit_bias=bias) == want
    mixed = [SamplingParams(max_new_tokens=9, ignore_eos=True, logit_bias={519: 100.0}),
             SamplingParams(max_new_tokens=9, ignore_eos=True)]
    got = [o.token_ids for o in llm.generate(prompts[:2], mixed)]
    assert got == [o.token_ids for o in plain.generate(prompts[:2], mixed)] and got[0] == [519] * 9


def test_a_larger_draft_never_proposes_an_id_the_target_lacks(path, tmp_path, monkeypatch):
    """A 520-id draft of the 512-id target whose head makes a padding id its argmax nearly everywhere: its drafts
    are the argmax over the target's 512 ids (the target's own tokens: nearly all accepted), greedy tokens as
    without speculation."""
    seen = _recording(monkeypatch)
    draft = _padded(path, tmp_path / "draft", 520, favour=True)
    plain = LLM(str(path), **KW)
    llm = LLM(str(path), speculative_config=spec(draft), **KW)
    prompts = random_prompts(512, (3, 17, 9, 5), seed=3)
    lengths = [9, 6, 11, 4]
    assert _outputs(llm, prompts, lengths) == _outputs(plain, prompts, lengths)
    s = llm.engine.stats()
    assert seen and max(seen) < 512
    assert s["spec_decode_num_accepted_tokens"] >= s["spec_decode_num_draft_tokens"] * 3 // 4 > 0


def test_a_grammars_drafts_with_a_smaller_draft_keep_the_targets_bitmask(path, big):
    """A structured output's drafts are cut by the target's grammar, their verify rows' bitmask the target's
    width (520 ids: 17 words), not the draft's (16)."""
    pytest.importorskip("xgrammar")
    from infer.engine.sampling_params import StructuredOutputsParams
    plain = LLM(str(big), **KW)
    llm = LLM(str(big), speculative_config=spec(path), **KW)
    for regex in ("(ab)+c", "[a-z ]{5,30}\\."):
        params = SamplingParams(max_new_tokens=16, structured_outputs=StructuredOutputsParams(regex=regex))
        prompts = [[5, 6, 7, 8] * 4, [40, 41, 42]]
        want = [o.token_ids for o in plain.generate(prompts, params)]
        assert [o.token_ids for o in llm.generate(prompts, params)] == want


def _retokenized(src, dst, vocab: int):
    """A copy of `src` of vocab_size `vocab` whose tokenizer gives ids 100 and 101 each other's token."""
    dst = _padded(src, dst, vocab)
    data = json.loads((dst / "tokenizer.json").read_text())
    v = data["model"]["vocab"]
    a, b = (t for t, i in sorted(v.items(), key=lambda x: x[1]) if i in (100, 101))
    v[a], v[b] = v[b], v[a]
    (dst / "tokenizer.json").write_text(json.dumps(data))
    return dst


def test_refused_when_the_tokenizers_differ_or_the_difference_is_not_padding(path, big, tmp_path):
    """Another tokenizer (and another size): refused naming the draft, the target and a token id that differs; a
    vocab_size below the tokenizer's ids (a draft of 500 of a 512-token tokenizer, a target of 520): refused naming
    both sizes and the target; a draft folder of another size without a tokenizer: refused (nothing shows the
    difference is padding). warmup --estimate refuses them as an engine start does."""
    from infer.cli.warmup_plan import estimate_plan
    other = _retokenized(path, tmp_path / "other", 520)
    with pytest.raises(ConfigError) as e:
        LLM(str(path), speculative_config=spec(other), **KW)
    msg = str(e.value)
    assert f"model {str(other)!r} has another tokenizer than the target model ({path})" in msg, msg
    assert "token id 100 is" in msg and e.value.hint
    with pytest.raises(ConfigError, match="another tokenizer"):
        estimate_plan(EngineConfig(str(path), speculative_config=spec(other)), 64, 2)
    small = tmp_path / "small"
    shutil.copytree(path, small)
    cfg = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**cfg, "vocab_size": 500}))
    with pytest.raises(ConfigError) as e:
        LLM(str(big), speculative_config=spec(small), **KW)
    msg = str(e.value)
    assert f"model {str(small)!r} has a vocabulary of 500 tokens, the target model 520 ({big})" in msg, msg
    assert "512 token ids" in msg
    bare = _padded(path, tmp_path / "bare", 520)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (bare / f).unlink(missing_ok=True)
    with pytest.raises(ConfigError, match="holds no tokenizer"):
        LLM(str(path), speculative_config=spec(bare), **KW)
    with pytest.raises(ConfigError, match="holds no tokenizer"):
        estimate_plan(EngineConfig(str(path), speculative_config=spec(bare)), 64, 2)


def test_warmup_estimate_and_measured_with_a_padded_pair(path, big, tmp_path):
    """`infer warmup --estimate` and the measured warmup (its draft's peak fed random ids of the target's 520,
    which the 512-id draft cannot embed) take the pair, the draft counted as an engine start counts it."""
    from infer.cli import warmup_plan
    config = EngineConfig(str(big), speculative_config=spec(path), block_size=4)
    plan, _ = warmup_plan.estimate_plan(config, 48, 2)
    alone, _ = warmup_plan.estimate_plan(EngineConfig(str(big), block_size=4), 48, 2)
    assert plan.weights_bytes > alone.weights_bytes
    measured, _ = warmup_plan.measured_plan(config, 48, 2)
    assert measured.weights_bytes > alone.weights_bytes
    larger = _padded(path, tmp_path / "larger", 520)
    plan, _ = warmup_plan.estimate_plan(EngineConfig(str(path), speculative_config=spec(larger), block_size=4), 48, 2)
    assert plan.weights_bytes > alone.weights_bytes
    from typer.testing import CliRunner

    from infer.cli.main import app
    for args in (["--estimate"], []):
        result = CliRunner().invoke(app, ["warmup", str(big), "--speculative-config", json.dumps(spec(path)),
                                          "--max-length", "48", "--concurrency", "2", "--block-size", "4", *args])
        assert result.exit_code == 0, result.output


def test_a_token_only_one_tokenizer_has_in_the_others_padding_is_no_conflict(path, big, tmp_path):
    """The tokenizers agree on every id both have: a draft whose tokenizer adds a token in the target's padding
    (id 516 of 520; a draft of 518 ids, and of 520) is taken, greedy tokens as without speculation; one whose added
    token lies beyond the other's vocab_size (id 519 in a draft of 520, a target of 518) is not padding: refused."""
    def with_added(src, dst, vocab: int, at: int):
        dst = _padded(src, dst, vocab)
        data = json.loads((dst / "tokenizer.json").read_text())
        data["added_tokens"].append({"id": at, "content": "<|extra|>", "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": False, "special": True})
        (dst / "tokenizer.json").write_text(json.dumps(data))
        return dst
    plain = LLM(str(big), **KW)
    prompts = random_prompts(512, (5, 9), seed=11)
    want = _outputs(plain, prompts, [7, 7])
    for vocab in (518, 520):
        draft = with_added(path, tmp_path / f"d{vocab}", vocab, 516)
        assert _outputs(LLM(str(big), speculative_config=spec(draft), **KW), prompts, [7, 7]) == want
    beyond = with_added(path, tmp_path / "beyond", 520, 519)
    with pytest.raises(ConfigError, match="has a vocabulary of 520 tokens, the target model 518") as e:
        LLM(str(_padded(path, tmp_path / "t518", 518)), speculative_config=spec(beyond), **KW)
    assert "520 token ids" in str(e.value)
