"""Integer helpers for the host side of kernel launches. `triton.cdiv` and `triton.next_power_of_2` compute the
same, but from Triton 3.7 on they are `ConstexprFunction`s whose Python call costs about 5 us (against 0.1 us
here), and a decoder layer's launches make some 35 such calls: about 5 ms of host time per eager 7B step."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n, for n >= 1 (as triton.next_power_of_2; 0 for n = 0, as Triton gives)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0
