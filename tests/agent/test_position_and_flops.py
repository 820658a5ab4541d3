"""Cohorts from the parallelism config, and the analytic FLOPs cross-checked against torch."""

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from trainvitals.agent._model_facts import BackwardShares
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


class _LoRALinear(nn.Module):
    """A frozen Linear plus a trainable low-rank update, as peft's LoRA layer is registered (the
    base layer first)."""

    def __init__(self, base: nn.Linear, rank: int = 4) -> None:
        super().__init__()
        self.base_layer = base.requires_grad_(False)
        self.lora_a = nn.Linear(base.in_features, rank, bias=False)
        self.lora_b = nn.Linear(rank, base.out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_b(self.lora_a(x))


def _gpt() -> tuple[GPT, dict[str, int]]:
    args = parse_args(["--d", "128", "--layers", "6", "--seq", "64", "--vocab", "512", "--heads", "4"])
    torch.manual_seed(0)
    model = GPT(vocab=args.vocab, d=args.d, layers=args.layers, heads=args.heads, seq=args.seq)
    return model, model_dims(args, model)


def _lora(model: GPT) -> GPT:
    model.requires_grad_(False)
    for block in model.layers:
        for name in ("qkv", "proj", "fc", "fc_out"):
            setattr(block, name, _LoRALinear(getattr(block, name)))
    return model


def _frozen_backbone(model: GPT, trained_layers: int) -> GPT:
    model.requires_grad_(False)
    for module in (*model.layers[-trained_layers:], model.ln_f, model.lm_head):
        module.requires_grad_(True)
    return model


def _matmul_flops_per_token(model: GPT, seq: int) -> float:
    """What torch counts for one forward + backward, per token (on CPU the fused attention kernel
    is not counted, so this is the 2N/4N part; the attention term is checked apart below)."""
    tokens = torch.randint(0, 512, (2, seq))
    with FlopCounterMode(display=False) as counter:
        model(tokens).sum().backward()
    return counter.get_total_flops() / tokens.numel()


@pytest.mark.parametrize(
    ("name", "prepare", "six_n_reads"),
    [
        ("LoRA on every block matmul", _lora, 1.4),
        ("a backbone frozen under 2 trained blocks and the head", lambda m: _frozen_backbone(m, 2), 1.7),
    ],
)
def test_frozen_parameters_count_what_backward_does(name: str, prepare, six_n_reads: float) -> None:
    """A LoRA job's backward computes no weight gradients for the frozen base; a frozen backbone's
    none at all below the first trained block. torch's own FLOP counter is the reference: the
    agent's count is within 3% of it (0.8% here: biases and norms are in N), where 6N read 1.4x
    and 1.7x the work done."""
    model, dims = _gpt()
    model = prepare(model)
    shares = BackwardShares(model, {}).read()
    assert shares is not None
    n = dims["non_embedding_params"]
    n_now = sum(p.numel() for p in model.parameters()) - 512 * 128 - 64 * 128  # LoRA adds parameters
    counted = _matmul_flops_per_token(model, dims["seq_len"])
    ours = flops_per_token({**dims, "non_embedding_params": n_now}, trained=shares[0], reach=shares[1])
    assert ours is not None
    attention = 12 * dims["layers"] * dims["hidden"] * dims["seq_len"]
    # The attention term under BackwardShares' reach: forward always, backward where it passes.
    ours_matmul = ours - (4 + 8 * shares[1]) * dims["layers"] * dims["hidden"] * dims["seq_len"]
    assert ours_matmul == pytest.approx(counted, rel=0.03), name
    assert 6 * n / counted > six_n_reads, "the convention alone overstates this job's work"
    assert flops_per_token(dims) == 6 * n + attention  # full training: unchanged


def test_full_training_and_a_trained_embedding_alone_reach_every_layer() -> None:
    model, _ = _gpt()
    assert BackwardShares(model, {}).read() == (1.0, 1.0)
    model.requires_grad_(False)
    model.tok_emb.requires_grad_(True)  # prompt/embedding tuning: backward runs through every layer
    assert BackwardShares(model, {}).read() == (0.0, 1.0)
    assert BackwardShares(model, {"pp": 2}).read() is None  # a stage's parameters are not the model's
    model.tok_emb.requires_grad_(False)
    assert BackwardShares(model, {}).read() is None  # nothing trains: the convention stands


def test_attention_backward_is_two_thirds_of_its_term() -> None:
    """The attention term's split: forward 4LHQT, backward 8LHQT, so a layer backward does not
    reach costs a third of it (explicit-matmul attention: the fused CPU kernel is not counted)."""
    b, h, t, dh = 2, 4, 64, 32
    q, k, v = (torch.randn(b, h, t, dh) for _ in range(3))
    with FlopCounterMode(display=False) as forward_only:
        torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v
    for z in (q, k, v):
        z.requires_grad_(True)
    with FlopCounterMode(display=False) as both:
        (torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v).sum().backward()
    assert forward_only.get_total_flops() / both.get_total_flops() == pytest.approx(4 / 12)


def test_a_peft_lora_gpt2_counts_what_torch_counts() -> None:
    """peft's LoRA on Hugging Face's GPT-2, as a fine-tune builds it: the agent's FLOPs per token,
    from the dims and shares it derives itself, against torch's FlopCounterMode over forward and
    backward (eager attention, so every matmul is counted). GPT-2's head is tied to its token
    embedding, registered first and run last: backward passes through it whatever else is frozen
    (counted at its registration place, its 23% of N fell out of backward: 12% low). Within 0.3%
    here; 6N + 12LHQT read 1.46x."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    from trainvitals.agent._model_facts import model_dims

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=4, n_embd=128, n_head=4, n_positions=64, vocab_size=2048, bos_token_id=0, eos_token_id=0
    )
    config._attn_implementation = "eager"
    lora = LoraConfig(r=8, target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True)
    model = get_peft_model(GPT2LMHeadModel(config), lora)
    dims = model_dims(model, {})
    shares = BackwardShares(model, {}).read()
    assert shares is not None and shares[0] < 0.1 and shares[1] > 0.95
    tokens = torch.randint(0, 2048, (2, 64))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=tokens).logits.sum().backward()
    counted = counter.get_total_flops() / tokens.numel()
    ours = flops_per_token(dims, trained=shares[0], reach=shares[1])
    assert ours == pytest.approx(counted, rel=0.02)
    full = flops_per_token(dims)
    assert full is not None and full / counted > 1.4  # 6N + 12LHQT: the work of full training


def test_shares_follow_parameters_replaced_after_they_were_listed() -> None:
    """FSDP2's fully_shard swaps every parameter of the attached model for a new (sharded) one:
    the shares are read from the model's parameters as they are now, not the listed objects."""
    model, _ = _gpt()
    shares = BackwardShares(model, {})
    assert shares.read() == (1.0, 1.0)
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, nn.Parameter(p.detach().clone(), requires_grad=module is model.lm_head))
    tables = model.tok_emb.weight.numel() + model.pos_emb.weight.numel()
    n = sum(p.numel() for p in model.parameters()) - tables
    assert shares.read() == pytest.approx((model.lm_head.weight.numel() / n,) * 2)


def test_a_model_parallel_rank_reports_its_share_of_the_batchs_flops(collector, tmp_path) -> None:
    """tp=2 x pp=2: each of the four ranks that see a batch does a quarter of its model FLOPs, and the
    collector sums the ranks' (reported whole by each, MFU read 4x what the job did)."""
    from pathlib import Path

    import trainvitals.agent as tv
    from trainvitals.wire import Batch

    model = nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = tv.AgentConfig(collector=collector.url, spill_dir=str(tmp_path / "spool"),
                            record_file=str(tmp_path / "rec-{rank}.jsonl"))  # fmt: skip
    registration = {
        "model": {"non_embedding_params": 100, "layers": 2, "hidden": 8, "seq_len": 4},
        "parallelism": {"world_size": 4, "tp": 2, "pp": 2},
    }
    agent = tv.attach(model, opt, run="share", config=config, registration=registration)
    agent.step(loss=1.0, tokens=16)
    agent.close()
    lines = Path(tmp_path / "rec-0.jsonl").read_bytes().splitlines()
    (step,) = [r for line in lines[1:] for r in Batch.model_validate_json(line).records if r.kind == "step"]
    assert step.flops == pytest.approx(16 * (6 * 100 + 12 * 2 * 8 * 4) / 4)
