"""What a request gets back, against oracles: EOS / ignore_eos / max_length / prompt order / chat messages against
transformers' generate and chat template; stop strings and streaming deltas against OpenAI's semantics (the text
ends before the earliest stop string, generation halts at the token that completes it, streamed deltas add up to
the final text and never hand out text that is later taken back); SamplingParams accepts OpenAI's whole ranges."""

from __future__ import annotations

import random

import pytest
import torch

from infer import LLM, SamplingParams
from infer.engine.detokenizer import Detokenizer
from infer.engine.sequence import Sequence, Status
from infer.models.tiny import ensure_builtin

from helpers import hf_greedy, hf_model, random_prompts

SENTENCES = ["The weather today is mild, with rain after noon.", "To cook rice, rinse it twice; then boil it.",
             "héllo wörld — ½ 日本語 🙂 done.\nNext line: 42 times!",
             "A computer keeps its files in folders."]


@pytest.fixture(scope="module")
def llm():
    return LLM(str(ensure_builtin("tiny-llama")), block_size=4)


@pytest.fixture(scope="module")
def path(llm):
    return str(llm.engine.model_path)


@pytest.fixture(scope="module")
def prompt(llm):
    return random_prompts(llm.engine.model_config.vocab_size, (9,), seed=11)[0]


def test_eos_stops_the_request_unless_ignore_eos(llm, path, prompt, monkeypatch):
    full = hf_greedy(path, prompt, 12)
    i = next(i for i in range(2, 12) if full[i] not in full[:i])  # a token that first appears at step i
    monkeypatch.setattr(llm.engine, "eos_token_ids", {full[i]})
    out = llm.generate([prompt], SamplingParams(max_new_tokens=12))[0]
    assert out.token_ids == hf_greedy(path, prompt, 12, eos_token_id=full[i]) == full[:i + 1]
    assert out.finish_reason == "stop"
    assert out.text == llm.tokenizer.decode(full[:i], skip_special_tokens=True)  # EOS is not part of the text
    out = llm.generate([prompt], SamplingParams(max_new_tokens=12, ignore_eos=True))[0]
    assert out.token_ids == full and out.finish_reason == "length"
    out = llm.generate([prompt], SamplingParams(max_new_tokens=12, ignore_eos=True, stop_token_ids=[full[i]]))[0]
    assert out.token_ids == full[:i + 1] and out.finish_reason == "stop"  # ignore_eos leaves stop_token_ids alone


@pytest.mark.parametrize("extra", [1, 5])
def test_max_length_caps_prompt_plus_output_as_transformers(llm, path, prompt, extra):
    out = llm.generate([prompt], SamplingParams(max_new_tokens=12, ignore_eos=True,
                                                max_length=len(prompt) + extra))[0]
    with torch.no_grad():
        hf = hf_model(path).generate(torch.tensor([prompt]), max_length=len(prompt) + extra, do_sample=False,
                                     pad_token_id=0)[0, len(prompt):].tolist()
    assert out.token_ids == hf and len(hf) == extra and out.finish_reason == "length"


def test_generate_returns_outputs_in_prompt_order(llm, path):
    prompts = random_prompts(llm.engine.model_config.vocab_size, (4, 9, 6, 12), seed=12)
    lengths = [14, 2, 9, 1]  # the first prompt finishes last
    outs = llm.generate(prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lengths])
    assert [o.prompt_token_ids for o in outs] == prompts
    assert [o.token_ids for o in outs] == [hf_greedy(path, p, n) for p, n in zip(prompts, lengths)]


def test_chat_messages_use_the_chat_template_with_the_generation_prompt(llm, path):
    tok = llm.tokenizer
    one = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "How do I cook rice?"}]
    two = [{"role": "user", "content": "And pasta?"}]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    single = llm.generate(one, params)  # one conversation is one prompt
    both = llm.generate([one, two], params)
    assert len(single) == 1 and len(both) == 2
    for msgs, out in ((one, single[0]), (one, both[0]), (two, both[1])):
        ids = list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)
                   ["input_ids"])
        assert tok.decode(ids).endswith("<|im_start|>assistant\n")
        assert out.prompt_token_ids == ids and out.token_ids == hf_greedy(path, ids, 6)


