"""The mixture-of-experts layer on one process: routing, capacity, losses, counts, config errors (issue 17)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dist_trainer.config import ModelConfig
from dist_trainer.config_load import model_config
from dist_trainer.model import build_model, count_parameters
from dist_trainer.model_blocks import Block
from dist_trainer.model_moe import MoE, moe_layers
from dist_trainer.model_moe_routing import (
    Routing,
    capacity_route,
    combine,
    dispatch,
    load_balancing_loss,
    select,
    z_loss,
)
from dist_trainer.planner.params import count_params, param_breakdown

MOE = {"vocab_size": 64, "d_model": 16, "n_layers": 2, "n_heads": 2, "max_seq_len": 32, "n_experts": 4, "top_k": 2,
       "capacity_factor": 1.0}


def _cfg(**fields: object) -> ModelConfig:
    return model_config("tiny", **{**MOE, **fields})


def route(logits: torch.Tensor, top_k: int, capacity: int) -> Routing:
    """Softmax top-k with renormalised gates, then GShard's slots (``capacity_route``)."""
    E = logits.shape[-1]
    return capacity_route(select(logits, _cfg(n_experts=E, top_k=top_k), None), E, capacity)


def test_mixtral_counts_equal_the_published_figures_on_the_meta_device_and_in_closed_form() -> None:
    cfg = model_config("mixtral-8x7b")
    bd = param_breakdown(cfg)
    assert count_parameters(build_model(cfg, "meta")) == 46_702_792_704 == bd.total
    assert bd.active == 12_879_925_248  # Mistral's "12.9B parameters per token"
    model = build_model(cfg, "meta")  # active from the model itself: everything but 6 of 8 experts per layer
    experts = sum(p.numel() for n, p in model.named_parameters() if ".moe.experts." in n)
    assert count_parameters(model) - experts * 6 // 8 == bd.active


@pytest.mark.parametrize("fields", [{}, {"moe_every": 2}, {"n_shared_experts": 2}, {"activation": "swiglu"},
                                    {"bias": False, "activation": "swiglu", "tie_embeddings": False, "top_k": 1}])
def test_closed_form_counts_equal_the_model(fields: dict) -> None:
    cfg = _cfg(**fields)
    model = build_model(cfg, "meta")
    assert count_params(cfg) == count_parameters(model)
    kinds = [hasattr(block, "moe") for block in model.layers]
    assert kinds == [cfg.is_moe_layer(i) for i in range(cfg.n_layers)]
    assert kinds[0] and (kinds[1] == (cfg.moe_every == 1))


def test_dense_model_has_no_moe_module() -> None:
    model = build_model(model_config("tiny"), "meta")
    assert not list(moe_layers(model))
    assert all(hasattr(b, "mlp") and not hasattr(b, "moe") for b in model.layers)


def test_route_drops_by_choice_then_position_per_sequence() -> None:
    """4 tokens, 2 experts, top-2, 2 slots per expert and sequence: the first choices of every token claim slots
    before any second choice, earlier positions first."""
    logits = torch.tensor([[[3.0, 0.0], [2.0, 1.0], [0.0, 5.0], [1.0, 0.0]]])  # (1, T=4, E=2)
    r = route(logits, top_k=2, capacity=2)
    assert r.expert[0, 0].tolist() == [0, 0, 1, 0] and r.expert[0, 1].tolist() == [1, 1, 0, 1]
    # first choices: expert 0 gets tokens 0 and 1 (full), token 3's first choice is dropped; expert 1 gets token 2
    assert r.keep[0, 0].tolist() == [True, True, True, False]
    # second choices: expert 1 has one slot left, for token 0 (earliest); expert 0 is full for token 2
    assert r.keep[0, 1].tolist() == [True, False, False, False]
    torch.testing.assert_close(r.gate.sum(1), torch.ones(1, 4))  # renormalised over the k chosen
    # with E = k = 2 both experts are chosen, so the renormalised gates are the router probabilities
    torch.testing.assert_close(r.gate[0, 0], logits.softmax(-1).max(-1).values[0])


