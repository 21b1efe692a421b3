"""fastmae.kernels: Triton kernels for packed varlen tensors, each with a plain-torch reference.

Every op comes in two implementations with the same signature: `name` (Triton; CUDA, or CPU under
TRITON_INTERPRET=1), in the module of its topic (mask_select, rows, table_grad, cross_entropy, rotary, norm,
activation, projection, local_window), and `name_reference` (plain torch: the CPU path, the oracle of the tests, the
benchmark baseline), in reference.py. The references and the masking hash (hashing.py) import no Triton; the Triton
ops are imported on first use, so fastmae installs and trains on CPU where Triton is not installed (macOS, CPU-only
boxes). They know no model. This folder installs as `fastmae.kernels`: a top-level `kernels` would collide with the PyPI
package of that name.
"""

from importlib import import_module

from .hashing import hash32, mask_key, row_uniform_bits, uniform_bits
from .reference import (
    MaskSelection,
    add_layer_norm_reference,
    apply_rotary_reference,
    bias_gelu_reference,
    embed_rows_reference,
    geglu_reference,
    insert_rows_reference,
    layer_norm_reference,
    linear_cross_entropy_reference,
    local_attention_reference,
    project_qkv_reference,
    rank_within_sequences,
    rotary_qk_reference,
    select_masked_reference,
    table_gradient_reference,
)
from .residual import ResidualGrad

TRITON_OPS = {"select_masked": "mask_select", "embed_rows": "rows", "insert_rows": "rows",
              "linear_cross_entropy": "cross_entropy", "rotary_qk": "rotary",
              "add_layer_norm": "norm", "layer_norm": "norm", "geglu": "activation",
              "bias_gelu": "activation", "project": "projection", "project_qkv": "projection",
              "local_attention": "local_window", "table_gradient": "table_grad"}  # op -> module, imported on first use


def __getattr__(name: str):
    """The Triton ops, imported when first asked for (PEP 562)."""
    if name not in TRITON_OPS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        module = import_module(f".{TRITON_OPS[name]}", __name__)
    except ImportError as err:
        raise ImportError(f"fastmae.kernels.{name} needs Triton ({err}); install it (Linux) or use "
                          f"{name}_reference, which fastmae's CPU path does") from err
    op = getattr(module, name)
    globals()[name] = op  # later lookups find it directly
    return op


__all__ = [
    "MaskSelection",
    "ResidualGrad",
    "add_layer_norm",
    "add_layer_norm_reference",
    "apply_rotary_reference",
    "bias_gelu",
    "bias_gelu_reference",
    "embed_rows",
    "embed_rows_reference",
    "geglu",
    "geglu_reference",
    "hash32",
    "insert_rows",
    "insert_rows_reference",
    "layer_norm",
    "layer_norm_reference",
    "linear_cross_entropy",
    "linear_cross_entropy_reference",
    "local_attention",
    "local_attention_reference",
    "mask_key",
    "project",
    "project_qkv",
    "project_qkv_reference",
    "rank_within_sequences",
    "rotary_qk",
    "rotary_qk_reference",
    "row_uniform_bits",
    "select_masked",
    "select_masked_reference",
    "table_gradient",
    "table_gradient_reference",
    "uniform_bits",
]
