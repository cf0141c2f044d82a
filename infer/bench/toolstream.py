"""What streaming a tool call costs the server's CPU: a reply whose call has one long string argument streamed a few
characters at a time, read at each step as a chat stream reads it (serve/tools.py's `visible` for "auto", then
serve/toolstream.py's `partial_calls` and CallStream's deltas), for each --tool-call-parser and for the forced
calls (a named tool_choice, "required"); "reasoning": a Qwen3 reply that thinks as long, then calls (hermes), split
at each step by the qwen3 --reasoning-parser (serve/reasoning.py's `parts`) before its content is read.

    python -m infer.bench.toolstream                              # 3,000 and 24,000 characters, 4 per step
    python -m infer.bench.toolstream --chars 1000 8000 64000 --step 1 --parsers hermes named --json out.json

Each row: the parser, the reply's length, the CPU seconds of the whole stream (the fastest of --repeats) and per
character (flat across lengths when the reading is linear in the reply; it grew with the length when each step read
the reply again). The streamed pieces are checked to join to the whole reply's arguments (a row is an error
otherwise). Nothing here is asserted anywhere.
"""

from __future__ import annotations

import argparse
import json
import time

from ..serve.reasoning import ReasoningRequest, parts
from ..serve.tools import parse_tools, split, visible
from ..serve.toolstream import CallStream, partial_calls

CODE = {"type": "object", "properties": {"code": {"type": "string"}, "n": {"type": "integer"}}}
TOOLS = [{"type": "function", "function": {"name": "run", "parameters": CODE}}]
# the forced calls' tool_choice (their replies are read with the hermes server's parser)
FORCED = {"named": {"type": "function", "function": {"name": "run"}}, "required": "required"}
THINKING = ReasoningRequest("qwen3")  # the "reasoning" row's split (its calls read with the hermes parser)


