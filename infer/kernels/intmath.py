"""Integer helpers for the host side of kernel launches. `triton.cdiv` and `triton.next_power_of_2` compute the
same, but from Triton 3.7 on they are `ConstexprFunction`s whose Python call costs about 5 us (against 0.1 us
here), and a decoder layer's launches make some 35 such calls: about 5 ms of host time per eager 7B step."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n, for n >= 1 (as triton.next_power_of_2; 0 for n = 0, as Triton gives)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0



# the LoRA shrink's split of K (`lora_ops.plan`): at most LORA_MAX_SPLIT partial sums, none over less than
# LORA_K_PER_SPLIT of K
LORA_MAX_SPLIT = 16
LORA_K_PER_SPLIT = 1024


def lora_split_most(k: int) -> int:
    """The most partial sums the LoRA shrink of an input width k splits into (`lora_ops.plan`, whatever the step's
    tokens): each holds a float32 row of the step's partials (`lora_ops.partials`)."""
    return max(1, min(LORA_MAX_SPLIT, next_power_of_2(cdiv(k, LORA_K_PER_SPLIT))))


PROGRAMS_PER_SM = 4  # decode attention programs an SM runs at once (4 warps, about 120 registers a thread on sm_90)


def decode_parts(num_seqs: int, kv_heads: int, context: int, block_n: int, programs: int) -> int:
    """Partitions of a sequence's keys in a decode attention launch (`kernels.attention`): as many as keep the
    launch's programs (one per sequence, KV head and partition) within `programs`, what the GPU runs at once, at
    most one per key block of the widest context the block tables hold (`context` keys), at least one. A large
    batch takes one partition (no partial results to merge, no second wave of programs); a small one cuts even a
    short context into as many programs, so that no program walks its key blocks one after the other while SMs
    wait."""
    return max(1, min(cdiv(context, block_n), programs // max(1, num_seqs * kv_heads)))
