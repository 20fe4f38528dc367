"""The prompts the stages send: chat message lists built from fixed text, no randomness here.

Callers pass whatever varies (a topic index, a fact, a filler count, a nonce), so every prompt
is reproducible from the values recorded in the report.
"""

from __future__ import annotations

from typing import Any

from flashnext.validate.images import png_data_url

Messages = list[dict[str, Any]]

TOPICS = (
    "the history of the printing press",
    "why rivers meander",
    "how bridges carry load",
    "the role of bees in agriculture",
    "the invention of the telescope",
    "what makes a good public library",
    "how tides work",
    "the economics of railways",
    "why cities grow along coasts",
    "the life cycle of stars",
    "how vaccines train the immune system",
    "the craft of bookbinding",
    "the physics of sailing",
    "how maps shaped exploration",
    "the chemistry of bread",
    "why languages change over time",
)

FILLER = (
    "The archive keeps ledgers of grain, rainfall and river levels for every season. "
    "Clerks copied each page twice, and the copies were stored in separate buildings. "
)


def short_prompt() -> Messages:
    """The short stage's request."""
    return [{"role": "user", "content": "Say hello in one short sentence."}]


def essay_prompt(i: int) -> Messages:
    """The deployment notes' concurrency prompt: a ~300-word essay, the topic varied by ``i``."""
    topic = TOPICS[i % len(TOPICS)]
    return [{"role": "user", "content": f"Write an essay of about 300 words on {topic}."}]


def long_prompt(fact: str, filler_repeats: int) -> Messages:
    """A fact at the start, ``filler_repeats`` copies of :data:`FILLER`, the question at the end."""
    body = f"Remember this fact: the vault code is {fact}.\n" + FILLER * filler_repeats
    return [
        {"role": "user", "content": body + "\nQuestion: what is the vault code? Answer briefly."}
    ]


def shared_prefix(nonce: str, chars: int) -> str:
    """A prefix of exactly ``chars`` filler characters after ``Session <nonce>. ``.

    The nonce makes the first request with it cold even on a long-running server.
    """
    return f"Session {nonce}. " + (FILLER * (chars // len(FILLER) + 1))[:chars]


def prefix_prompt(prefix: str, i: int) -> Messages:
    """Request ``i`` of the prefix-cache stage: the shared prefix, then its own question."""
    return [{"role": "user", "content": prefix + f"\nQuestion {i}: summarise in one line."}]


def image_prompt(png: bytes) -> Messages:
    """A question about ``png`` (PNG bytes), sent as a base64 data URL."""
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What colour is the square in the middle?"},
                {"type": "image_url", "image_url": {"url": png_data_url(png)}},
            ],
        }
    ]
