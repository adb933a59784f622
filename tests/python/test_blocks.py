# test_blocks.py — row blocks of one matrix (split_sizes / num_heads): each block steps as a
# matrix of its own, against the float64 transcription of docs/algorithm.md block by block, and bit for bit
# like the same blocks given as separate parameters.
import pytest
import torch

import dion3
from reference import Reference

FUSED = (40, 32)       # a fused QKV weight with grouped-query attention: q 24 rows, k and v 8 each
SPLIT = (24, 8, 8)


def _grads(shapes, step):
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(s, generator=g) for s in shapes]


def _blocks(heights):
    out, b0 = [], 0
    for s in heights:
        out.append((b0, s))
        b0 += s
    return out


@pytest.mark.parametrize("algorithm", ["dion3", "normuon", "muon"])
@pytest.mark.parametrize("kw,heights", [(dict(split_sizes=SPLIT), SPLIT), (dict(num_heads=5), (8,) * 5)])
def test_blocks_equal_the_reference_block_by_block(algorithm, kw, heights):
    torch.manual_seed(0)
    fused = [torch.randn(FUSED) * 0.05 for _ in range(2)]
    other = torch.randn(8, 32) * 0.05  # same shape as the k/v blocks: shares their megabatch
    ps = [torch.nn.Parameter(t.clone()) for t in fused]
    q = torch.nn.Parameter(other.clone())
    opt = dion3.Dion3([dict(params=ps, algorithm=algorithm, **kw), dict(params=[q], algorithm=algorithm)], lr=0.02)
    blocks = _blocks(heights)
    refs = [[Reference([f[b0:b0 + s]], algorithm=algorithm, lr=0.02) for b0, s in blocks] for f in fused]
    ref_q = Reference([other], algorithm=algorithm, lr=0.02)
    for step in range(3):
        gs = _grads([FUSED, FUSED, (8, 32)], step)
        for p, g in zip(ps + [q], gs):
            p.grad = g.clone()
        opt.step()
        for r, g in zip(refs, gs):
            for (b0, s), rb in zip(blocks, r):
                rb.step([g[b0:b0 + s]])
        ref_q.step([gs[2]])
        for i, (p, r) in enumerate(zip(ps, refs)):
            want = torch.cat([rb.w[0] for rb in r])
            err = (p.detach().double() - want).abs().max().item() / want.abs().max().item()
            assert err < 2e-5, f"{algorithm} {kw}: fused parameter {i} at step {step}: {err:.3g}"
        assert torch.allclose(q.detach().double(), ref_q.w[0], rtol=0, atol=2e-5 * ref_q.w[0].abs().max().item())
    # Blocks of equal height share a megabatch (the other group's matrix has one of its own).
    shapes = sorted((mb["group"], mb["rows"], mb["cols"], mb["count"]) for mb in opt.plan())
    want = [(0, 8, 32, 4), (0, 24, 32, 2)] if kw.get("split_sizes") else [(0, 8, 32, 10)]
    assert shapes == want + [(1, 8, 32, 1)], shapes


@pytest.mark.parametrize("algorithm", ["dion3", "normuon"])
def test_blocks_step_bit_for_bit_like_separate_parameters(algorithm):
    torch.manual_seed(1)
    fused = torch.nn.Parameter(torch.randn(FUSED) * 0.05)
    parts = [torch.nn.Parameter(fused.detach()[b0:b0 + s].clone()) for b0, s in _blocks(SPLIT)]
    a = dion3.Dion3([dict(params=[fused], algorithm=algorithm)], lr=0.02)
    a.param_groups[0]["split_sizes"] = SPLIT  # a group key may also be set after construction
    b = dion3.Dion3([dict(params=parts, algorithm=algorithm)], lr=0.02)
    for step in range(3):
        (g,) = _grads([FUSED], step)
        fused.grad = g.clone()
        for (b0, s), p in zip(_blocks(SPLIT), parts):
            p.grad = g[b0:b0 + s].clone()
        a.step()
        b.step()
        assert torch.equal(fused.detach(), torch.cat([p.detach() for p in parts])), f"step {step}"
    var = a.state[fused]["variance_neuron"]
    assert torch.equal(var, torch.cat([b.state[p]["variance_neuron"] for p in parts]))


