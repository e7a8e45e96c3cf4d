#!/usr/bin/env python3
"""Writes the hand-made tokenizer.json files of the tokenizer tests (run once; the outputs
are checked in): a byte-level BPE (GPT-2 split, a template that adds BOS, added tokens with
lstrip/rstrip/normalized), a Llama-2-style SentencePiece BPE (Prepend/Replace normalizers,
byte fallback) and a Mistral-style one (Metaspace pre-tokenizer and decoder)."""
import json


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def byte_level():
    table = bytes_to_unicode()
    vocab = {}
    for b in range(256):
        vocab[table[b]] = len(vocab)
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"),
              ("Ġ", "Ġ"), ("ĠĠ", "ĠĠ"), ("1", "2"), ("o", "n"), ("Ġ", "w"), ("o", "r"),
              ("Ġw", "or"), ("l", "d"), ("Ġwor", "ld"), ("Ã", "©"), ("c", "af"), ("a", "f"),
              ("in", "g"), ("Ċ", "Ċ"), ("ĉ", "ĉ"), ("æ", "Ĺ"), ("'", "s")]
    out = []
    for a, b in merges:
        if a + b not in vocab:
            vocab[a + b] = len(vocab)
        out.append(f"{a} {b}")
    added = [
        {"id": len(vocab), "content": "<|bos|>", "special": True, "normalized": False},
        {"id": len(vocab) + 1, "content": "<|end|>", "special": True, "normalized": False},
        {"id": len(vocab) + 2, "content": "[tool]", "special": False, "normalized": True,
         "lstrip": True, "rstrip": True},
    ]
    for a in added:
        a.setdefault("lstrip", False)
        a.setdefault("rstrip", False)
        a["single_word"] = False
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                          "use_regex": True},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<|bos|>", "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<|bos|>": {"id": "<|bos|>", "ids": [len(vocab)], "tokens": ["<|bos|>"]}},
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": out},
    }


LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def llama3_style():
    """Byte-level BPE as Llama-3 files have it: the Llama-3 split, ignore_merges (a word in
    the vocabulary is one token whatever the merges say), a template that adds BOS."""
    doc = byte_level()
    vocab = doc["model"]["vocab"]
    for word in ("Ġxyz", "123", "Ġquick"):
        vocab[word] = len(vocab)
    for a in doc["added_tokens"]:
        a["id"] += 3
    doc["post_processor"]["special_tokens"]["<|bos|>"]["ids"] = [doc["added_tokens"][0]["id"]]
    doc["model"]["ignore_merges"] = True
    doc["normalizer"] = None
    doc["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": LLAMA3_SPLIT}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
    doc["post_processor"] = {"type": "Sequence", "processors": [
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        doc["post_processor"]]}
    return doc


def sentencepiece(metaspace):
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for c in "▁abcdefghijklmnopqrstuvwxyzHWé,.!日本":
        vocab[c] = len(vocab)
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "a"), ("e", "r"), ("l", "l"),
              ("H", "e"), ("He", "ll"), ("Hell", "o"), ("▁", "W"), ("o", "r"), ("▁W", "or"),
              ("l", "d"), ("▁Wor", "ld"), ("▁", "▁"), ("▁", "H"), ("▁H", "ell"), ("e", "ll"),
              ("▁Hell", "o"), ("日", "本")]
    out = []
    for a, b in merges:
        if a + b not in vocab:
            vocab[a + b] = len(vocab)
        out.append([a, b])
    added = [{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for c, i in (("<unk>", 0), ("<s>", 1), ("</s>", 2))]
    doc = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}},
        },
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>",
                  "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": True,
                  "byte_fallback": True, "ignore_merges": False, "vocab": vocab, "merges": out},
    }
    if metaspace:
        doc["normalizer"] = None
        doc["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first",
                                "split": False}
        doc["decoder"] = {"type": "Sequence", "decoders": [
            {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False},
            {"type": "ByteFallback"}, {"type": "Fuse"}]}
    else:
        doc["normalizer"] = {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}
        doc["pre_tokenizer"] = None
        doc["decoder"] = {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    return doc


for name, doc in (("tiny_bytelevel.json", byte_level()),
                  ("tiny_llama3.json", llama3_style()),
                  ("tiny_sentencepiece.json", sentencepiece(False)),
                  ("tiny_metaspace.json", sentencepiece(True))):
    with open(name, "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, indent=1)
        f.write("\n")
