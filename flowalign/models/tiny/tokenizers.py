"""Tokenizers of the tiny pipelines: a word-level tokenizer and its chat variants, with small Jinja chat templates.

The tokenizers are ``tokenizers`` WordLevel models wrapped in ``PreTrainedTokenizerFast``, so ``save_pretrained`` /
``from_pretrained`` round-trip them like any other tokenizer. ``chat_word_tokenizer`` adds Qwen's chat special tokens
(``<|im_start|>``, ``<|im_end|>``) and the newline as tokens of their own, so Qwen chat text tokenizes into as many
tokens as Qwen's own tokenizer gives it: Qwen-Image's system prompt, for instance, is 34 tokens up to the user's
text, the ``prompt_template_encode_start_idx`` the pipeline drops. ``MISTRAL_STYLE_CHAT_TEMPLATE`` is FLUX.2-dev's.
"""

from __future__ import annotations

from typing import Iterable

PAD, EOS, UNK = "[PAD]", "[EOS]", "[UNK]"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"


def word_level_tokenizer(words: Iterable[str], max_length: int):
    """A lower-casing, whitespace/punctuation-splitting word tokenizer that appends ``[EOS]`` (id 1); pad id 0."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {PAD: 0, EOS: 1, UNK: 2}
    for word in words:
        vocab.setdefault(word.lower(), len(vocab))
    core = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    core.normalizer = normalizers.Lowercase()
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.post_processor = processors.TemplateProcessing(single=f"$A {EOS}", special_tokens=[(EOS, 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, eos_token=EOS, unk_token=UNK, model_max_length=max_length
    )


# A small Jinja chat template in Qwen's format over plain-string or content-list messages, with the
# ``add_generation_prompt`` and ``enable_thinking`` switches the Qwen3 pipelines pass.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{% endif %}"
)



def chat_word_tokenizer(words: Iterable[str], max_length: int, extra_special: Iterable[str] = ()):
    """``word_level_tokenizer`` plus ``<|im_start|>``, ``<|im_end|>`` (and ``extra_special``) as special tokens and
    ``\\n`` as an added token, and ``CHAT_TEMPLATE`` as its chat template."""
    from tokenizers import AddedToken

    tokenizer = word_level_tokenizer(words, max_length)
    tokenizer.add_tokens([AddedToken("\n", normalized=False, special=False)])
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=True) for t in (IM_START, IM_END, *extra_special)],
                         special_tokens=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer



# A Mistral-style chat template over content lists (``[{"type": "text", "text": ...}]``), as FLUX.2 formats its
# prompts: the system message inside [SYSTEM_PROMPT] ... [/SYSTEM_PROMPT], each user turn inside [INST] ... [/INST].
MISTRAL_STYLE_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- set text = message['content'] if message['content'] is string else "
    "message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join(' ') -%}"
    "{%- if message['role'] == 'system' -%}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
    "{%- elif message['role'] == 'user' -%}[INST]{{ text }}[/INST]"
    "{%- else -%}{{ text }}{%- endif -%}"
    "{%- endfor -%}"
)

MISTRAL_STYLE_SPECIAL_TOKENS = ("[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[INST]", "[/INST]")

