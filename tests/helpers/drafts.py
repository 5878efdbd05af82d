"""Recording what an MTP engine drafts (tests of MTP speculation on parallel layouts and in P/D)."""

from __future__ import annotations


def record_drafts(engine, drafter=None, into: dict | None = None) -> dict[str, list]:
    """Set `engine.drafter_override` so that after every step each request's next drafts are
    recorded as `(output tokens so far, drafts)`: the MTP layer's own, or with `drafter(request, n)`
    the ones it returns (which are then verified instead). → the dict filled (`into`, or a new one),
    request id → list. Clear it with `engine.drafter_override = None`."""
    drafts = {} if into is None else into

    def record(req, n):
        d = list(req.spec_token_ids) if drafter is None else drafter(req, n)
        drafts.setdefault(req.request_id, []).append((req.num_output_tokens, tuple(d)))
        return d

    engine.drafter_override = record
    return drafts
