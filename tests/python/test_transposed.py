# test_transposed.py — groups of weights stored (in, out) (transposed=True, Hugging Face's Conv1D):
# the float64 transcription of docs/algorithm.md run on the (out, in) matrix; the same steps as a plain
# group given the transposed copy, on every device (the CUDA column kernels with NorMuon's factors
# among them); the variance per output feature through a checkpoint; param_groups' Conv1D group.
import warnings

import pytest
import torch

import dion3
from reference import Reference


def _grads(shapes, step, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(500 + step)
    return [torch.randn(s, generator=g).to(device=device, dtype=dtype) for s in shapes]


@pytest.mark.parametrize("algorithm,fraction", [("dion3", 0.25), ("dion3", 1.0), ("normuon", 0.25), ("muon", 0.25),
                                                ("dion2", 0.5)])
def test_transposed_weights_follow_the_rule_on_out_in(algorithm, fraction):
    torch.manual_seed(0)
    # (in, out): GPT-2's c_fc, c_proj and attention's square c_proj, an expert stack
    stored = [(32, 96), (96, 24), (24, 24), (3, 16, 40)]
    ws = [torch.randn(s) * 0.05 for s in stored]
    ps = [torch.nn.Parameter(w.clone()) for w in ws]
    opt = dion3.Dion3([dict(params=ps, algorithm=algorithm, fraction=fraction, transposed=True)], lr=0.02)
    refs = [Reference([w.transpose(-2, -1).contiguous()], algorithm=algorithm, fraction=fraction, lr=0.02)
            for w in ws]
    for step in range(3):
        gs = _grads(stored, step)
        for p, g in zip(ps, gs):
            p.grad = g
        opt.step()
        for p, r, g in zip(ps, refs, gs):
            r.step([g.transpose(-2, -1)])
            want = r.w[0].transpose(-2, -1)
            err = (p.detach().double() - want).abs().max().item() / want.abs().max().item()
            assert err < 2e-5, f"{algorithm} f={fraction} {tuple(p.shape)} at step {step}: {err:.3g}"
    if algorithm in ("dion3", "normuon"):
        assert [tuple(opt.state[p]["variance_neuron"].shape) for p in ps] == [(1, 96), (1, 24), (1, 24), (3, 1, 40)]


# Blocks (num_heads) in a transposed group are of output features (GPT-2's fused c_attn stored
# (in, q + k + v)): each steps as the plain group's row block of the transposed copy, with its own
# selection, variance and learning-rate adjustment (rms_norm reads the block's shape).
@pytest.mark.parametrize("algorithm,dtype,blocks",
                         [(a, d, {}) for a in ("dion3", "normuon", "muon") for d in (torch.float32, torch.bfloat16)] +
                         [("dion3", torch.float32, dict(num_heads=4, adjust_lr="rms_norm")),
                          ("normuon", torch.float32, dict(num_heads=2, adjust_lr="rms_norm"))])
def test_transposed_steps_like_a_plain_group_on_the_transposed_copy(device, dtype, algorithm, blocks):
    torch.manual_seed(1)
    stored = [(64, 192), (64, 192), (192, 64), (4, 32, 48)]
    ws = [(torch.randn(s) * 0.05).to(device=device, dtype=dtype) for s in stored]
    ps = [torch.nn.Parameter(w.clone()) for w in ws]
    qs = [torch.nn.Parameter(w.transpose(-2, -1).contiguous()) for w in ws]
    kw = dict(algorithm=algorithm, nesterov=algorithm != "dion3", cautious_wd=algorithm == "dion3", **blocks)
    opt = dion3.Dion3([dict(params=ps, transposed=True, **kw)], lr=0.02, weight_decay=0.1)
    plain = dion3.Dion3([dict(params=qs, **kw)], lr=0.02, weight_decay=0.1)
    for step in range(4):
        gs = _grads(stored, step, device, dtype)
        for p, q, g in zip(ps, qs, gs):
            p.grad, q.grad = (None, None) if step == 2 and g.dim() == 3 else (g, g.transpose(-2, -1).contiguous())
        opt.step()
        plain.step()
    # The same selection, normalisation and learning rate: the weights agree to the
    # orthogonalizer's precision (the column path sums the norm in another order; Muon steps the
    # stored matrix as it is; blocks gathered by columns and by rows round apart a little more than
    # whole matrices). CUDA iterates in 16 bits; there updates a little apart can round a bf16
    # weight to neighbouring values, up to two units in the last place of the largest weight.
    exact = device == "cpu" and dtype == torch.float32
    tol = (1e-5 if blocks else 2e-6) if exact else 2e-2
    for i, (p, q, w) in enumerate(zip(ps, qs, ws)):
        moved = (q.detach().float() - w.transpose(-2, -1).float()).abs().max().item()
        err = (p.detach().float().transpose(-2, -1) - q.detach().float()).abs().max().item()
        ulps = 2 * 2.0 ** -7 * q.detach().float().abs().max().item() if dtype == torch.bfloat16 else 0.0
        assert moved > 0 and err <= tol * moved + ulps, \
            f"{algorithm} {dtype} parameter {i}: {err:.3g} of a change {moved:.3g}"
    if algorithm != "muon":
        for p, q in zip(ps, qs):
            v, u = opt.state[p]["variance_neuron"].flatten(), plain.state[q]["variance_neuron"].flatten()
            assert torch.allclose(v, u, rtol=1e-4 if exact else 5e-2, atol=0), (v - u).abs().max()
        assert all(mb["columns"] for mb in opt.plan())
    if blocks:  # every block of every matrix a member
        assert sum(mb["count"] for mb in opt.plan()) == blocks["num_heads"] * (3 + 4)


def test_transposed_state_resumes_bit_for_bit():
    torch.manual_seed(2)
    stored = [(24, 72), (2, 16, 40)]
    ps = [torch.nn.Parameter(torch.randn(s) * 0.05) for s in stored]
    opt = dion3.Dion3([dict(params=ps, transposed=True)], lr=0.02)
    for step in range(2):
        for p, g in zip(ps, _grads(stored, step)):
            p.grad = g
        opt.step()
    saved = opt.state_dict()
    # The setting travels with the groups, as every group setting does in torch.optim: an
    # optimizer built without it resumes the same steps.
    ps2 = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    opt2 = dion3.Dion3([dict(params=ps2)], lr=0.02)
    opt2.load_state_dict(saved)
    assert opt2.param_groups[0]["transposed"] is True
    for step in range(2, 4):
        for p, q, g in zip(ps, ps2, _grads(stored, step)):
            p.grad, q.grad = g, g.clone()
        opt.step()
        opt2.step()
    assert all(torch.equal(p, q) for p, q in zip(ps, ps2))
    assert all(torch.equal(opt.state[p]["variance_neuron"], opt2.state[q]["variance_neuron"]) for p, q in zip(ps, ps2))


def test_torch_style_muon_takes_the_setting():
    torch.manual_seed(4)
    w = torch.randn(32, 96) * 0.05  # (in, out): adjust_lr_fn's scaling reads (96, 32)
    p, q = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.T.contiguous())
    opt = dion3.optim.Muon([dict(params=[p], transposed=True)], lr=0.02)
    plain = dion3.optim.Muon([q], lr=0.02)
    for step in range(3):
        g = _grads([(32, 96)], step)[0]
        p.grad, q.grad = g, g.T.contiguous()
        opt.step()
        plain.step()
    assert torch.allclose(p.detach().T, q.detach(), rtol=0, atol=1e-6)