def replies(chars: int) -> dict[str, str]:
    """A reply of each parser (and forced call) whose call's "code" argument is about `chars` characters of JSON
    string text, an escape every few characters."""
    line = "x = 1\\n\\tprint(\\\"\\u00e9\\\")\\n"
    code = line * max(1, chars // len(line))
    xml = "<tool_call>\n<function=run>\n<parameter=code>\n" + code + "\n</parameter>\n</function>\n</tool_call>"
    return {"hermes": 'Ok.<tool_call>{"name": "run", "arguments": {"code": "' + code + '", "n": 3}}</tool_call>',
            "llama3_json": '{"name": "run", "parameters": {"code": "' + code + '", "n": 3}}',
            "mistral": '[TOOL_CALLS][{"name": "run", "arguments": {"n": 3, "code": "' + code + '"}}]',
            "openai": '<|start|>assistant to=functions.run<|channel|>commentary json<|message|>{"code": "' + code
                      + '"}',
            "qwen3_coder": xml,
            "seed_oss": xml.replace("tool_call>", "seed:tool_call>"),
            "pythonic": '[run(code="' + code + '", n=3)]',
            "granite": '<|tool_call|>[{"name": "run", "arguments": {"code": "' + code + '", "n": 3}}]',
            "phi4_mini_json": 'functools[{"name": "run", "arguments": {"code": "' + code + '", "n": 3}}]',
            "ernie45": '<tool_call>{"name": "run", "arguments": {"code": "' + code + '", "n": 3}}</tool_call>',
            "glm45": "<tool_call>run\n<arg_key>code</arg_key>\n<arg_value>" + code + "</arg_value>\n</tool_call>",
            "olmo3": '<function_calls>run(code="' + code + '", n=3)</function_calls>',
            "deepseek_v3": 'Ok.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>run\n```json\n{"code": "'
                           + code + '", "n": 3}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
            "deepseek_v31": 'Ok.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>run<｜tool▁sep｜>{"code": "' + code
                            + '", "n": 3}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
            "kimi_k2": 'Ok.<|tool_calls_section_begin|><|tool_call_begin|>functions.run:0<|tool_call_argument_begin|>'
                       '{"code": "' + code + '", "n": 3}<|tool_call_end|><|tool_calls_section_end|>',
            "internlm": 'Ok.<|action_start|><|plugin|>\n{"name": "run", "parameters": {"code": "' + code
                        + '", "n": 3}}<|action_end|>',
            "xlam": '[{"name": "run", "arguments": {"code": "' + code + '", "n": 3}}]',
            "hunyuan_a13b": '<tool_calls>[{"name": "run", "arguments": {"code": "' + code
                            + '", "n": 3}}]</tool_calls>',
            "minimax_m2": '<minimax:tool_call>\n<invoke name="run">\n<parameter name="n">3</parameter>\n'
                          '<parameter name="code">' + code + '</parameter>\n</invoke>\n</minimax:tool_call>',
            "named": '{"code": "' + code + '", "n": 3}',
            "required": '[{"name": "run", "parameters": {"code": "' + code + '", "n": 3}}]',
            "reasoning": "<think>" + code + '</think>\n\n<tool_call>{"name": "run", "arguments": {"code": "' + code
                         + '"}}</tool_call>'}


def stream_seconds(parser: str, reply: str, step: int) -> float:
    """CPU seconds to stream `reply` `step` characters at a time as the chat route reads it; ValueError when the
    pieces do not join to the whole reply's arguments."""
    body = {"tools": TOOLS, **({"tool_choice": FORCED[parser]} if parser in FORCED else {})}
    req = parse_tools(body, "hermes" if parser in FORCED or parser == "reasoning" else parser)
    stream, pieces, memo = CallStream(req), [], {}  # (memo: the reply's own, kept across its reads, as the server's)
    start = time.process_time()
    for k in range(0, len(reply), step):
        text = reply[:k]
        if parser == "reasoning":  # (the content after the reasoning is what the calls are read from)
            text = parts(THINKING, text, False, memo)[1]
        if req.mode == "auto":
            visible(req, text, memo)
        pieces += stream.deltas(partial_calls(req, text, stream.memo))
    whole = split(req, parts(THINKING, reply)[1] if parser == "reasoning" else reply)[1] or []
    pieces += stream.deltas(whole, finished=True)
    seconds = time.process_time() - start
    joined = ["".join(p["function"]["arguments"] for p in pieces if p["index"] == k) for k in range(len(whole))]
    if not whole or joined != [c["function"]["arguments"] for c in whole]:
        raise ValueError(f"{parser}: the streamed pieces do not join to the whole reply's arguments")
    return seconds


def rows(parsers: list[str], chars: list[int], step: int, repeats: int = 3) -> list[dict]:
    out = []
    for parser, reply in replies(300).items():  # (warm: the first stream's one-time costs left out)
        if parser in parsers:
            stream_seconds(parser, reply, step)
    for n in chars:
        texts = replies(n)
        for parser in parsers:
            seconds = min(stream_seconds(parser, texts[parser], step) for _ in range(repeats))
            out.append({"parser": parser, "chars": len(texts[parser]), "step": step, "seconds": round(seconds, 4),
                        "us_per_char": round(seconds / len(texts[parser]) * 1e6, 3)})
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m infer.bench.toolstream", description=__doc__.split("\n")[0])
    ap.add_argument("--chars", type=int, nargs="+", default=[3000, 24000], help="the long argument's lengths")
    ap.add_argument("--step", type=int, default=4, help="characters added per step (about a token's)")
    ap.add_argument("--parsers", nargs="+", default=list(replies(1)), choices=list(replies(1)))
    ap.add_argument("--repeats", type=int, default=3, help="streams of each reply: the fastest one's time is shown")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    if args.step < 1 or min(args.chars) < 1 or args.repeats < 1:
        ap.error("--step, --chars and --repeats must be positive")
    out = rows(args.parsers, args.chars, args.step, args.repeats)
    for r in out:
        print(f"{r['parser']:12} {r['chars']:8} chars  {r['seconds']:8.4f} s  {r['us_per_char']:7.3f} us/char")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
