"""Probes of the Python API (LLM, SamplingParams, outputs) as a vLLM user uses it (session 39)."""

from __future__ import annotations

import pytest

from infer.engine.detokenizer import Detokenizer
from infer.engine.sampling_params import SamplingParams
from infer.engine.sequence import Sequence


@pytest.fixture(scope="module")
def byte_fallback_tok():
    """A SentencePiece-style tokenizer whose only text tokens are "a", "b" and the 256 byte-fallback tokens."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}, "a": 259, "b": 260}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize("stop", ["世界", "界", "好世界"])
def test_stop_string_completed_by_the_last_byte_of_a_long_byte_run_stops_at_that_token(byte_fallback_tok, stop):
    """A byte-fallback decoder shows an unfinished run of byte tokens as one U+FFFD per byte, and the run's text as
    far fewer characters once its last byte comes. The stop string search started near the end of the old (longer)
    text, past the stop string in the new text: it was found a token late (that token kept in the reply), or never
    when the reply ended there (finish_reason length with the stop string in the text)."""
    run = [3 + b for b in "你好你好你好世界".encode()]
    ids = [259] + run + [260]
    detok = Detokenizer(byte_fallback_tok)
    seq = Sequence("r", [1], SamplingParams(max_new_tokens=100, stop=[stop]))
    found = None
    for k, token in enumerate(ids):
        seq.output_token_ids.append(token)
        if detok.update(seq, False):
            found = k
            break
    assert found == len(run)  # the run's last byte
    assert seq.text == "a你好你好你好世界"[:"a你好你好你好世界".index(stop)]


@pytest.fixture(scope="module")
def overlapped():
    """An LLM whose steps overlap (the CUDA default) on the CPU: a step launches its batch, then waits for the
    tokens of the batch before it."""
    from infer import LLM
    llm = LLM("tiny-llama", max_model_len=128, overlap=True)
    yield llm
    llm.close()


@pytest.mark.parametrize("late", [False, True], ids=["plain", "bad-word-of-two-tokens"])
@pytest.mark.parametrize("at", [1, 3])
def test_ctrl_c_while_a_step_waits_for_the_device_loses_no_tokens_of_another_call(overlapped, monkeypatch, late, at):
    """With overlapped steps, a KeyboardInterrupt while generate() waited for the previous batch's tokens (on a GPU
    most of a step is that wait) dropped that batch: a stream paused meanwhile then ended with finish_reason error
    ("a pending token without the step that made it") after a few tokens. The batch is now completed by the next
    step."""
    from infer.engine import model_runner
    tok = overlapped.get_tokenizer()
    assert len(tok.encode("hello world", add_special_tokens=False)) > 1
    params = SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=0.8, seed=1,
                            bad_words=["hello world"] if late else None)
    ref_a, ref_b = overlapped.generate(["stream prompt A", "other B"], params)
    events = overlapped.stream(["stream prompt A"], params)
    got = [next(events), next(events)]
    real, calls = model_runner.StepHandle.result, []

    def interrupted(self):
        calls.append(1)
        if len(calls) == at:
            raise KeyboardInterrupt
        return real(self)
    monkeypatch.setattr(model_runner.StepHandle, "result", interrupted)
    with pytest.raises(KeyboardInterrupt):
        overlapped.generate(["other B"], params)
    monkeypatch.setattr(model_runner.StepHandle, "result", real)
    got += list(events)
    final = got[-1][2]
    assert (final.finish_reason, final.token_ids) == ("length", ref_a.token_ids)
    assert "".join(delta for _, delta, _ in got) == final.text == ref_a.text
    again = overlapped.generate(["other B", "stream prompt A"], params)
    assert [o.token_ids for o in again] == [ref_b.token_ids, ref_a.token_ids]
    assert not overlapped.engine.requests and overlapped.engine.block_manager.num_used_blocks == 0


@pytest.fixture(scope="module")
def llm():
    from infer import LLM
    llm = LLM("tiny-llama", max_model_len=128)
    yield llm
    llm.close()


def test_a_tuple_of_sampling_params_is_one_per_prompt_as_in_vllm(llm):
    """vLLM's generate takes `Sequence[SamplingParams]`; a tuple was refused ("params must be a SamplingParams or a
    list of them")."""
    params = (SamplingParams(max_new_tokens=2, ignore_eos=True), SamplingParams(max_new_tokens=3, ignore_eos=True))
    outs = llm.generate(["a", "b"], params)
    assert [len(o.token_ids) for o in outs] == [2, 3]
    assert [len(o.token_ids) for o in llm.generate(["a", "b"], sampling_params=params)] == [2, 3]
    assert [len(o.token_ids) for o in llm.chat([[{"role": "user", "content": "a"}]] * 2, params)] == [2, 3]
    events = [e for e in llm.stream(["a", "b"], params=params, lora=(None, None)) if e[2].finished]
    assert sorted((i, len(o.token_ids)) for i, _, o in events) == [(0, 2), (1, 3)]