def test_the_setting_cannot_turn_once_the_state_holds_values():
    w = torch.nn.Parameter(torch.randn(24, 72) * 0.05)
    opt = dion3.Dion3([dict(params=[w], transposed=True)], lr=0.02)
    w.grad = torch.randn_like(w)
    opt.step()
    before = w.detach().clone()
    opt.param_groups[0]["transposed"] = False
    with pytest.raises(ValueError, match=r"\(transposed=False\): a parameter's transposed cannot change"):
        opt.step()
    assert torch.equal(w, before)
    opt.param_groups[0]["transposed"] = True
    opt.step()


def test_transposed_is_refused_where_it_cannot_apply():
    w = torch.nn.Parameter(torch.randn(8, 16))
    with pytest.raises(ValueError, match="separate parameters"):  # Muon steps the stored matrix as it is
        dion3.Dion3([dict(params=[w], algorithm="muon", transposed=True, num_heads=2)])
    with pytest.raises(ValueError, match="16 stored columns per matrix but 'split_sizes'"):
        dion3.Dion3([dict(params=[w], transposed=True, split_sizes=(8, 4))])
    with pytest.raises(ValueError, match="True or False"):
        dion3.Dion3([dict(params=[w], transposed="yes")])


class Conv1D(torch.nn.Module):
    """Hugging Face's Conv1D as GPT-2 uses it: y = x @ W + b with W stored (in, out) = (nx, nf)."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = torch.nn.Parameter(torch.randn(nx, nf) * 0.05)
        self.bias = torch.nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        return x @ self.weight + self.bias


def test_param_groups_give_conv1d_weights_a_transposed_group():
    torch.manual_seed(3)
    m = torch.nn.Module()
    m.c_fc, m.c_proj, m.lin = Conv1D(64, 16), Conv1D(16, 64), torch.nn.Linear(16, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        groups = dion3.param_groups(m, lr=0.02)
    by_name = {n: g for g in groups for n in g["param_names"]}
    assert by_name["c_fc.weight"].get("transposed") is True and by_name["c_proj.weight"].get("transposed") is True
    assert "transposed" not in by_name["lin.weight"] and by_name["c_fc.bias"]["role"] == "vector"
    # One training step on the module's own layout: the (out, in) rule, as an nn.Linear steps.
    opt = dion3.Dion3(groups, lr=0.02)
    lin = torch.nn.Linear(16, 64, bias=False)
    with torch.no_grad():
        lin.weight.copy_(m.c_fc.weight.T)
    ref = dion3.Dion3([lin.weight], lr=0.02)
    x = torch.randn(8, 16)
    m.c_fc(x).square().sum().backward()
    lin(x).square().sum().backward()
    opt.step()
    ref.step()
    assert torch.allclose(m.c_fc.weight.detach().T, lin.weight.detach(), rtol=0, atol=1e-6)
    # An override moving one to an element-wise algorithm: the setting is ignored there.
    moved = dion3.param_groups(m, lr=0.02, overrides={"c_proj.weight": dict(algorithm="adamw")})
    opt = dion3.Dion3(moved, lr=0.02)
    m.zero_grad()
    m.c_proj(m.c_fc(x)).sum().backward()
    opt.step()


def test_gpt2_fused_c_attn_split_into_q_k_v():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(6)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64,
                                                                n_positions=16))
    c_attn = "transformer.h.0.attn.c_attn.weight"  # stored (32, 96): q, k, v side by side
    groups = dion3.param_groups(gpt2, lr=0.02, overrides={"*.attn.c_attn.weight": dict(split_sizes=(32, 32, 32))})
    g = next(g for g in groups if c_attn in g["param_names"])
    assert g.get("transposed") is True and tuple(g["split_sizes"]) == (32, 32, 32)
    opt = dion3.Dion3(groups, lr=0.02)
    x = torch.randint(0, 64, (2, 8))
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = gpt2(x, labels=x).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    blocks = [mb for mb in opt.plan() if mb["group"] == groups.index(g)]
    assert [(mb["rows"], mb["cols"], mb["count"]) for mb in blocks] == [(32, 32, 3)], blocks


def test_param_groups_find_the_in_out_weights_of_hugging_face_models():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(5)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64,
                                                                n_positions=16))
    oss = transformers.GptOssForCausalLM(transformers.GptOssConfig(
        num_hidden_layers=1, hidden_size=32, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, num_local_experts=4, num_experts_per_tok=2, vocab_size=64, layer_types=["full_attention"]))
    llama4 = transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(
        num_hidden_layers=1, hidden_size=32, intermediate_size=16, intermediate_size_mlp=32, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, num_local_experts=4, num_experts_per_tok=1, vocab_size=64,
        max_position_embeddings=32, interleave_moe_layer_step=1, no_rope_layers=[1]))
    h, experts = "transformer.h.0.", "model.layers.0.{}.experts."
    cases = [(gpt2, {h + "attn.c_attn.weight", h + "attn.c_proj.weight", h + "mlp.c_fc.weight", h + "mlp.c_proj.weight"}),
             (oss, {experts.format("mlp") + "gate_up_proj", experts.format("mlp") + "down_proj"}),
             (llama4, {experts.format("feed_forward") + "gate_up_proj", experts.format("feed_forward") + "down_proj"})]
    x = torch.randint(0, 64, (2, 8))
    for model, want in cases:
        groups = dion3.param_groups(model, lr=0.02)
        assert {n for g in groups if g.get("transposed") for n in g["param_names"]} == want, type(model).__name__
        opt = dion3.Dion3(groups, lr=0.02)
        losses = []
        for _ in range(3):
            loss = model(x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert losses[-1] < losses[0], (type(model).__name__, losses)