def test_blocks_of_an_expert_stack_and_a_plan_that_batches_equal_heights():
    # [E, m, n] with flatten=False: every expert's matrix is cut into the same blocks
    torch.manual_seed(2)
    stack = torch.nn.Parameter(torch.randn(3, 16, 12) * 0.05)
    opt = dion3.Dion3([dict(params=[stack], num_heads=4)], lr=0.02)
    ref = [[Reference([stack.detach()[e, h * 4:(h + 1) * 4].clone()], lr=0.02) for h in range(4)] for e in range(3)]
    for step in range(2):
        (g,) = _grads([(3, 16, 12)], step)
        stack.grad = g
        opt.step()
        for e in range(3):
            for h in range(4):
                ref[e][h].step([g[e, h * 4:(h + 1) * 4]])
    want = torch.stack([torch.cat([ref[e][h].w[0] for h in range(4)]) for e in range(3)])
    assert torch.allclose(stack.detach().double(), want, rtol=0, atol=2e-5 * want.abs().max().item())
    (mb,) = opt.plan()
    assert (mb["rows"], mb["cols"], mb["count"]) == (4, 12, 12)


@pytest.mark.parametrize("group,message", [
    (dict(split_sizes=(24, 8)), r"'split_sizes' \[24, 8\] sum to 32 rows"),
    (dict(num_heads=3), r"'num_heads' = 3 does not divide"),
    (dict(split_sizes=(24, 8, 8), num_heads=5), "give one of them"),
    (dict(split_sizes=(24, 0, 16)), "sizes >= 1"),
    (dict(split_sizes="qkv"), "sequence of row counts"),
    (dict(num_heads=2.5), "positive integer"),
    (dict(split_sizes=(24, 8, 8), algorithm="adamw"), "takes neither"),
])
def test_blocks_that_do_not_fit_are_refused_at_construction(group, message):
    p = torch.nn.Parameter(torch.zeros(FUSED))
    with pytest.raises(ValueError, match=message):
        dion3.Dion3([dict(params=[p], **group)])


def test_blocks_set_later_are_refused_at_the_step_with_nothing_changed():
    p = torch.nn.Parameter(torch.randn(FUSED))
    opt = dion3.Dion3([p])
    p.grad = torch.randn(FUSED)
    opt.step()
    before = (p.detach().clone(), opt.state[p]["momentum"].clone())
    opt.param_groups[0]["num_heads"] = 7
    with pytest.raises(ValueError, match="'num_heads' = 7 does not divide"):
        opt.step()
    assert torch.equal(p.detach(), before[0]) and torch.equal(opt.state[p]["momentum"], before[1])
    opt.param_groups[0]["num_heads"] = 4  # a fitting value: the next step re-plans
    opt.step()
    assert sum(mb["count"] for mb in opt.plan()) == 4


def test_blocks_refused_at_the_step_name_the_parameter_as_the_constructor_does():
    # The engine numbers parameters across all its groups; the message numbers them within their
    # own group, as the constructor's refusal of the same setting does.
    a, b = torch.nn.Parameter(torch.randn(4, 6)), torch.nn.Parameter(torch.randn(7, 6))
    opt = dion3.Dion3([dict(params=[a], param_names=["a"]), dict(params=[b], param_names=["b"])], lr=0.02)
    a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
    opt.step()
    opt.param_groups[1]["num_heads"] = 3
    with pytest.raises(ValueError, match=r"^dion3: parameter 0 'b' of group 1: 'num_heads' = 3 does not divide"):
        opt.step()
    with pytest.raises(ValueError, match=r"^dion3: parameter 0 'b' of group 1 has 7 rows per matrix but 'num_heads' = 3"):
        dion3.Dion3([dict(params=[a], param_names=["a"]), dict(params=[b], param_names=["b"], num_heads=3)])


def test_a_block_override_that_matches_the_bias_too_leaves_it_alone():
    # "*.qkv*" names the fused weight and its bias: the bias's element-wise group takes no blocks.
    model = torch.nn.Sequential()
    model.add_module("qkv", torch.nn.Linear(8, 24))
    groups = dion3.param_groups(model, overrides={"*qkv*": {"split_sizes": (8, 8, 8)}})
    by_name = {n: g for g in groups for n in g["param_names"]}
    assert by_name["qkv.weight"]["split_sizes"] == (8, 8, 8)
    assert "split_sizes" not in by_name["qkv.bias"]
    opt = dion3.Dion3(groups, lr=0.02)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
