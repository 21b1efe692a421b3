"""The special tokens a tokenizer defines and a model is trained with: their ids travel with the dataset (meta.json),
the model config (so checkpoints and exports) and the tokenizer; nothing else assumes them (ARCHITECTURE.md
section 6)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True)
class SpecialTokens:
    """The ids of the five special tokens fastmae needs, by role: `bos` starts a sequence (RoBERTa's `<s>`, BERT's
    `[CLS]`), `eos` ends it and separates documents and a pair's halves (`</s>`, `[SEP]`). The defaults are those of
    the sentencepiece tokenizers fastmae trains."""

    pad: int = 0
    bos: int = 1
    eos: int = 2
    unk: int = 3
    mask: int = 4

    @property
    def unmaskable(self) -> tuple[int, ...]:
        """Ids never selected for prediction. `unk` is an ordinary (maskable) token, as in RoBERTa."""
        return (self.pad, self.bos, self.eos, self.mask)

    def ordinary_ids(self, vocab_size: int):
        """[vocab_size - 5] int32 tensor: the ids a random replacement draws from (every id but the five specials)."""
        import torch

        keep = torch.ones(vocab_size, dtype=torch.bool)
        keep[list(asdict(self).values())] = False
        return keep.nonzero()[:, 0].to(torch.int32)

    def as_dict(self) -> dict[str, int]:
        """{role: id}, as meta.json holds them."""
        return asdict(self)

    def as_fields(self) -> dict[str, int]:
        """{ModelConfig field: id}: `pad_token_id` ... `mask_token_id`."""
        return {f"{role}_token_id": token_id for role, token_id in asdict(self).items()}


ROLES = tuple(role.name for role in fields(SpecialTokens))
"""The five roles, in SpecialTokens' order."""