def test_a_sequence_routes_the_same_alone_or_in_any_batch() -> None:
    torch.manual_seed(0)
    cfg = _cfg()
    layer = MoE(cfg, 0, lambda width: torch.nn.Linear(16, 16))
    x = torch.randn(6, 32, 16)
    alone = route(layer.router(x[2:3]).float(), 2, cfg.expert_capacity(32))
    batched = route(layer.router(x).float(), 2, cfg.expert_capacity(32))
    assert torch.equal(alone.keep[0], batched.keep[2]) and torch.equal(alone.expert[0], batched.expert[2])
    assert (~batched.keep).any()  # capacity factor 1 drops here


def test_dispatch_and_combine_equal_the_direct_mixture() -> None:
    """With room for every assignment, the layer is sum_k gate_k * expert_k(x) per token; with drops, the dropped
    assignments are left out (no renormalisation)."""
    torch.manual_seed(1)
    for factor in (2.0, 0.5):
        cfg = _cfg(capacity_factor=factor, n_shared_experts=1)
        block = Block(cfg, 0)
        layer = block.moe
        layer.eval()
        x = torch.randn(3, 32, 16)
        logits = layer.router(x).float()
        r = route(logits, 2, cfg.expert_capacity(32))
        y = combine(layer.run_experts(dispatch(x, r, 4)), r, x)
        want = torch.zeros_like(x)
        for b in range(3):
            for j in range(2):
                for t in range(32):
                    if r.keep[b, j, t]:
                        e = int(r.expert[b, j, t])
                        want[b, t] += r.gate[b, j, t] * layer.experts[str(e)](x[b, t])
        torch.testing.assert_close(y, want)
        assert layer.shared_expert is not None
        torch.testing.assert_close(layer(x), want + layer.shared_expert(x))
        assert (factor < 1) == bool((~r.keep).any())


def test_losses_follow_the_papers() -> None:
    """Switch eq. 4: alpha under uniform routing; ST-MoE eq. 5: the mean squared log-sum-exp."""
    E, T = 4, 64
    probs = torch.full((T, E), 1.0 / E)
    expert = torch.arange(T * 2).remainder(E).view(T, 2)  # every expert gets the same share
    for per_sequence in (False, True):
        def loss(p: torch.Tensor, e: torch.Tensor, per_sequence: bool = per_sequence) -> float:
            return float(load_balancing_loss(p[None], e[None], E, per_sequence=per_sequence, normalise=False))
        assert loss(probs, expert) == pytest.approx(1.0)
        skew = torch.zeros(T, 2, dtype=torch.long)  # all to expert 0, which has all the probability
        assert loss(F.one_hot(skew[:, 0], E).float(), skew) == pytest.approx(E)
    logits = torch.tensor([[0.0, math.log(3.0)], [math.log(7.0), 0.0]])
    assert float(z_loss(logits)) == pytest.approx((math.log(4.0) ** 2 + math.log(8.0) ** 2) / 2)


def test_training_loss_adds_the_router_losses_and_eval_does_not() -> None:
    cfg = _cfg(router_aux_loss=0.1, router_z_loss=0.01)
    model = build_model(cfg, seed=0)
    tokens = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))
    model.eval()
    with torch.no_grad():
        lm = model(tokens, tokens)
    model.train()
    total = model(tokens, tokens)
    stats = [m.router_stats for m in moe_layers(model)]
    aux = sum(float(s[cfg.n_experts + 1] + s[cfg.n_experts + 2]) for s in stats if s is not None)
    assert aux > 0.1 and float(total.detach()) == pytest.approx(float(lm) + aux, rel=1e-6)
    total.backward()
    assert all(p.grad is not None for p in model.parameters())  # every expert and router trained


