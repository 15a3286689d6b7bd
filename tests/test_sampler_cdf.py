"""The CPU server draws each token from the distribution it reports, over a 152k-token vocabulary too (issue 24,
item 9): its inverse-CDF draw runs in float64."""

import torch

from lightning_sdk.engine.sampling import inverse_cdf


def test_draws_follow_the_reported_probabilities_over_a_large_vocabulary():
    vocab = 152_064  # Qwen2.5's
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(1, vocab) * 0.5, -1)  # a flat-ish row, as at a high temperature
    u = torch.rand(4000)
    cdf = probs.double().cumsum(-1)  # the exact CDF of the probabilities reported
    exact = torch.searchsorted(cdf.expand(len(u), vocab).contiguous(), (u.double() * cdf[0, -1]).unsqueeze(1),
                               right=True)
    picked = inverse_cdf(probs.expand(len(u), vocab), u)
    assert torch.equal(picked, exact)  # a float32 running sum lands some draws on a neighbouring token
