"""Options that take several values after one flag, as vLLM's argparse `nargs="+"` options do
(`--served-model-name A B`, `--lora-target-modules o_proj qkv_proj`); click takes one value per flag, so the
values are spread over repeated flags first.

A value run stops at the next option. It is greedy as argparse's, except that it leaves the command's positional
arguments (MODEL) that appear nowhere else: `infer serve --served-model-name a tiny-llama` keeps serving tiny-llama
under the name a, as it always did.
"""

from __future__ import annotations

from typer.core import TyperCommand


def _is_option(token: str) -> bool:
    return token.startswith("-") and token != "-" and not token.lstrip("-").replace(".", "", 1).isdigit()


def spread(args: list[str], many: set[str], takes_value: set[str], positionals: int) -> list[str]:
    """`args` with every `FLAG V1 V2 ...` of a flag in `many` written `FLAG V1 FLAG V2 ...`, leaving the last
    values of the last runs as positionals when fewer than `positionals` appear elsewhere."""
    tokens: list[tuple[str, str | None]] = []  # (token, the many-valued flag it is an extra value of)
    found, i = 0, 0
    while i < len(args):
        token = args[i]
        if token == "--":
            tokens += [(t, None) for t in args[i:]]
            found += len(args) - i - 1
            break
        name = token.split("=", 1)[0]
        if _is_option(token) and "=" not in token and (name in takes_value or name in many) and i + 1 < len(args):
            tokens += [(token, None), (args[i + 1], None)]
            i += 2
            while name in many and i < len(args) and not _is_option(args[i]):
                tokens.append((args[i], name))
                i += 1
            continue
        found += not _is_option(token)
        tokens.append((token, None))
        i += 1
    keep = max(0, positionals - found)  # the trailing extras that are the command's positionals after all
    for k in range(len(tokens) - 1, -1, -1):
        if keep == 0:
            break
        if tokens[k][1] is not None:
            tokens[k] = (tokens[k][0], None)
            keep -= 1
    out: list[str] = []
    for token, flag in tokens:
        out += [flag, token] if flag is not None else [token]
    return out


class ManyValuesCommand(TyperCommand):
    """A command whose options named in `MANY` take several values after one flag (vLLM's nargs "+"): serve, and
    for --lora-target-modules, an engine option, the other engine commands (run, warmup, bench) and lora-validate
    too."""

    MANY = {"--served-model-name", "--api-key", "--lora-target-modules"}

    def parse_args(self, ctx, args):
        options = [p for p in self.params if p.param_type_name == "option"]  # typer's click or click's own
        takes_value = {name for p in options if not p.is_flag and not p.count for name in p.opts}
        many = {name for p in options if p.multiple for name in p.opts if name in self.MANY}
        positionals = sum(1 for p in self.params if p.param_type_name == "argument" and p.required)
        return super().parse_args(ctx, spread(list(args), many, takes_value, positionals))