@pytest.mark.parametrize(("fields", "message"), [
    ({"top_k": 5}, "model.top_k=5 exceeds model.n_experts=4"),
    ({"capacity_factor": 0.0}, "model.capacity_factor=0.0 must be > 0"),
    ({"moe_every": 0}, "model.moe_every=0 must be a positive integer"),
    ({"router_aux_loss": -1.0}, "model.router_aux_loss=-1.0"),
    ({"n_experts": 0, "n_shared_experts": 1}, "model.n_shared_experts=1 needs routed experts"),
    ({"n_experts": -2}, "model.n_experts=-2 must be an integer >= 0"),
    ({"router_score": "tanh"}, "model.router_score='tanh' is not one of softmax, sigmoid"),
    ({"router_groups": 3}, "model.router_groups=3 must divide model.n_experts=4"),
    ({"router_groups": 2, "router_topk_groups": 1, "top_k": 3}, "cannot hold model.top_k=3"),
    ({"moe_bias_update_rate": 0.01}, "needs model.expert_bias: true"),
    ({"shared_expert_gate": True}, "needs model.n_shared_experts > 0"),
    ({"moe_dense_layers": [2]}, "are not layer indices 0 .. 1"),
    ({"router_aux_loss_scope": "token"}, "model.router_aux_loss_scope='token' is not one of batch, sequence"),
])
def test_bad_moe_config_is_a_value_error_naming_it(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        _cfg(**fields)


@pytest.mark.parametrize("fields", [
    {},  # Mixtral: softmax top-2, renormalised
    {"norm_topk_prob": False, "n_shared_experts": 2, "shared_expert_gate": True, "moe_d_ff": 8},  # Qwen2-MoE
    {"router_score": "sigmoid", "router_groups": 2, "router_topk_groups": 1, "expert_bias": True,  # DeepSeek-V3
     "routed_scaling_factor": 2.5, "n_shared_experts": 1, "moe_d_ff": 8},
])
def test_a_dropless_layer_is_the_gated_sum_of_its_experts_grouped_or_looped(fields: dict) -> None:
    """Dropless: every token's output is sum_k gate_k expert_k(x) (+ the shared expert, gated), whether the experts
    run as grouped matmuls or one module per segment, and the two give the same gradients."""
    torch.manual_seed(2)
    cfg = _cfg(capacity_factor=None, activation="swiglu", bias=False, **fields)
    layer = Block(cfg, 0).moe
    if layer.expert_bias is not None:
        layer.expert_bias.copy_(torch.randn(4) * 0.1)
    x = torch.randn(3, 32, 16, requires_grad=True)
    c = select(layer.router(x).float(), cfg, layer.expert_bias)
    want = torch.zeros(3, 32, 16)
    for j in range(cfg.top_k):
        for e in range(4):
            mask = (c.expert[..., j] == e).unsqueeze(-1)
            want = want + mask * c.gate[..., j:j + 1] * layer.experts[str(e)](x)
    if layer.shared_expert is not None:
        gate = torch.sigmoid(layer.shared_expert_gate(x)) if layer.shared_expert_gate is not None else 1.0
        want = want + gate * layer.shared_expert(x)
    grads = []
    for grouped in (True, False):
        layer.grouped = grouped
        layer.zero_grad()
        x.grad = None
        got = layer(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        got.square().sum().backward()
        grads.append([x.grad.clone(), *(p.grad.clone() for p in layer.parameters())])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "amp_bf16"])