def _openai_stop(tok, ids: list[int], stops: list[str]) -> tuple[int, str] | None:
    """(tokens generated when it halts, final text) by OpenAI's rule: halt at the first token after which the text
    holds a stop string; the text ends right before the earliest stop string in it."""
    for k in range(1, len(ids) + 1):
        text = tok.decode(ids[:k], skip_special_tokens=True)
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return k, text[:min(hits)]
    return None


def _run(detok, ids, stops):
    """Feed `ids` one at a time as the engine does; (tokens fed when a stop was found or None, text, deltas)."""
    seq = Sequence("r", [1], SamplingParams(stop=stops))
    seq.status, deltas = Status.RUNNING, []
    for k, t in enumerate(ids, 1):
        seq.output_token_ids.append(t)
        stopped = detok.update(seq, stop_token=False)
        if stopped:
            seq.status = Status.FINISHED
        deltas.append(Detokenizer.delta(seq))
        assert seq.text.startswith("".join(deltas)), "a streamed delta was taken back"
        if stopped:
            return k, seq.text, deltas
    seq.status = Status.FINISHED
    deltas.append(Detokenizer.delta(seq))
    return None, seq.text, deltas


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_stop_strings_and_stream_deltas_follow_openai(name):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(ensure_builtin(name)))
    detok, rng = Detokenizer(tok), random.Random(0)
    spanning = earliest = 0
    for trial in range(120):
        ids = tok(rng.choice(SENTENCES), add_special_tokens=False)["input_ids"]
        text = tok.decode(ids)
        stops = []
        for _ in range(rng.randrange(1, 4)):
            a = rng.randrange(len(text))
            stops.append(text[a:a + rng.randrange(1, 7)])
        if rng.random() < 0.3:
            stops.append("never in the text")
        want = _openai_stop(tok, ids, stops)
        k, got, deltas = _run(detok, ids, stops)
        if want is None:
            assert k is None and got == text
        else:
            assert (k, got) == want, (stops, text)
            first = tok.decode(ids[:k - 1])
            spanning += any(s in tok.decode(ids[:k]) and s not in first and
                            tok.decode(ids[:k]).find(s) < len(first) for s in stops)
            earliest += len({tok.decode(ids[:k]).find(s) for s in stops if s in tok.decode(ids[:k])}) > 1
        assert "".join(deltas) == got
    assert spanning > 10 and earliest > 3  # stops across token boundaries, and several completed at once


def test_a_token_that_completes_two_stop_strings_cuts_at_the_earlier():
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(ensure_builtin("tiny-llama")))
    the = tok(" the", add_special_tokens=False)["input_ids"]
    assert len(the) == 1
    k, text, _ = _run(Detokenizer(tok), tok("Go", add_special_tokens=False)["input_ids"] + the, ["e", "h"])
    assert text == "Go t"  # not "Go th": "h" comes first in the text, though "e" comes first in the list


def test_engine_stream_with_several_stop_strings(llm, prompt):
    full = llm.generate([prompt], SamplingParams(max_new_tokens=30, ignore_eos=True))[0]
    stops = [full.text[10:16], full.text[12:14]]  # overlapping; the short one is complete first
    want = _openai_stop(llm.tokenizer, full.token_ids, stops)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True, stop=stops)
    streamed, last = "", None
    for _, delta, out in llm.stream([prompt], params):
        streamed += delta
        assert full.text.startswith(streamed) and out.text.startswith(streamed)
        last = out
    assert last.finish_reason == "stop" and (len(last.token_ids), last.text) == want and streamed == last.text


def test_a_step_output_keeps_its_own_lists(llm, prompt):
    params = SamplingParams(max_new_tokens=5, ignore_eos=True, logprobs=2, prefix_token_ids=[11, 12])
    outs = [out for _, _, out in llm.stream([prompt], params)]  # read only after the request finished
    assert [o.num_generated for o in outs] == [1, 2, 3, 4, 5]
    for o in outs:
        assert len(o.token_ids) == o.num_generated + 2 and o.token_ids[:2] == [11, 12]
        assert len(o.logprobs) == len(o.token_times) == o.num_generated
        assert [r["token_id"] for r in o.logprobs] == o.token_ids[2:]
        assert o.usage == {"prompt_tokens": len(prompt), "completion_tokens": o.num_generated}


