"""A user-defined credit rule, loaded by name in test_adapter (as `rollout.credit = "tests.credit_rules:halves"`)."""


def halves(calls):
    return [0.5] * len(calls)


def negative(calls):
    return [-1.0] * len(calls)
