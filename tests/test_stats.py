"""The stats line: only tokens after each request's first count as decode tokens."""

from tp_jax.serving.outputs import StreamEvent
from tp_jax.serving.stats import GenerationStats, timed


def events(order):
    return [StreamEvent(i, 7, "", False) for i in order]


def test_each_requests_first_token_is_not_a_decode_token():
    stats = GenerationStats()
    order = [0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 2]             # 3 prompts, 4 + 3 + 4 tokens, interleaved
    assert [ev.index for ev in timed(events(order), stats)] == order          # passed through unchanged
    assert stats.decode_tokens == 11 - 3
    assert "(8 tokens)" in stats.line()


def test_a_late_request_and_a_single_token_request():
    stats = GenerationStats()
    list(timed(events([0, 0, 0, 1]), stats))              # request 1's first token arrives last
    assert stats.decode_tokens == 2
    stats = GenerationStats()
    list(timed(events([0]), stats))
    assert stats.decode_tokens == 0 and stats.decode_tokens_per_s == 0.0