@pytest.mark.parametrize("kwargs", [dict(presence_penalty=-2.0), dict(presence_penalty=2.0),
                                    dict(frequency_penalty=-2.0), dict(frequency_penalty=2), dict(logprobs=0),
                                    dict(logprobs=20), dict(top_p=1.0), dict(temperature=2.0), dict(top_k=0),
                                    dict(seed=0), dict(max_new_tokens=1)])
def test_openai_ranges_are_accepted(kwargs):
    SamplingParams(**kwargs)


def test_stop_may_be_one_string_as_in_openai():
    assert SamplingParams(stop="\n\n").stop == ["\n\n"]
    assert SamplingParams(stop=None).stop == [] and SamplingParams(stop=["a", "bc"]).stop == ["a", "bc"]


def test_one_setting_per_prompt_or_one_for_all(llm, path):
    from infer.errors import RequestError
    prompts = random_prompts(llm.engine.model_config.vocab_size, (4, 7, 5), seed=13)
    for params, lora in (([SamplingParams(max_new_tokens=2)] * 2, None), (None, [None, None])):
        with pytest.raises(RequestError, match="3 prompts but 2 "):
            llm.generate(prompts, params, lora=lora)
    assert not llm.engine.has_unfinished_requests()  # nothing was submitted
    outs = llm.generate(prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (1, 2, 3)],
                        lora=[None] * 3)
    assert [len(o.token_ids) for o in outs] == [1, 2, 3]


def test_text_prompts_are_encoded_with_the_tokenizers_special_tokens(tmp_path):
    """A text prompt is `tokenizer(prompt)` as transformers encodes it: with the BOS a Llama-style tokenizer's
    post-processor adds (the built-in tokenizers add none, so one is added here)."""
    import shutil
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer
    src = ensure_builtin("tiny-llama")
    for f in src.iterdir():
        if not f.name.startswith("tokenizer"):
            shutil.copy(f, tmp_path / f.name)
    tok = AutoTokenizer.from_pretrained(src)
    tok._tokenizer.post_processor = TemplateProcessing(single="<|endoftext|> $A",
                                                       special_tokens=[("<|endoftext|>", 0)])
    tok.save_pretrained(tmp_path)
    want = AutoTokenizer.from_pretrained(tmp_path)("To cook rice, rinse it")["input_ids"]
    assert want[0] == 0
    out = LLM(str(tmp_path), block_size=4).generate("To cook rice, rinse it",
                                                    SamplingParams(max_new_tokens=4, ignore_eos=True))[0]
    mask = torch.ones(1, len(want), dtype=torch.long)  # the BOS is token 0, transformers' pad id here
    assert out.prompt_token_ids == want and out.token_ids == hf_greedy(str(src), want, 4, attention_mask=mask)


@pytest.mark.parametrize("kind", ["frequency_penalty", "presence_penalty"])
def test_one_penalty_alone_follows_openai(llm, path, prompt, kind):
    """OpenAI: logit[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty, c counting the generated
    tokens; a request with only one of the two set (and nothing else in the batch) is penalized too."""
    n, m = 10, hf_model(path)
    out = llm.generate([prompt], SamplingParams(max_new_tokens=n, ignore_eos=True, **{kind: 2.0}))[0]
    gen = []
    for _ in range(n):
        with torch.no_grad():
            logits = m(torch.tensor([prompt + gen])).logits[0, -1]
        counts = torch.bincount(torch.tensor(gen, dtype=torch.long), minlength=logits.numel()).float()
        logits -= 2.0 * (counts if kind == "frequency_penalty" else (counts > 0).float())
        gen.append(int(logits.argmax()))
    assert out.token_ids == gen and gen != hf_greedy(path, prompt, n)  # the penalty changed the reply
