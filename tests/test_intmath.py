"""infer.kernels.intmath: the host-side integer helpers every kernel launch uses instead of Triton's (a 5 us call
each from Triton 3.7 on) compute what Triton's compute."""

import pytest

triton = pytest.importorskip("triton")


def test_cdiv_and_next_power_of_2_equal_tritons():
    from infer.kernels.intmath import cdiv, next_power_of_2
    for n in range(0, 5000):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
    for a in range(0, 700):
        for b in (1, 2, 3, 7, 16, 64, 127, 128, 512):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
    assert cdiv(1 << 40, 3) == triton.cdiv(1 << 40, 3) and next_power_of_2((1 << 40) + 1) == 1 << 41
