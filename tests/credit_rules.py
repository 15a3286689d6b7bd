"""A user-defined credit rule, loaded by name in test_adapter (as `rollout.credit = "tests.credit_rules:halves"`)."""


def halves(episode_reward, calls):
    return [episode_reward / 2] * len(calls)
