"""The pure parts of scripts/soak.py: outcome classification of responses (an OpenAI error body is
required of every 4xx; a 4xx is the success of a bad request) and the RSS slope. The soak itself
(a server and client threads for minutes) is a script whose numbers go in docs/reliability.md."""

from __future__ import annotations

import httpx
import pytest

from scripts import soak


def resp(status, body):
    return httpx.Response(status, json=body)


@pytest.mark.parametrize("status, body, expect_error, outcome", [
    (200, {"choices": []}, False, "ok"),
    (400, {"error": {"message": "bad", "type": "BadRequestError", "code": 400}}, True, "expected_4xx"),
    (400, {"error": {"message": "bad", "type": "BadRequestError", "code": 400}}, False, "unexpected_4xx"),
    (400, {"detail": "not openai"}, True, "bad_error_body"),
    (404, {"error": {"message": "m", "type": "NotFoundError", "code": 400}}, True, "bad_error_body"),
    (500, {"error": {"message": "x", "type": "InternalServerError", "code": 500}}, False, "http_5xx"),
    (200, {"choices": []}, True, "unexpected_2xx"),
])
def test_outcome_classification(status, body, expect_error, outcome):
    assert soak._check_status(resp(status, body), expect_error)[0] == outcome


def test_rss_slope_is_mib_per_hour():
    samples = [(t, 1000.0 + 2.0 * t / 60) for t in range(0, 600, 15)]  # +2 MiB per minute
    assert soak.slope_mib_per_hour(samples) == pytest.approx(120.0)
    assert soak.slope_mib_per_hour(samples[:2]) is None
