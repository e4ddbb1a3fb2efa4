"""Embedded tiny demo: a small Qwen3-style model, a tokenizer built in-process, and a small chat dataset.

Everything here is built without the Hugging Face Hub and is seeded, so the shipped assets (``tiny-qwen3/`` and
``chat.jsonl`` next to this file) are regenerated with ``python -m hsx.demo``: the tokenizer and the chats byte for
byte; the model's weights are trained on chats from the same generator (``hsx.demo.train``, a few minutes on a
CPU), so its predictions are peaked where the text is predictable. Tests and the quick-start use them to run the
whole pipeline on a CPU in seconds; tests build their own random-weight models with ``build_model``.
"""

from __future__ import annotations

import math
import random
import re
from typing import Any

import torch
import transformers

__all__ = [
    "CHAT_TEMPLATE",
    "CHAT_TEMPLATE_NO_GENERATION",
    "SPECIAL_TOKENS",
    "build_tokenizer",
    "build_model_config",
    "build_model",
    "chat_rows",
]

SPECIAL_TOKENS: list[str] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML as Qwen uses it. "@GEN@"/"@ENDGEN@" mark the assistant span; they become
# {% generation %} blocks (for return_assistant_tokens_mask) or nothing, so both templates
# render byte-identical text. The "\n" after <|im_end|> stays outside the block so the mask
# covers exactly the content plus <|im_end|>.
_TEMPLATE_SRC = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "@GEN@{{- message['content'] + '<|im_end|>' -}}@ENDGEN@"
    "{{- '\\n' -}}"
    "{%- elif message['role'] in ['system', 'user'] -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- raise_exception('Unsupported role: ' + message['role']) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

CHAT_TEMPLATE: str = _TEMPLATE_SRC.replace("@GEN@", "{%- generation -%}").replace(
    "@ENDGEN@", "{%- endgeneration -%}"
)
CHAT_TEMPLATE_NO_GENERATION: str = _TEMPLATE_SRC.replace("@GEN@", "").replace("@ENDGEN@", "")

_CORPUS: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog near the quiet river bank.",
    "A small model can still learn the shape of a language when the data is clean.",
    "Hidden states are the vectors a transformer computes for every token at every layer.",
    "We read the data, split it into batches, run the model, and write the results to disk.",
    "The weather today is sunny with a light breeze from the west and a few white clouds.",
    "Please explain how the attention mechanism decides which words matter most.",
    "She opened the window, looked at the garden, and decided to plant more tomatoes this year.",
    "Good software is simple to read, easy to test, and honest about what it does.",
    "The train leaves the station at nine in the morning and arrives before noon.",
    "Can you help me write a short summary of this article about ocean currents?",
    "Sure, here is a short summary: the article describes how warm water moves north.",
    "Numbers like one, two, three, four, five, six, seven, eight, nine and ten are common.",
    "The library is open every day except Sunday, and students can borrow up to ten books.",
    "I think the answer depends on the size of the input and the memory of the machine.",
    "Thank you for the question. Let me think about it step by step before I answer.",
    "First, we load the tokenizer. Second, we load the model. Third, we process the text.",
    "Mountains, rivers, forests and deserts cover the surface of the planet in many colors.",
    "The cat slept on the warm chair while the rain fell softly against the glass.",
    "Every layer of the network adds a little more context to the meaning of each word.",
    "You are a helpful assistant. Answer clearly, briefly, and with kindness.",
    "What time is it in London when it is noon in New York during the summer?",
    "The recipe calls for two cups of flour, one egg, a pinch of salt and some milk.",
    "Learning a new skill takes patience, practice, and a willingness to make mistakes.",
    "The report shows that sales grew in the spring and fell again in the autumn.",
    "He asked whether the results were stable when the experiment was repeated twice.",
    "Yes, the results were the same, because the random seed was fixed in the code.",
    "Data flows from the reader to the model and from the model to the writer.",
    "A good question is often more useful than a quick answer.",
    "The children played in the park until the sun went down behind the hills.",
    "Write a poem about the sea, the sky, and the long road home.",
)

