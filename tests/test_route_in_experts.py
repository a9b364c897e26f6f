"""One-token steps routed inside the expert kernels (kernels/moe.py ``routed_moe_experts``): the router
writes only its logits (router.router_logits) and the mma-layout expert kernels make its top-k themselves
(the fused layer's default; MINIMAX_OPS_ROUTE_IN_EXPERTS=0 turns it off).

On CPU the kernels run under the Triton interpreter (the portable emulation of the mma product), on CUDA
through the PTX. Compared with the fp32 reference (ref.route then ref.moe_experts on the canonical
tables) and with the two launches the step makes otherwise (router.route, then moe_experts).
"""

from __future__ import annotations

import pytest
import torch

from minimax_ops import reference as ref
from minimax_ops.kernels import decode_layer, moe, router
from minimax_ops.kernels.moe import moe_experts, routed_moe_experts, routes_in_kernel
from utils import mma_expert_tables, rel_err

H, I, E, K = 256, 128, 8, 2


@pytest.fixture(autouse=True)
def route_in_experts(monkeypatch):
    """The default (no switch set), whatever the environment the tests run in."""
    monkeypatch.delenv("MINIMAX_OPS_ROUTE_IN_EXPERTS", raising=False)


SCALING = 2.0
SIZES = {"mxfp4": (H, I), "mxfp8": (128, 64)}  # (MXFP8 smaller: the interpreter's emulation is slow)


def _tables(device, fmt, shared, hidden=H, inter=I):
    return mma_expert_tables(device, fmt, shared, E, hidden, inter)


def _gate(device, bias, hidden=H):
    gate = (torch.randn(E, hidden) * 0.05).to(device)
    return gate, (torch.randn(E) * 0.5).to(device) if bias else None


def _one_token_step(device, seed):
    """(canonical tables, mma tables, h, gate, gate bias) of a one-token MXFP4 step, shared expert apart."""
    torch.manual_seed(seed)
    canonical, mma = _tables(device, "mxfp4", "separate")
    h = torch.randn(1, H, device=device).bfloat16()
    return canonical, mma, h, *_gate(device, True)


def test_router_logits_are_the_fp32_products(device):
    torch.manual_seed(0)
    h = torch.randn(3, H, device=device).bfloat16()
    gate = torch.randn(E + 3, H, device=device)
    got = router.router_logits(h, gate)
    want = h.double() @ gate.double().T
    assert got.shape == (3, E + 3) and got.dtype == torch.float32
    assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("fmt, shared, bias, trials", [("mxfp4", "separate", True, 2), ("mxfp4", "table", False, 1),
                                                       ("mxfp8", "separate", True, 1)])
def test_one_token_routed_in_the_experts_matches_the_reference(fmt, shared, bias, trials, device, monkeypatch):
    """The in-kernel top-k chooses the experts router.route chooses and weighs them the same: the output
    is the reference's within the MX tolerance and the two-launch path's within fp32 reassociation; no
    top-k launch runs (router.route is not called)."""
    torch.manual_seed(11)
    hidden, inter = SIZES[fmt]
    canonical, mma = _tables(device, fmt, shared, hidden, inter)
    for trial in range(trials):
        h = torch.randn(1, hidden, device=device).bfloat16()
        gate, gate_bias = _gate(device, bias, hidden)
        weights, ids = ref.route(h, gate, gate_bias, K, SCALING)
        want = ref.moe_experts(h, ids, weights, *canonical, num_routed_experts=E)
        two_launches = moe_experts(h, *reversed(router.route(h, gate, gate_bias, K, SCALING)), *mma,
                                   num_routed_experts=E)
        assert routes_in_kernel(1, mma[0], mma[1])
        with monkeypatch.context() as m:
            m.setattr(router, "route", lambda *a, **k: pytest.fail("router.route called on the in-kernel path"))
            out = routed_moe_experts(h, gate, gate_bias, K, SCALING, *mma, num_routed_experts=E)
        assert out.shape == (1, hidden) and torch.isfinite(out).all()
        assert rel_err(out, want) < 1.5e-2, trial
        assert rel_err(out, two_launches) < 2e-3, trial
        assert torch.equal(out, routed_moe_experts(h, gate, gate_bias, K, SCALING, *mma, num_routed_experts=E))


def test_the_bias_chooses_and_the_scores_weigh(device):
    """A bias that puts two experts first must choose them whatever the scores say; their weights are
    their sigmoid scores renormalised (compared with the reference fed those ids)."""
    torch.manual_seed(3)
    canonical, mma = _tables(device, "mxfp4", "separate")
    h = torch.randn(1, H, device=device).bfloat16()
    gate, _ = _gate(device, False)
    gate_bias = torch.zeros(E, device=device)
    gate_bias[[5, 2]] = 10.0
    scores = torch.sigmoid(h.float() @ gate.T)[0]
    ids = torch.tensor([[5, 2]], dtype=torch.int32, device=device)
    weights = scores[[5, 2]] / scores[[5, 2]].sum() * SCALING
    want = ref.moe_experts(h, ids, weights[None], *canonical, num_routed_experts=E)
    out = routed_moe_experts(h, gate, gate_bias, K, SCALING, *mma, num_routed_experts=E)
    assert rel_err(out, want) < 1.5e-2


