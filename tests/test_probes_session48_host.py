"""Session 48, host work per step: the step_overhead bench's --adapters, and the text of a tokenizer without a decoder
(a word-level vocabulary, as the GPU benches' tokenizer) grown token by token instead of decoded whole each step."""

from __future__ import annotations

import random

import pytest

from infer.engine.detokenizer import Detokenizer
from infer.engine.sampling_params import SamplingParams
from infer.engine.sequence import Sequence


def _word_level_tokenizer():
    """t0..t49 (t0 pad, t1 eos: special), an added special and an added normal token, an empty token string, no
    decoder: decode joins the token strings with spaces."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {f"t{i}": i for i in range(50)}
    vocab[""] = 50
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="t0", eos_token="t1")
    tok.add_tokens([AddedToken("<sp>", special=True), AddedToken("word", special=False)])
    assert tok._tokenizer.decoder is None
    return tok


@pytest.mark.parametrize("params", [dict(), dict(skip_special_tokens=False),
                                    dict(spaces_between_special_tokens=False), dict(include_stop_str_in_output=True)])
def test_text_without_a_decoder_is_the_whole_decode_token_by_token(params):
    tok = _word_level_tokenizer()
    detok = Detokenizer(tok)
    assert not detok.incremental
    calls = []
    for name in ("_decode", "_decode_all"):
        inner = getattr(detok, name)
        setattr(detok, name, lambda ids, inner=inner: calls.append(len(ids)) or inner(ids))
    detok._decode_joined = {k: (lambda ids, inner=f: calls.append(len(ids)) or inner(ids))
                            for k, f in detok._decode_joined.items()}
    p = SamplingParams(**params)
    skip = p.skip_special_tokens
    ids_pool = list(range(len(tok))) + [len(tok) + 5]  # an id without a token: decode drops it
    rng = random.Random(0)
    for _ in range(40):
        seq = Sequence("r", [2], p)
        for _ in range(rng.randrange(1, 30)):
            seq.output_token_ids.append(rng.choice(ids_pool))
            detok.update(seq, stop_token=False)
            assert seq.text == tok.decode(seq.output_token_ids, skip_special_tokens=skip)
        seq.output_token_ids.append(rng.choice(ids_pool))  # a stop token: in the text only with include_stop_str
        detok.update(seq, stop_token=True)
        kept = seq.output_token_ids if p.include_stop_str_in_output else seq.output_token_ids[:-1]
        assert seq.text == tok.decode(kept, skip_special_tokens=skip)
    assert max(calls) <= 2  # each id decoded alone (and doubled): never the whole reply again


def test_step_overhead_runs_requests_with_mixed_adapters(tmp_path):
    from infer.bench import step_overhead
    loras = step_overhead.write_adapters("tiny-llama", 2, tmp_path)
    engine = step_overhead.build_engine("tiny-llama", 3, "cpu", None, 256, loras)
    step_overhead.start_requests(engine, 3, 8, adapters=list(loras))
    assert [s.lora_name for s in engine.scheduler.running] == ["lora0", "lora1", "lora0"]
    assert engine.lora_manager.max_loras == 2


def test_step_overhead_adapters_option_reaches_the_run(monkeypatch):
    from infer.bench import step_overhead
    seen = []
    monkeypatch.setattr(step_overhead, "run_one", lambda *a: seen.append(a) or {})
    step_overhead.main(["--concurrency", "4", "--adapters", "3"])
    assert seen and seen[0][-1] == 3
    with pytest.raises(SystemExit):
        step_overhead.main(["--adapters", "-1"])


def test_host_groups_equal_the_device_grouping():
    """lora.batch.host_groups (a LoRA step's grouping by adapter slot, made on the host from the slots it has) gives
    lora_groups' order and starts exactly, for random, sorted, all-base and single-slot batches, and says in_order
    exactly when the slots do not decrease."""
    import torch

    from infer.lora.batch import host_groups, lora_groups
    rng = random.Random(48)
    cases = [[], [-1] * 5, [2] * 4, [-1, -1, 0, 1, 1, 3], [3, 1, -1, 1, 0, -1, 3]]
    cases += [[rng.randrange(-1, s) for _ in range(rng.randrange(1, 40))] for s in (1, 2, 5, 16) for _ in range(50)]
    for slots in cases:
        num_slots = max(slots, default=0) + 1 + rng.randrange(3)
        order, starts, in_order = host_groups(slots, num_slots)
        want = lora_groups(torch.tensor(slots, dtype=torch.long), num_slots)
        assert order == want.order.tolist() and starts == want.starts.tolist(), slots
        assert in_order == (slots == sorted(slots)), slots
