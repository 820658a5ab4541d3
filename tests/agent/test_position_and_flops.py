"""Cohorts from the parallelism config, and the analytic FLOPs cross-checked against torch."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from trainvitals.agent._position import Position, flops_per_token, position_of
from trainvitals.examples.train_gpt import GPT, model_dims, parse_args


@pytest.mark.parametrize(
    ("rank", "expected"),
    [
        (0, Position(pp_stage=0, tp_rank=0, dp_rank=0)),
        (5, Position(pp_stage=0, tp_rank=1, dp_rank=2)),
        (8, Position(pp_stage=1, tp_rank=0, dp_rank=0)),
        (15, Position(pp_stage=1, tp_rank=1, dp_rank=3)),
    ],
)
def test_megatron_rank_order(rank: int, expected: Position) -> None:
    # 16 ranks: tp=2 (fastest), dp=4, pp=2 (slowest).
    assert position_of(rank, {"world_size": 16, "tp": 2, "pp": 2}) == expected


def test_inconsistent_layout_gives_no_cohort() -> None:
    assert position_of(3, {"world_size": 6, "tp": 4}) == Position()


def test_analytic_flops_match_flop_counter_within_convention() -> None:
    """6N + 12LHQT per token, checked term by term with FlopCounterMode on the example GPT
    (forward + backward). On CPU the counter does not count the fused SDPA kernel, so the
    attention term is checked on an explicit-matmul attention of the same shape."""
    args = parse_args(["--d", "128", "--layers", "4", "--seq", "64", "--vocab", "512", "--heads", "4"])
    model = GPT(vocab=args.vocab, d=args.d, layers=args.layers, heads=args.heads, seq=args.seq)
    dims = model_dims(args, model)
    tokens = torch.randint(0, args.vocab, (2, args.seq))
    with FlopCounterMode(display=False) as counter:
        model(tokens).sum().backward()
    n_tokens = tokens.numel()
    six_n = 6 * dims["non_embedding_params"] * n_tokens
    # Biases and norms are in N but do no matmul: within 1%.
    assert counter.get_total_flops() == pytest.approx(six_n, rel=0.01)

    b, h, t, dh = 2, args.heads, args.seq, args.d // args.heads
    q, k, v = (torch.randn(b, h, t, dh, requires_grad=True) for _ in range(3))
    with FlopCounterMode(display=False) as attn:
        (torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v).sum().backward()
    per_layer_per_token = attn.get_total_flops() / n_tokens
    assert per_layer_per_token == pytest.approx(12 * args.d * args.seq, rel=0.01)
    assert flops_per_token(dims) == 6 * dims["non_embedding_params"] + 12 * args.layers * args.d * args.seq
