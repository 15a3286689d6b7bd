"""The trainer's attention (train/attention.py) against the dense mask it replaces: rows sharing a prompt as
branches, rows of one branch, right padding, grouped-query heads, both ways of the lower-right causal pattern (the
strided mask a CPU takes, PyTorch's causal bias a GPU takes), outputs and gradients."""

import torch
import torch.nn.functional as F

from lightning_sdk.train import attention


def dense(branch: torch.Tensor) -> torch.Tensor:
    """[B, 1, L, L] bool from [B, L] branch numbers (-1: the prompt, -2: padding): causal, a branch sees the prompt
    and itself."""
    L = branch.shape[1]
    q, k = branch.unsqueeze(2), branch.unsqueeze(1)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    return (causal & ((k == -1) | (k == q))).unsqueeze(1)


def test_shared_prompts_attend_as_the_dense_mask_says_with_the_same_gradients():
    g = torch.Generator().manual_seed(0)
    # row 0: prompt 5, branches of 3, 6 and 1 tokens; row 1: one branch (a row read alone), padded; row 2: prompt 2
    # and two branches, padded
    rows = attention.layout([5, 4, 2], [[(5, 8), (8, 14), (14, 15)], [(4, 9)], [(2, 6), (6, 7)]])
    branch = torch.full((3, 15), -2)
    for r, row in enumerate(rows.rows):
        branch[r, :row.prompt] = -1
        for k, (s, e) in enumerate(row.branches):
            branch[r, s:e] = k if len(row.branches) > 1 else -1
    q = torch.randn(3, 6, 15, 16, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(3, 2, 15, 16, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(3, 2, 15, 16, generator=g, dtype=torch.float64, requires_grad=True)
    module = torch.nn.Module()
    real = branch > -2
    assert torch.equal(rows.dense(15)[:, 0][real], dense(branch)[:, 0][real])  # the mask short rows take instead
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=dense(branch), enable_gqa=True).transpose(1, 2)
    got, _ = attention.attend(module, q, k, v, None, **{attention.LAYOUT: rows})
    assert (got - want)[real].abs().max() < 1e-12
    w = torch.randn(want.shape, generator=g, dtype=torch.float64) * real[..., None, None]
    want_grads = torch.autograd.grad((want * w).sum(), (q, k, v))
    got_grads = torch.autograd.grad((got * w).sum(), (q, k, v))
    assert max((a - b).abs().max().item() for a, b in zip(got_grads, want_grads)) < 1e-12
    assert min(x.abs().max().item() for x in want_grads) > 1e-3


def test_both_ways_of_the_lower_right_pattern_agree_with_its_dense_mask():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 5, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 12, 8, generator=g, dtype=torch.float64) for _ in range(2))
    mask = torch.tensor([[j <= 7 + i for j in range(12)] for i in range(5)])
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    for bias in (False, True):
        got = attention.lower_right(q, k, v, 0.0, None, True, bias=bias)
        assert (got - want).abs().max() < 1e-12, bias


def test_without_a_layout_attention_is_causal_and_right_padding_changes_no_real_token():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 9, 8, generator=g) for _ in range(3))
    alone, _ = attention.attend(torch.nn.Module(), q[:, :, :6], k[:, :, :6], v[:, :, :6], None)
    padded, _ = attention.attend(torch.nn.Module(), q, k, v, None)
    assert (padded[:, :6] - alone).abs().max() < 1e-6


def test_short_rows_take_the_dense_mask_and_long_ones_the_shared_attention():
    from lightning_sdk.train import microbatch
    from lightning_sdk.train.packing import pack, share
    from lightning_sdk.transitions import Transition

    ts = [Transition(f"r{i}", "g", f"s{i}", 0, None, (1, 2, 3, 4, 5), (6 + i, 7), (-1.0, -1.0), float(i))
          for i in range(3)]
    rows = share(pack(ts, [True] * 3), ts, 8)
    assert len(rows) == 1 and len(rows[0].branches) == 3
    adv, w = torch.ones(3), torch.full((3,), 1 / 6)
    short = microbatch.collate(rows, ts, adv, w, "cpu")
    assert short.layout is None and short.attention_mask.shape == (1, 1, 11, 11)
    assert torch.equal(short.attention_mask, attention.layout([5], [[(5, 7), (7, 9), (9, 11)]]).dense(11))
    long = microbatch.collate(rows, ts, adv, w, "cpu", dense_up_to=11 * 11 - 1)
    assert long.layout == attention.layout([5], [[(5, 7), (7, 9), (9, 11)]]) and long.attention_mask.dim() == 2
