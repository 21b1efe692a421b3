"""A sentencepiece model fastmae trained, as the fast tokenizer an export carries (`AutoTokenizer` loads it)."""

from __future__ import annotations

from ..data.tokenizer import SentencePieceTokenizer
from ..errors import FastmaeError


def hugging_face_tokenizer(tokenizer: SentencePieceTokenizer, max_seq_len: int):
    """A `PreTrainedTokenizerFast` that splits text exactly as a sentencepiece model fastmae trained does.

    sentencepiece's pipeline, stage by stage: its compiled normaliser (NFKC and whitespace rules), runs of spaces
    collapsed and the ends trimmed, a `▁` before every word, then its unigram or BPE model over each word.
    `<s> A </s>` and `<s> A </s></s> B </s>` frame sequences and pairs, as fastmae's data loader and fine-tuning do.
    """
    from sentencepiece import sentencepiece_model_pb2
    from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers.models import BPE, Unigram
    from transformers import PreTrainedTokenizerFast
    from transformers.tokenization_utils_base import generate_merges

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(tokenizer.model_bytes)
    pieces = [(p.piece, p.score) for p in proto.pieces]
    special = [p.piece for p in proto.pieces if p.type != proto.SentencePiece.NORMAL]
    if proto.trainer_spec.model_type == proto.trainer_spec.UNIGRAM:
        model = Unigram(pieces, unk_id=proto.trainer_spec.unk_id, byte_fallback=False)
    elif proto.trainer_spec.model_type == proto.trainer_spec.BPE:
        vocab = {piece: i for i, (piece, _) in enumerate(pieces)}
        model = BPE(vocab, generate_merges(vocab, pieces, skip_tokens=special),
                    unk_token=proto.trainer_spec.unk_piece, fuse_unk=True, byte_fallback=False)
    else:
        raise FastmaeError(f"{tokenizer.source}: sentencepiece model type {proto.trainer_spec.model_type} is neither "
                           "unigram nor BPE")
    rust = RustTokenizer(model)
    rust.normalizer = normalizers.Sequence([normalizers.Precompiled(proto.normalizer_spec.precompiled_charsmap),
                                            normalizers.Replace(Regex(" {2,}"), " "), normalizers.Strip()])
    rust.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    rust.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    rust.add_special_tokens([AddedToken(piece, special=True, normalized=False) for piece in special])
    name = tokenizer.sp.id_to_piece
    special = tokenizer.special
    bos, eos = name(special.bos), name(special.eos)
    rust.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}", pair=f"{bos} $A {eos} {eos} $B {eos}",
        special_tokens=[(bos, special.bos), (eos, special.eos)])
    return PreTrainedTokenizerFast(
        tokenizer_object=rust, bos_token=bos, eos_token=eos, cls_token=bos, sep_token=eos,
        unk_token=name(tokenizer.sp.unk_id()), pad_token=name(tokenizer.sp.pad_id()), mask_token="<mask>",
        model_max_length=max_seq_len, clean_up_tokenization_spaces=False)
