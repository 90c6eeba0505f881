"""A small public-domain text (the opening of Lewis Carroll's *Alice's Adventures in Wonderland*,
1865) and a byte-level BPE tokenizer trained on it offline, with a chat template: what the data
source tests tokenize."""

from __future__ import annotations

import json
from pathlib import Path

ALICE = [
    "Alice was beginning to get very tired of sitting by her sister on the bank, and of having "
    "nothing to do: once or twice she had peeped into the book her sister was reading, but it had "
    "no pictures or conversations in it, \u201cand what is the use of a book,\u201d thought Alice "
    "\u201cwithout pictures or conversations?\u201d",
    "So she was considering in her own mind (as well as she could, for the hot day made her feel "
    "very sleepy and stupid), whether the pleasure of making a daisy-chain would be worth the "
    "trouble of getting up and picking the daisies, when suddenly a White Rabbit with pink eyes "
    "ran close by her.",
    "There was nothing so very remarkable in that; nor did Alice think it so very much out of the "
    "way to hear the Rabbit say to itself, \u201cOh dear! Oh dear! I shall be late!\u201d",
    "In another moment down went Alice after it, never once considering how in the world she was "
    "to get out again.",
    "The rabbit-hole went straight on like a tunnel for some way, and then dipped suddenly down, so "
    "suddenly that Alice had not a moment to think about stopping herself before she found herself "
    "falling down a very deep well.",
    "Either the well was very deep, or she fell very slowly, for she had plenty of time as she went "
    "down to look about her and to wonder what was going to happen next.",
    "Down, down, down. Would the fall never come to an end?",
]

# The chat markers are the tokenizer's special tokens, so a message's content tokenizes alone.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n"
    "{% endfor %}"
)

SPECIALS = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]


def build_tokenizer(directory: Path, template: str | None = CHAT_TEMPLATE) -> Path:
    """A byte-level BPE (decodes back to the exact text) trained on ALICE, end-of-text
    ``<|endoftext|>``, and the chat template in tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(ALICE, trainer)
    directory.mkdir(parents=True)
    tok.save(str(directory / "tokenizer.json"))
    config: dict[str, object] = {"eos_token": "<|endoftext|>"}
    if template is not None:
        config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory



def decode(tok_dir: Path, ids: object) -> str:
    from tokenizers import Tokenizer

    return str(Tokenizer.from_file(str(tok_dir / "tokenizer.json")).decode(list(map(int, ids)),  # type: ignore[call-overload]
                                                                          skip_special_tokens=False))
