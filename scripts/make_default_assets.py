"""Regenerate megatrain/defaults/: a character-level tokenizer with a chat template, a tiny Llama config.json,
and a word-reversal task (train and held-out). Deterministic; run from the repository root."""

import json
import random
import string
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, PreTrainedTokenizerFast

OUT = Path(__file__).resolve().parents[1] / "megatrain" / "defaults"
SPECIALS = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}<|system|>{{ m['content'] }}\n"
    "{% elif m['role'] == 'user' %}<|user|>{{ m['content'] }}\n"
    "{% elif m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}</s>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tokenizer() -> PreTrainedTokenizerFast:
    chars = [c for c in string.printable if c not in "\r\x0b\x0c"]
    vocab = {t: i for i, t in enumerate(SPECIALS + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<pad>", chat_template=CHAT_TEMPLATE)


def task(rng: random.Random, n: int, seen: set) -> list[dict]:
    rows = []
    while len(rows) < n:
        word = "".join(rng.choice("abcdefghij") for _ in range(rng.randint(3, 6)))
        if word in seen:
            continue
        seen.add(word)
        rows.append({"instruction": f"reverse {word}", "output": word[::-1]})
    return rows


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    model_dir = OUT / "tiny-llama"
    tok = tokenizer()
    tok.save_pretrained(model_dir)
    cfg = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      rms_norm_eps=1e-5, initializer_range=0.02, tie_word_embeddings=False,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    cfg.save_pretrained(model_dir)
    rng, seen = random.Random(0), set()
    heldout = task(rng, 100, seen)
    train = task(rng, 4000, seen)
    for name, rows in (("reverse-train.jsonl", train), ("reverse-heldout.jsonl", heldout)):
        (OUT / name).write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
