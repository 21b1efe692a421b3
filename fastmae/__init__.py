"""fastmae: masked-LM pretraining where [MASK] tokens never enter the encoder (MAE-LM, 3ML), and RoBERTa's MLM."""

from .batch import PackedBatch
from .config import ModelConfig
from .model import MaskedLM, MaskedLMOutput

__version__ = "0.1.0"
__all__ = ["MaskedLM", "MaskedLMOutput", "ModelConfig", "PackedBatch", "__version__"]