def test_other_steps_and_layouts_are_not_routed_in_kernel(device, monkeypatch):
    """Steps of more than one token and tables outside the mma layouts are not routes_in_kernel's (nor is
    any step with MINIMAX_OPS_ROUTE_IN_EXPERTS=0: decode_layer's FFN step routes them with router.route);
    the in-kernel launch refuses them by name, before it launches anything."""
    torch.manual_seed(5)
    canonical, mma = _tables(device, "mxfp4", "separate")
    assert not routes_in_kernel(2, mma[0], mma[1])
    assert not routes_in_kernel(1, canonical[0], canonical[1])
    monkeypatch.setenv("MINIMAX_OPS_ROUTE_IN_EXPERTS", "0")
    assert not routes_in_kernel(1, mma[0], mma[1])
    monkeypatch.delenv("MINIMAX_OPS_ROUTE_IN_EXPERTS")
    h = torch.randn(2, H, device=device).bfloat16()
    gate, gate_bias = _gate(device, True)

    def no_launch(*args, **kwargs):
        raise AssertionError("a refused step launched the router")

    monkeypatch.setattr(router, "router_logits", no_launch)
    with pytest.raises(ValueError, match="route: .* only one-token steps"):
        routed_moe_experts(h, gate, gate_bias, K, SCALING, *mma, num_routed_experts=E)
    with pytest.raises(ValueError, match="route: .* only in the mma layouts"):
        routed_moe_experts(h[:1], gate, gate_bias, K, SCALING, *canonical, num_routed_experts=E)
    with pytest.raises(ValueError, match="gate: expected 8 rows"):
        routed_moe_experts(h[:1], gate[:4], None, K, SCALING, *mma, num_routed_experts=E)
    with pytest.raises(ValueError, match="w2"):  # w13's table given as w2
        routed_moe_experts(h[:1], gate, gate_bias, K, SCALING, *mma[:2], *mma[:2], *mma[4:], num_routed_experts=E)


def test_the_fused_layers_ffn_step_matches_the_reference(device):
    """decode_layer's router + experts step (the fused layer's, routed in the experts) against the fp32
    reference of the router and experts."""
    canonical, mma, h, gate, gate_bias = _one_token_step(device, 31)
    out = decode_layer.kernel_stages().routed_moe_experts(h, gate, gate_bias, K, SCALING, *mma, E, 1.702, 7.0)
    weights, ids = ref.route(h, gate, gate_bias, K, SCALING)
    assert rel_err(out, ref.moe_experts(h, ids, weights, *canonical, num_routed_experts=E)) < 1.5e-2


def test_the_ffn_step_launches_through_the_stage_functions(device, monkeypatch):
    """Off the in-kernel path the step's router is decode_layer._route (benchmarks/stage_removal.py
    replaces it); on it, router.route is not called."""
    _, mma, h, gate, gate_bias = _one_token_step(device, 41)
    calls = []
    route_ = decode_layer._route
    monkeypatch.setattr(decode_layer, "_route", lambda *a: calls.append("route") or route_(*a))
    step = decode_layer.kernel_stages().routed_moe_experts
    with monkeypatch.context() as m:
        m.setattr(router, "route", lambda *a, **k: pytest.fail("router.route called on the in-kernel path"))
        routed = step(h, gate, gate_bias, K, SCALING, *mma, E, 1.702, 7.0)
    assert calls == []
    monkeypatch.setenv("MINIMAX_OPS_ROUTE_IN_EXPERTS", "0")
    two = step(h, gate, gate_bias, K, SCALING, *mma, E, 1.702, 7.0)
    assert calls == ["route"]
    assert rel_err(two, routed) < 2e-3


def test_the_in_kernel_step_takes_the_routed_tiles(device, monkeypatch):
    """routed_moe_experts asks for the tiles of kernels that make the top-k themselves (tiles.
    _ROUTED_W2_RING), moe_experts fed the router's ids for the plain ones."""
    _, mma, h, gate, gate_bias = _one_token_step(device, 47)
    asked = []
    tiles_ = moe.expert_tiles
    monkeypatch.setattr(moe, "expert_tiles", lambda *a, **k: asked.append(k["routed"]) or tiles_(*a, **k))
    routed_moe_experts(h, gate, gate_bias, K, SCALING, *mma, num_routed_experts=E)
    assert asked == [True, True]
    weights, ids = router.route(h, gate, gate_bias, K, SCALING)
    moe_experts(h, ids, weights, *mma, num_routed_experts=E)
    assert asked == [True, True, False, False]
