"""Data for training: the embedded corpus, a byte-level BPE tokenizer, and packing with document boundaries.

    docs = stdlib_documents()                        # or load_documents("my_corpus/", max_chars=8192)
    train_docs, val_docs = split_documents(docs)     # by a stable hash of each document id
    tok = train_tokenizer(train_docs, vocab_size=4096)
    ds = PackedDataset(encode_documents(tok, train_docs), seq_len=1024, eos_id=eos_id(tok))
    for batch in ds.batches(batch_size=8):           # {"input_ids" [1, 8*1024], "cu_seqlens" [S+1]}
        out = model(**batch, labels=batch["input_ids"])
"""

from .corpus import Document, leading_documents, load_documents, split_text, stdlib_documents
from .packing import PackedDataset, pack, pack_stream, split_documents
from .tokenizer import (EOS, decode, encode, encode_documents, eos_id, load_tokenizer, save_tokenizer,
                        train_tokenizer, unigram_entropy)

__all__ = ["Document", "leading_documents", "load_documents", "split_text", "stdlib_documents", "PackedDataset", "pack",
           "pack_stream", "split_documents", "EOS", "decode", "encode", "encode_documents", "eos_id", "load_tokenizer",
           "save_tokenizer", "train_tokenizer", "unigram_entropy"]
