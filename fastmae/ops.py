"""The one place that picks an implementation for each kernels/ op the model calls.

For now every op is the plain-torch reference from fastmae.kernels (vectorised; the CPU path). The Triton kernels
for CUDA tensors plug in here, behind the same signatures.
"""

from .kernels import insert_rows_reference, linear_cross_entropy_reference, select_masked_reference

select_masked = select_masked_reference
insert_rows = insert_rows_reference
linear_cross_entropy = linear_cross_entropy_reference