def test_max_tokens_can_be_set_as_in_vllm(llm):
    """vLLM code sets params.max_tokens (SamplingParams there is a mutable struct): it was Python's bare
    AttributeError ("property 'max_tokens' ... has no setter"). It sets max_new_tokens, checked when used."""
    from infer.errors import RequestError
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    params.max_tokens = 3
    assert params.max_new_tokens == 3 and len(llm.generate(["a"], params)[0].token_ids) == 3
    params.max_tokens = 0
    with pytest.raises(RequestError, match="max_new_tokens must be in 1"):
        llm.generate(["a"], params)


def _first_stop(tok, ids: list[int], params: SamplingParams) -> int | None:
    """The index of the token at which the Detokenizer finds a stop string, fed `ids` one at a time."""
    detok, seq = Detokenizer(tok), Sequence("r", [1], params)
    for k, token in enumerate(ids):
        seq.output_token_ids.append(token)
        if detok.update(seq, False):
            return k
    return None


def test_min_tokens_ending_inside_a_character_keeps_a_stop_string_that_character_completes(byte_fallback_tok):
    """With min_tokens, a stop string must end after the text of the first min_tokens tokens. That text was
    measured with the U+FFFD of a character whose last bytes had not come (one per byte in a byte-fallback run), so
    a stop string ending with that character, completed after min_tokens, was never found (vLLM holds such a
    character back from the text, and stops there)."""
    from transformers import AutoTokenizer
    from infer.models.tiny import ensure_builtin
    level = AutoTokenizer.from_pretrained(str(ensure_builtin("tiny-llama")))  # byte-level BPE (Llama 3, Qwen)
    ids = level.encode("ab 你好世界 cd", add_special_tokens=False)
    end = next(k for k in range(len(ids)) if "世界" in level.decode(ids[:k + 1]))  # the token completing 界
    assert "\ufffd" in level.decode(ids[:end])  # 界 is split over tokens
    for min_tokens in (end - 1, end):  # the first min_tokens tokens end inside 界
        assert _first_stop(level, ids, SamplingParams(stop=["世界"], min_tokens=min_tokens)) == end, min_tokens
    assert _first_stop(level, ids, SamplingParams(stop=["世界"], min_tokens=end + 1)) is None  # 世界 within them
    run = [3 + b for b in "你好世界".encode()]
    ids = [259] + run + [260, 260]
    for min_tokens in (5, 11):  # a + 4 bytes (你 + 1 byte of 好), a + 10 bytes (你好世 + 1 byte of 界)
        assert _first_stop(byte_fallback_tok, ids, SamplingParams(stop=["世界"], min_tokens=min_tokens)) == len(run)


def test_a_step_whose_tokens_cannot_be_read_fails_once_not_at_every_later_step(overlapped, monkeypatch):
    """A batch whose tokens cannot be read (its copy failed) ends its requests with the error; the engine does not
    try it again at every later step (only an interrupted wait is completed later), so the next call runs."""
    from infer.engine import model_runner
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    ref = overlapped.generate(["a", "b"], params)
    real, broken = model_runner.StepHandle.result, []

    def failing(self):
        if not broken and self.rows:
            broken.append(self)
        if any(self is b for b in broken):  # (identity: a StepHandle compares tensors with ==)
            raise RuntimeError("the copy of this step's tokens failed")
        return real(self)
    monkeypatch.setattr(model_runner.StepHandle, "result", failing)
    assert {o.finish_reason for o in overlapped.generate(["a", "b"], params)} == {"error"}
    again = overlapped.generate(["a", "b"], params)
    assert [o.token_ids for o in again] == [o.token_ids for o in ref]

