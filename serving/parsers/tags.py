"""Holding back tags that a stream chunk may have cut in two.

A streaming parser sees text in arbitrary pieces, so a tag such as `</think>` can arrive as
`</th` + `ink>`. Before emitting plain text, a parser keeps back the longest tail of its buffer
that could still grow into one of the tags it looks for; `partial_tag_len` measures that tail.
"""

from __future__ import annotations

from collections.abc import Iterable


def partial_tag_len(text: str, tags: Iterable[str]) -> int:
    """Length of the longest suffix of `text` that is a proper, non-empty prefix of a tag.

    `partial_tag_len("abc</th", ["</think>"]) == 4`; 0 when no suffix can start a tag. A complete
    tag at the end is not counted (callers search for complete tags first). O(len(tag)^2) per call.
    """
    best = 0
    for tag in tags:
        for k in range(min(len(text), len(tag) - 1), best, -1):
            if tag.startswith(text[-k:]):
                best = k
                break
    return best


def split_held(text: str, tags: Iterable[str]) -> tuple[str, str]:
    """`(ready, held)`: `text` cut before a trailing partial tag (`held` may be "")."""
    k = partial_tag_len(text, tags)
    return (text[: len(text) - k], text[len(text) - k :]) if k else (text, "")
