"""fastmae: masked-LM pretraining where [MASK] tokens never enter the encoder (MAE-LM, 3ML), and RoBERTa's MLM.

The public names are imported on first use, so the command-line entry points parse their arguments and restart
with their malloc settings (fastmae.malloc) before they pay for importing torch.
"""

from importlib import import_module

__version__ = "0.1.0"
__all__ = ["MaskedLM", "MaskedLMOutput", "ModelConfig", "PackedBatch", "__version__"]
_MODULE_OF = {"PackedBatch": ".batch", "ModelConfig": ".config", "MaskedLM": ".model", "MaskedLMOutput": ".model"}


def __getattr__(name: str):
    if name in _MODULE_OF:
        return getattr(import_module(_MODULE_OF[name], __name__), name)
    raise AttributeError(f"module 'fastmae' has no attribute {name!r}")
