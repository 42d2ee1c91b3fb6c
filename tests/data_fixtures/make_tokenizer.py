"""Builds the tiny tokenizer the data tests use (run once; its output is committed in tokenizer/).

A byte-level BPE (so merges can cross the borders between template text and content, as real tokenizers do)
with BOS added by the post-processor, and a ChatML chat template that writes BOS and a default system prompt.

    python tests/data_fixtures/make_tokenizer.py
"""

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

HERE = Path(__file__).parent
SPECIALS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if not messages or messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CORPUS = """\
The quick brown fox jumps over the lazy dog. What is the capital of France? The capital of France is Paris.
Translate to French: good morning. Bonjour. Write a haiku about the sea. Waves fold into foam.
You are helpful. You are a helpful assistant. Hello! How are you? I am fine, thank you. And you?
system user assistant tool Tell me a joke. Why did the chicken cross the road? To get to the other side.
Add two and three. Two plus three is five. Count to four: one, two, three, four.
Summarise: the cat sat on the mat. A cat sat on a mat. Name a colour. Blue. Name another. Green.
Once upon a time there was a small model that learned to talk. It read many books and answered questions.
"""


def build(out: Path = HERE / "tokenizer") -> None:
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(CORPUS.splitlines() * 4, trainer)
    bos = tk.token_to_id("<s>")
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                  additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out)


if __name__ == "__main__":
    build()
