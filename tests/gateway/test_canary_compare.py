"""How a canary's answer is compared with its pair's reference (gateway/autopilot/canary.py `differs`)."""

from __future__ import annotations

from pdserve.gateway.autopilot.canary import Answer, differs

REF = Answer(
    ids=[5, 9, 2],
    logprobs=[-0.1, -0.2, -1.0],
    top=[[(5, -0.1), (7, -3.0)], [(9, -0.2), (4, -0.5)], [(2, -1.0), (3, -1.1)]],
)


def test_the_same_answer_agrees_within_the_logprob_tolerance():
    assert differs(REF, REF) is None
    assert differs(REF, Answer([5, 9, 2], [-0.3, -0.5, -1.4], REF.top)) is None


def test_another_token_is_a_mismatch_unless_the_reference_was_near_a_tie():
    assert differs(REF, Answer([7, 9, 2], REF.logprobs, REF.top)) == "token 0 is 7, the reference's is 5"
    # position 1: the reference's best two were 0.3 nats apart; what follows is not compared
    assert differs(REF, Answer([5, 4, 8], REF.logprobs, REF.top)) is None
    assert differs(REF, Answer([5, 4, 8], REF.logprobs, REF.top), tolerance=0.2) is not None


def test_a_drifted_logprob_or_a_short_answer_is_a_mismatch():
    why = differs(REF, Answer([5, 9, 2], [-0.1, -1.5, -1.0], REF.top))
    assert why is not None and "token 1's logprob is -1.500" in why
    assert differs(REF, Answer([5, 9], [-0.1, -0.2], REF.top[:2])) == "2 tokens, the reference has 3"
