"""A row's labels from its Rust Encoding (template.encoding_labels: each trained piece's first and last characters'
tokens, widened over overlapping neighbours) equal those from every token's offsets (template.piece_labels), for
tokenizers of the kinds models ship: byte-level BPE, SentencePiece-style BPE with byte fallback (several tokens of
one character) and a post-processor adding BOS and EOS (tokens of no characters), and WordPiece whose normalizer
removes characters (no token for them: the offsets path)."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from megatrain.data.template import encoding_labels, piece_labels

SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>", "[UNK]"]
WORDS = ["the", "quick", "brown", "fox", "jumps", "über", "café", "naïve", "日本語", "テスト", "😀", "👍🏽",
         "a\u0301", "12345", "x=y+1;", "<|im_end|>", "<|im_start|>", "\n", "  ", "\t", "Paris.", "what?", "ﬁne", "Ⅻ"]


def corpus(rng: random.Random, n: int, words=WORDS) -> list[str]:
    return ["".join(rng.choice(words) + rng.choice([" ", "", "\n"]) for _ in range(rng.randint(1, 30)))
            for _ in range(n)]


def byte_bpe(texts):
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tk.token_to_id("<s>"))])
    return tk


def fallback_bpe(texts):
    """Llama-2's kind: Metaspace, unknown characters as their UTF-8 bytes, BOS and EOS added."""
    tk = Tokenizer(models.BPE(byte_fallback=True, unk_token="[UNK]"))
    tk.normalizer = normalizers.NFKC()
    tk.pre_tokenizer = pre_tokenizers.Metaspace()
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    ascii_only = [t for t in texts if t.isascii()]  # every other character falls back to its bytes
    tk.train_from_iterator(ascii_only, trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIALS + bytes_,
                                                           show_progress=False))
    tk.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", tk.token_to_id("<s>")), ("</s>", tk.token_to_id("</s>"))])
    return tk


def wordpiece(texts):
    """BERT's kind: the normalizer strips accents (a combining mark maps to no token)."""
    tk = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tk.normalizer = normalizers.Sequence([normalizers.NFD(), normalizers.Lowercase(), normalizers.StripAccents()])
    tk.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tk.train_from_iterator(texts, trainers.WordPieceTrainer(vocab_size=300, special_tokens=SPECIALS,
                                                            show_progress=False))
    return tk


@pytest.mark.parametrize("build", [byte_bpe, fallback_bpe, wordpiece])
def test_labels_from_the_encoding_equal_those_from_every_offset(build):
    rng = random.Random(0)
    tk = build(corpus(rng, 400) + corpus(rng, 200, [w for w in WORDS if w.isascii()]))
    tk.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    checked = 0
    for text in corpus(rng, 300):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 5)))) if len(text) > 1 else []
        bounds = [0, *cuts, len(text)]
        pieces = [(text[a:b], rng.random() < 0.5) for a, b in zip(bounds, bounds[1:])]
        for special in (False, True):
            enc = tk.encode(text, add_special_tokens=special)
            assert encoding_labels(pieces, enc.ids, enc) == piece_labels(pieces, enc.ids, enc.offsets), \
                (build.__name__, special, pieces, enc.tokens, enc.offsets)
            checked += 1
    assert checked == 600
