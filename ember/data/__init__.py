"""Input pipeline: document sources, tokenizers, packing and the Grain iterator.

    tok = build_tokenizer(cfg.data)
    it = make_iterator(cfg.data, seq_len=..., global_batch_size=..., seed=..., split="train")
    batch = next(it)         # {inputs, targets, segment_ids, positions}: int32 [B/P, L]
    state = it.get_state()   # JSON-serialisable; it.set_state(state) resumes exactly
"""

from ember.data.pipeline import ShardedIterator, make_dataset, make_iterator
from ember.data.tokenizers import ByteTokenizer, SentencePieceTokenizer, build_tokenizer
from ember.errors import DataError

__all__ = [
    "ByteTokenizer",
    "DataError",
    "SentencePieceTokenizer",
    "ShardedIterator",
    "build_tokenizer",
    "make_dataset",
    "make_iterator",
]
