"""The special-token ids, fixed for every tokenizer and model fastmae makes."""

# Fixed special-token ids, shared by the tokenizer (data pipeline) and the model.
PAD_ID, BOS_ID, EOS_ID, UNK_ID, MASK_ID = 0, 1, 2, 3, 4
NUM_SPECIAL_TOKENS = 5
# Tokens that are never selected for prediction. `<unk>` is an ordinary (maskable) token, as in RoBERTa.
UNMASKABLE_IDS = (PAD_ID, BOS_ID, EOS_ID, MASK_ID)
