"""kernels/launch.py's host ints: the grids and tiles Triton's own helpers would give, in one Python call each."""

import triton
from fastmae.kernels import launch

SIZES = [*range(0, 2050), *(2**k + d for k in range(11, 40) for d in (-1, 0, 1))]


def test_next_power_of_2_is_tritons():
    assert [launch.next_power_of_2(n) for n in SIZES] == [triton.next_power_of_2(n) for n in SIZES]


def test_cdiv_is_tritons():
    pairs = [(a, b) for a in SIZES[::7] for b in (1, 2, 3, 7, 64, 256, 1000)]
    assert [launch.cdiv(a, b) for a, b in pairs] == [triton.cdiv(a, b) for a, b in pairs]
