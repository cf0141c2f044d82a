"""The engine's traits as the start banners of `infer run` and `infer serve` (one engine or replicas) name them:
device, dtype, KV cache (blocks, block size, and its type when --kv-cache-dtype sets one), max length, and speculative
decoding when --speculative-config turns it on, the pooling when --runner pooling serves embeddings."""

from __future__ import annotations


def engine_traits(dtype, num_blocks: int, block_size: int, kv_cache_dtype: str | None, max_len: int,
                  speculative: dict | None, each: bool = False, pooler=None) -> str:
    """e.g. "torch.float16, KV cache 812 blocks x 16 tokens of float8_e4m3fn, max length 4096, n-gram speculative
    decoding (4 draft tokens)" (or "draft-model speculative decoding (./small, 3 draft tokens)"). `kv_cache_dtype`:
    the cache's element type, None when --kv-cache-dtype is auto (the model's dtype); `each`: the blocks are every
    replica's; `pooler`: a pooling engine's (engine.pooling.Pooler), e.g. ", embeddings of MEAN pooling,
    normalized"."""
    kv = f" of {kv_cache_dtype}" if kv_cache_dtype else ""
    text = f"{dtype}, KV cache {num_blocks} blocks x {block_size} tokens{kv}{' each' if each else ''}, " \
           f"max length {max_len}"
    if speculative:
        k = speculative["num_speculative_tokens"]
        tokens = f"{k} draft token{'s' if k != 1 else ''}"
        if speculative.get("method") == "draft_model":
            text += f", draft-model speculative decoding ({speculative['model']}, {tokens})"
        elif speculative.get("method") in ("eagle3", "eagle"):
            name = "EAGLE-3" if speculative["method"] == "eagle3" else "EAGLE"
            text += f", {name} speculative decoding ({speculative['model']}, {tokens})"
        else:
            text += f", n-gram speculative decoding ({tokens})"
    if pooler is not None and pooler.task == "token_classify":  # (a token classifier's: every token's class)
        n = len(pooler.labels)
        text += f", a token classifier of {n} label{'s' if n != 1 else ''} (every prompt token classified)"
    elif pooler is not None and pooler.task == "classify":  # (a classifier's: its labels, what it answers)
        n = len(pooler.labels)
        text += f", a classifier of {n} label{'s' if n != 1 else ''} on {pooler.pooling_type} pooling"
    elif pooler is not None:  # (what a vector is: a pooling server said nothing of it)
        text += f", embeddings of {pooler.pooling_type} pooling, {'' if pooler.normalize else 'not '}normalized"
    return text


def start_traits(engine) -> str:
    """engine_traits of a started LLMEngine."""
    cfg, plan = engine.config, engine.memory_plan
    kv = plan.kv_cache_dtype if cfg.kv_cache_dtype != "auto" else None
    return engine_traits(engine.dtype, plan.num_blocks, cfg.block_size, kv, engine.max_model_len,
                         cfg.speculative_config, pooler=getattr(engine, "pooler", None))


def replica_traits(infos: list[dict], config) -> str:
    """engine_traits of data-parallel replicas (`infos`: parallel.replica's, `config`: their EngineConfig)."""
    first = infos[0]
    kv = first.get("kv_cache_dtype") if config.kv_cache_dtype != "auto" else None
    return engine_traits(first["dtype"], first["num_blocks"], config.block_size, kv, first["max_model_len"],
                         config.speculative_config, each=True, pooler=first.get("pooler"))
