"""fastmae.kernels: data-movement and loss ops on packed varlen tensors; they know no model.

Each op has a plain-torch reference (`*_reference`): the CPU path and the oracle of the GPU kernels.
This folder installs as `fastmae.kernels` (a top-level `kernels` would collide with the PyPI package of that name).
"""

from .cross_entropy import linear_cross_entropy_reference
from .mask_select import MaskSelection, hash32, mask_key, row_uniform_bits, select_masked_reference
from .scatter import insert_rows_reference

__all__ = [
    "MaskSelection",
    "hash32",
    "insert_rows_reference",
    "linear_cross_entropy_reference",
    "mask_key",
    "row_uniform_bits",
    "select_masked_reference",
]