def test_op_level_recomputation_of_grouped_experts_keeps_loss_and_gradients(amp: bool) -> None:
    """Op-level recomputation keeps every other matmul, the experts' grouped matmuls counted among them (run again
    inside the custom autograd Function): the same loss and gradients as no recomputation, the grouped path
    taken in both."""
    cfg = _cfg(capacity_factor=None, activation="swiglu", bias=False, n_shared_experts=1)
    tokens = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))
    grouped_calls = []

    def run(mode: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model = build_model(cfg, "cpu", seed=0)
        model.set_activation_checkpointing(mode)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            loss = model(tokens, tokens)
        loss.backward()
        return loss.detach(), [p.grad for p in model.parameters()]

    original = torch._grouped_mm

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        grouped_calls.append(1)
        return original(*args, **kwargs)  # type: ignore[arg-type]

    torch._grouped_mm = counted  # type: ignore[assignment]
    try:
        reference = run("none")
        plain = len(grouped_calls)
        got = run("op")
    finally:
        torch._grouped_mm = original  # type: ignore[assignment]
    # per MoE layer (both of the 2): 3 in forward, 2 per projection in backward; op-level adds the recomputed
    # forward's 3 calls (the kept gate's answered from the policy's cache: tests/test_planner_activations.py)
    assert plain == 2 * (3 + 3 * 2) and len(grouped_calls) - plain == 2 * (3 + 3 + 3 * 2)
    assert torch.equal(got[0], reference[0])
    for a, b in zip(got[1], reference[1], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_sigmoid_group_limited_routing_is_deepseek_v3s() -> None:
    """Sigmoid scores plus the expert bias for the choice only, the best 2 of 4 groups by their top-2 sums, gates
    renormalised then scaled: transformers' DeepseekV3TopkRouter on the same weights, bias and tokens."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    hf = transformers.DeepseekV3Config(hidden_size=16, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                                       topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)
    theirs = DeepseekV3TopkRouter(hf)
    torch.manual_seed(3)
    with torch.no_grad():
        theirs.weight.normal_()
        theirs.e_score_correction_bias.normal_(std=0.2)
    cfg = _cfg(n_experts=16, top_k=4, router_score="sigmoid", router_groups=4, router_topk_groups=2,
               routed_scaling_factor=2.5, expert_bias=True)
    x = torch.randn(2, 32, 16)
    ours = select(torch.nn.functional.linear(x, theirs.weight), cfg, theirs.e_score_correction_bias)
    _, weights, indices = theirs(x)
    order = indices.argsort(-1)
    assert torch.equal(ours.expert.flatten(0, 1).sort(-1).values, indices.gather(-1, order))
    torch.testing.assert_close(ours.gate.flatten(0, 1).gather(-1, ours.expert.flatten(0, 1).argsort(-1)),
                               weights.gather(-1, order))
    assert not torch.equal(ours.expert, select(ours.scores.logit(), cfg, None).expert)  # the bias changed choices


def test_qwen3_30b_a3b_counts_are_the_published_configs() -> None:
    """``dist-trainer params --model qwen3-30b-a3b``: transformers' model of the published config.json (on the meta
    device), and the active count (8 of the 128 experts of each layer) read off it."""
    transformers = pytest.importorskip("transformers")
    published = {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 40960,
                 "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False,
                 "decoder_sparse_step": 1, "moe_intermediate_size": 768, "num_experts_per_tok": 8, "num_experts": 128,
                 "norm_topk_prob": True, "mlp_only_layers": []}  # Qwen/Qwen3-30B-A3B config.json
    with torch.device("meta"):
        theirs = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**published))
    total = theirs.num_parameters()
    one_expert = 3 * 2048 * 768
    bd = param_breakdown(model_config("qwen3-30b-a3b"))
    assert bd.total == total == 30_532_122_624  # "30.5B"
    assert bd.active == total - 48 * (128 - 8) * one_expert == 3_353_032_704  # "3.3B activated"


def test_expert_bias_balances_a_skewed_router_without_an_auxiliary_loss() -> None:
    """Auxiliary-loss-free balancing (DeepSeek-V3): a router whose first expert outscores the others for every token
    starts far from balance; the bias alone (no aux loss, no weight update) brings every layer's max/mean load
    below 1.2 within a few hundred steps, and the same in both layers."""
    from dist_trainer.parallel.state import ParallelState
    from dist_trainer.train.moe_balance import update_expert_bias

    cfg = _cfg(capacity_factor=None, router_score="sigmoid", expert_bias=True, moe_bias_update_rate=0.001,
               router_aux_loss=0.0, router_z_loss=0.0, n_experts=8, top_k=2)
    model = build_model(cfg, seed=0)
    layers = list(moe_layers(model))
    state, g = ParallelState.single(), torch.Generator().manual_seed(0)
    with torch.no_grad():
        for block in model.layers:  # every router input shares the norm's bias c; expert 0's weight reads it
            block.mlp_norm.bias.fill_(2.0)
            block.moe.router.weight[0] += 1.5 * block.mlp_norm.bias / block.mlp_norm.bias.square().sum()

    def step() -> list[torch.Tensor]:
        with torch.no_grad():
            model(torch.randint(0, 64, (32, 32), generator=g), torch.randint(0, 64, (32, 32), generator=g))
        loads = [m.step_load.clone() for m in layers if m.step_load is not None]
        update_expert_bias(model, cfg, state)
        return loads

    def imbalance(loads: list[torch.Tensor]) -> list[float]:
        return [float(x.max() / x.mean()) for x in loads]

    model.train()
    first = imbalance(step())
    assert min(first) > 2.0, first  # skewed on purpose
    for _ in range(290):
        step()
    window = [sum(x) for x in zip(*(step() for _ in range(10)), strict=True)]  # steps 291-300 together
    assert max(imbalance(window)) < 1.2, imbalance(window)
    assert all(m.expert_bias is not None and float(m.expert_bias[0]) < 0 for m in layers)  # expert 0 pushed down
