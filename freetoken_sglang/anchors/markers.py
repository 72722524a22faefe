"""Anchor markers: the chat template's special-token sequences, found in token ids."""

from __future__ import annotations

import logging
from typing import List, Sequence, Tuple

from freetoken_sglang.errors import RefusedError

logger = logging.getLogger(__name__)

# The thinking, tool-call, tool-output and turn markers of Qwen's chat templates (paper §3.1).
DEFAULT_MARKERS = (
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<|im_start|>",
    "<|im_end|>",
)


def parse_markers(text: str) -> Tuple[str, ...]:
    """``--freetoken-anchor-tokens`` text (comma-separated marker strings) as a tuple, each
    marker once, in the order given.

    Raises:
        RefusedError: an empty list (``""``) or an empty marker.
    """
    markers = tuple(dict.fromkeys(m.strip() for m in text.split(",")))
    if not markers or any(not m for m in markers):
        raise RefusedError(
            f"--freetoken-anchor-tokens {text!r}: give comma-separated non-empty markers, "
            "e.g. '<think>,<tool_call>,<|im_start|>'"
        )
    return markers


def marker_ids(tokenizer, markers: Sequence[str]) -> List[Tuple[int, ...]]:
    """Each marker's token ids under ``tokenizer`` (a transformers tokenizer); a marker may
    be several tokens.

    A marker written as a special token (``<...>``) that encodes to several tokens is
    logged as a warning: byte-level tokenizers encode any text, so a misspelt marker would
    otherwise pass unnoticed (it still matches, as that text).

    Raises:
        RefusedError: a marker the tokenizer encodes to no tokens, or to unknown tokens.
    """
    out = []
    unk = getattr(tokenizer, "unk_token_id", None)
    for m in markers:
        ids = tuple(tokenizer.encode(m, add_special_tokens=False))
        if not ids or (unk is not None and unk in ids):
            raise RefusedError(
                f"anchor marker {m!r} is not in the model's tokenizer; pass "
                "--freetoken-anchor-tokens with markers its chat template uses"
            )
        if len(ids) > 1 and m.startswith("<") and m.endswith(">"):
            logger.warning(
                "FreeToken anchors: marker %r is not one token of the model's tokenizer (it "
                "matches as the text of %d tokens); check it against the chat template's "
                "special tokens (--freetoken-anchor-tokens sets the list)", m, len(ids))
        out.append(ids)
    return out


def find_markers(ids: Sequence[int], markers: Sequence[Tuple[int, ...]]) -> List[int]:
    """Sorted start positions of every occurrence of every marker in ``ids``.

    A position ``p`` names the state after ``ids[:p]``: the checkpoint just before a marker.
    """
    firsts = {}
    for m in markers:
        firsts.setdefault(m[0], []).append(m)
    found = set()
    for p, tok in enumerate(ids):
        for m in firsts.get(tok, ()):
            if len(m) == 1 or tuple(ids[p : p + len(m)]) == m:
                found.add(p)
                break
    return sorted(found)
