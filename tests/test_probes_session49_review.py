"""Session 49 (review of the forty-eighth session's changes): the text of a tokenizer without a decoder (grown token by
token) holds back no run of <0xNN>-named tokens, and warmup's measured plan counts a draft model's CUDA graphs."""

from __future__ import annotations

from infer.engine.detokenizer import Detokenizer
from infer.engine.sampling_params import SamplingParams
from infer.engine.sequence import Sequence


def _word_level_with_byte_names():
    """A word-level vocabulary (no decoder: decode joins the token strings with spaces) that holds tokens named as
    SentencePiece's byte-fallback tokens (<0x41>...): without a ByteFallback decoder they are text like any other."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {f"t{i}": i for i in range(20)}
    vocab.update({"<0x41>": 20, "<0xE2>": 21, "<0x82>": 22})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="t0", eos_token="t1")
    assert tok._tokenizer.decoder is None
    return tok


def test_byte_named_tokens_without_a_decoder_stream_at_once_and_never_decode_the_reply_whole():
    """The joined path (a tokenizer without a decoder grows its text token by token) still held back the text of a
    trailing run of tokens named <0xNN> as if a ByteFallback decoder could merge them, and measured the text before
    the run by decoding it whole every step of the run (the cost in the square of the reply's length that the joined
    path removed). Without a decoder "<0xE2>" is final text: streamed at once, each id decoded alone."""
    tok = _word_level_with_byte_names()
    detok = Detokenizer(tok)
    assert detok.joined
    calls = []
    inner = detok._decode
    detok._decode = lambda ids: calls.append(len(ids)) or inner(ids)
    seq = Sequence("r", [2], SamplingParams())
    streamed = ""
    for token in [3, 4, 5, 20, 21, 22, 21, 22, 20, 6]:
        seq.output_token_ids.append(token)
        detok.update(seq, stop_token=False)
        assert seq.text == tok.decode(seq.output_token_ids)
        streamed += Detokenizer.delta(seq)
        assert streamed == seq.text  # nothing held back: no stop strings, no partial character
    assert max(calls) <= 2


def test_the_measured_plan_counts_the_drafts_graphs_as_the_engine_start_does(monkeypatch):
    """With CUDA graphs a draft model's one-token forwards are recorded into the target's pool, which an engine's
    start (start_activation_bytes) and warmup's formula count (memory.plan.draft_graph_bytes); warmup's measured plan
    (engine.profile.profile_run: the worst case's peak plus the graphs' pool by formula) counted the target's graphs
    only, its activations (and the estimate it compares them with) short of the draft's graphs. The worst case's
    measured peaks are stood in for: only what the plan adds to them is compared."""
    from infer.cli import warmup_plan
    from infer.engine import profile
    from infer.engine.config import EngineConfig
    from infer.memory.plan import cuda_graph_bytes, draft_graph_bytes
    from infer.models.tiny import ensure_builtin
    monkeypatch.setattr(profile, "_peak_activations", lambda *a: 1 << 20)
    monkeypatch.setattr(profile, "_draft_peak", lambda *a: 1 << 19)
    monkeypatch.setattr(warmup_plan, "graph_capture", lambda *a, **k: {})  # (no CUDA here)
    draft = ensure_builtin("tiny-qwen3")
    config = dict(model="tiny-llama", max_num_seqs=4, max_model_len=128, memory_limit="256MB", block_size=4,
                  speculative_config={"model": str(draft), "num_speculative_tokens": 3})

    def measured(graphs: bool):
        monkeypatch.setattr(EngineConfig, "use_cuda_graphs", lambda self: graphs)
        plan, extra = warmup_plan.measured_plan(EngineConfig(**config), 128, 4)
        assert extra["worst_case_run"]
        return plan.activation_peak_bytes, extra["activation_estimate_bytes"]

    (peak, estimate), (peak0, estimate0) = measured(True), measured(False)
    monkeypatch.setattr(EngineConfig, "use_cuda_graphs", lambda self: True)
    engine = EngineConfig(**config)
    _, model_config, _, dtype = warmup_plan._model_parts(engine)
    draft_config = warmup_plan._draft_cfg(engine)
    want = cuda_graph_bytes(engine, model_config, dtype) + draft_graph_bytes(engine, draft_config, dtype)
    assert draft_graph_bytes(engine, draft_config, dtype) > 0
    assert peak - peak0 == want and estimate - estimate0 == want, (peak - peak0, estimate - estimate0, want)
