"""fastmae.kernels: Triton kernels for packed varlen tensors, each beside its plain-torch reference.

Every op comes in two implementations with the same signature: `name` (Triton; CUDA, or CPU under
TRITON_INTERPRET=1) and `name_reference` (plain torch: the CPU path, the oracle of the tests, the benchmark baseline).
They know no model. This folder installs as `fastmae.kernels`: a top-level `kernels` would collide with the PyPI
package of that name.
"""

from .cross_entropy import linear_cross_entropy, linear_cross_entropy_reference
from .mask_select import (
                          MaskSelection,
                          hash32,
                          mask_key,
                          rank_within_sequences,
                          row_uniform_bits,
                          select_masked,
                          select_masked_reference,
                          uniform_bits,
)
from .rows import embed_rows, embed_rows_reference, insert_rows, insert_rows_reference

__all__ = [
    "MaskSelection",
    "embed_rows",
    "embed_rows_reference",
    "hash32",
    "insert_rows",
    "insert_rows_reference",
    "linear_cross_entropy",
    "linear_cross_entropy_reference",
    "mask_key",
    "rank_within_sequences",
    "row_uniform_bits",
    "select_masked",
    "select_masked_reference",
    "uniform_bits",
]
