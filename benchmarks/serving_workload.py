"""The serving benchmark's workloads: chat, random-token, multiturn and shared-prefix prompts, from fixed
local word lists (no download), seeded."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

_TOPICS = [
    "volcanoes", "the Roman Empire", "machine learning", "coffee brewing", "black holes", "honeybees",
    "the French Revolution", "sourdough bread", "jazz music", "electric cars", "ocean tides", "chess openings",
    "photosynthesis", "the stock market", "mountain hiking", "ancient Egypt", "quantum computing", "origami",
    "the water cycle", "medieval castles", "solar panels", "the human heart", "rainforests", "the printing press",
]  # fmt: skip
_INSTRUCTIONS = [
    "Explain {t} to a curious twelve-year-old.", "Write a short poem about {t}.",
    "List five surprising facts about {t}.", "Summarize the history of {t} in one paragraph.",
    "What are the main advantages and drawbacks of {t}?", "Give me a step-by-step guide to learning about {t}.",
    "Describe {t} as if you were a museum tour guide.", "Compare {t} with {u} in a few sentences.",
    "Write a short story in which {t} plays a central role.", "What are common misconceptions about {t}?",
]  # fmt: skip
_CONTEXT = [
    "I am preparing a talk for my local library.", "Please keep the tone friendly and simple.",
    "My background is in accounting, not science.", "I only have a few minutes to read the answer.",
    "This is for a school newsletter.", "Avoid jargon where you can, and define any term you must use.",
    "I already know the basics, so focus on details that are less well known.",
    "Use concrete examples that a general audience would recognise.",
    "My friend claims the topic is boring, and I want to prove them wrong.",
    "Structure the answer so it is easy to skim.",
]  # fmt: skip


@dataclass(frozen=True)
class Prompt:
    text: str  # the user turn (chat) or the whole prompt (completions, native)
    system: str | None
    output_len: int
    history: tuple[tuple[str, str], ...] = ()  # earlier (user, assistant) turns of a conversation


def flat_text(p: Prompt) -> str:
    """The prompt as one string (completions, native): a conversation's turn k extends turn k-1's text."""
    parts = [p.system] if p.system else []
    for user, answer in p.history:
        parts += [user, answer]
    return "\n\n".join(parts + [p.text])


def chat_prompts(n: int, output_len: int, seed: int) -> list[Prompt]:
    """Chat-like prompts from a fixed local list: instruction x topic, plus 0-6 context sentences."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        t, u = rng.sample(_TOPICS, 2)
        parts = rng.sample(_CONTEXT, rng.randint(0, 6)) + [rng.choice(_INSTRUCTIONS).format(t=t, u=u)]
        system = "You are a helpful assistant." if rng.random() < 0.3 else None
        out.append(Prompt(" ".join(parts), system, output_len))
    return out


def _vocab(tokenizer) -> list[int]:
    special = set(tokenizer.all_special_ids)
    return [i for i in range(len(tokenizer)) if i not in special]


def random_prompts(
    n: int, input_len: int, output_len: int, ratio: float, seed: int, tokenizer
) -> list[Prompt]:
    """SGLang's `random`: lengths uniform in [len * ratio, len], text decoded from random token ids."""
    rng = random.Random(seed)
    vocab = _vocab(tokenizer)
    out = []
    for _ in range(n):
        n_in = rng.randint(max(1, int(input_len * ratio)), input_len)
        n_out = rng.randint(max(1, int(output_len * ratio)), output_len)
        ids = [rng.choice(vocab) for _ in range(n_in)]
        out.append(Prompt(tokenizer.decode(ids), None, n_out))
    return out


def prompts_of_lengths(lengths: list[tuple[int, int]], seed: int, tokenizer) -> list[Prompt]:
    """One prompt per (input tokens, output tokens), e.g. a trace's: text decoded from random token ids."""
    rng = random.Random(seed)
    vocab = _vocab(tokenizer)
    return [
        Prompt(tokenizer.decode([rng.choice(vocab) for _ in range(n_in)]), None, n_out)
        for n_in, n_out in lengths
    ]


_QUESTIONS = [
    "Summarize the document above in three sentences.", "Which part of it surprised you most, and why?",
    "Now rewrite your last answer for a ten-year-old.", "List the three most important points so far.",
    "What would a critic say about the document?", "Suggest a good title for it.",
    "Which claim in it would you check first, and how?", "Give one follow-up question worth researching.",
]  # fmt: skip


def _document(rng: random.Random, approx_tokens: int) -> str:
    """Sentences from the local lists until about `approx_tokens` (~4 characters a token in English)."""
    sentences: list[str] = []
    while sum(len(x) + 1 for x in sentences) < 4 * approx_tokens:
        t, u = rng.sample(_TOPICS, 2)
        sentences.append(rng.choice(_CONTEXT + _INSTRUCTIONS).format(t=t, u=u))
    return " ".join(sentences)


@dataclass(frozen=True)
class Conversation:
    turns: list[str]  # the user messages, in order; each turn's prompt holds all earlier turns
    output_len: int


def multiturn_conversations(
    n: int, turns: int, doc_len: int, output_len: int, seed: int
) -> list[Conversation]:
    """`n` conversations of `turns` turns; the first message is a ~`doc_len`-token document and a question."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        first = f"Read this document.\n\n{_document(rng, doc_len)}\n\n{rng.choice(_QUESTIONS)}"
        out.append(Conversation([first] + [rng.choice(_QUESTIONS) for _ in range(turns - 1)], output_len))
    return out


def shared_prefix_prompts(n: int, prefix_len: int, output_len: int, seed: int) -> list[Prompt]:
    """Chat prompts that all carry one ~`prefix_len`-token system prompt (a long instruction sheet)."""
    system = "You are a helpful assistant. Background notes:\n" + _document(random.Random(seed), prefix_len)
    return [replace(p, system=system) for p in chat_prompts(n, output_len, seed + 1)]


def load_tokenizer(path: str | None):
    from transformers import AutoTokenizer

    from pdserve.model_source import resolve_model_source
    from pdserve.runtime.loader import model_folder

    # A tokenizer folder, or a model path as the servers take it (a .gguf; None: the bundled model).
    if path is None or path.endswith(".gguf"):
        path = model_folder(resolve_model_source(path))
    return AutoTokenizer.from_pretrained(path)