# Word pool for the synthetic chats: the corpus vocabulary, sorted so it is stable.
_WORDS: tuple[str, ...] = tuple(sorted({w for line in _CORPUS for w in re.findall(r"[a-z]+", line.lower())}))

_SYSTEM_PROMPTS: tuple[str, ...] = (
    "You are a helpful assistant.",
    "You are a helpful assistant. Answer clearly, briefly, and with kindness.",
    "You are a careful teacher who explains things step by step.",
    "You answer every question with a short list of facts.",
)


def build_tokenizer(
    chat_template: str | None = CHAT_TEMPLATE, vocab_size: int = 512
) -> transformers.PreTrainedTokenizerFast:
    """Train a small byte-level BPE on the in-code corpus and wrap it as a HF fast tokenizer.

    Special tokens: ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos).
    Pass ``chat_template=None`` for a tokenizer without a chat template.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(_CORPUS), trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=chat_template,
        model_max_length=4096,
    )


def build_model_config(
    vocab_size: int, num_layers: int = 8, hidden_size: int = 64, **overrides: Any
) -> transformers.Qwen3Config:
    """A tiny Qwen3 config: 4 attention heads, 2 KV heads, head_dim 16, tied embeddings."""
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
    )
    kwargs.update(overrides)
    return transformers.Qwen3Config(**kwargs)


def build_model(
    tokenizer: transformers.PreTrainedTokenizerBase,
    num_layers: int = 8,
    hidden_size: int = 64,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> transformers.PreTrainedModel:
    """A random-weight ``Qwen3ForCausalLM`` sized for ``tokenizer``, seeded, in eval mode."""
    cfg = build_model_config(
        len(tokenizer),
        num_layers=num_layers,
        hidden_size=hidden_size,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


def _text(rng: random.Random, n_words: int, end: str = ".") -> str:
    """``n_words`` pool words as sentences of 4–14 words."""
    sentences: list[str] = []
    left = max(1, n_words)
    while left > 0:
        k = min(left, rng.randint(4, 14))
        words = [rng.choice(_WORDS) for _ in range(k)]
        sentences.append(" ".join(words).capitalize() + end)
        left -= k
    return " ".join(sentences)


def _split(rng: random.Random, budget: int, weights: list[float]) -> list[int]:
    """Split ``budget`` words over messages in proportion to jittered ``weights``, at least 1 each."""
    jittered = [w * rng.uniform(0.5, 1.5) for w in weights]
    total = sum(jittered)
    return [max(1, round(budget * w / total)) for w in jittered]


def chat_rows(n: int = 96, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` deterministic synthetic conversations in ``messages`` format, then 3 bad rows.

    Good rows: optional system prompt, 1–4 user/assistant pairs, about 20–600 tokens with the demo
    tokenizer. The last 3 rows are deliberately invalid (no messages; no assistant turn; assistant
    content ``None``) so that skip counting can be demonstrated.
    """
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    for _ in range(n):
        messages: list[dict[str, Any]] = []
        if rng.random() < 0.4:
            messages.append({"role": "system", "content": rng.choice(_SYSTEM_PROMPTS)})
        # Log-uniform word budget (~2.8 tokens a word): many short rows and a long tail, so the data
        # exercises length bucketing.
        budget = round(math.exp(rng.uniform(math.log(2), math.log(200))))
        pairs = min(rng.choice((1, 1, 1, 2, 2, 3, 4)), max(1, budget // 8))
        sizes = _split(rng, budget, [1.0, 2.5] * pairs)
        for user_words, assistant_words in zip(sizes[::2], sizes[1::2]):
            messages.append({"role": "user", "content": _text(rng, user_words, end="?")})
            messages.append({"role": "assistant", "content": _text(rng, assistant_words)})
        rows.append({"messages": messages})
    rows.append({"messages": []})
    rows.append({"messages": [{"role": "user", "content": "Is anyone there?"}]})
    rows.append(
        {
            "messages": [
                {"role": "user", "content": "Say nothing."},
                {"role": "assistant", "content": None},
            ]
        }
    )
    return rows
