# test_api.py — the constructor surface of algorithm.md §4: the reference's argument names, order and
# defaults, so that moving from `dion` is an import change.
import inspect
import math
import re
import warnings

import pytest
import torch

import dion3

SPEC = {
    dion3.Dion3: [("distributed_mesh", None), ("lr", 0.01), ("fraction", 0.25), ("mu", 0.95),
                  ("muon_beta2", 0.95), ("betas", (0.9, 0.95)), ("weight_decay", 0.01), ("epsilon", 1e-8),
                  ("adjust_lr", "spectral_norm"), ("flatten", False), ("use_triton", False),
                  ("use_polar_express", True), ("use_gram_newton_schulz", False), ("newton_schulz_func", None),
                  ("triton_post_ortho", False), ("selection_scope", "local")],
    dion3.NorMuon: [("distributed_mesh", None), ("lr", 0.01), ("mu", 0.95), ("muon_beta2", 0.95),
                    ("betas", (0.9, 0.95)), ("weight_decay", 0.01), ("cautious_wd", False), ("epsilon", 1e-8),
                    ("nesterov", False), ("adjust_lr", "spectral_norm"), ("flatten", False),
                    ("use_gram_newton_schulz", False), ("use_triton", False), ("use_polar_express", True),
                    ("newton_schulz_func", None)],
    dion3.Muon: [("distributed_mesh", None), ("lr", 0.01), ("mu", 0.95), ("betas", (0.9, 0.95)),
                 ("weight_decay", 0.01), ("cautious_wd", False), ("epsilon", 1e-8), ("nesterov", False),
                 ("adjust_lr", "spectral_norm"), ("flatten", False), ("use_gram_newton_schulz", False),
                 ("use_triton", False), ("use_polar_express", True), ("newton_schulz_func", None)],
}


@pytest.mark.parametrize("cls", list(SPEC))
def test_positional_signature_matches_reference(cls):
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    positional = [p for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert positional[0].name == "params"
    assert [(p.name, p.default) for p in positional[1:]] == SPEC[cls]
    extra = {p.name for p in params if p.kind == p.KEYWORD_ONLY}
    assert {"orthogonalizer", "on_nonfinite", "workspace_limit"} <= extra


@pytest.mark.parametrize("cls", list(SPEC))
def test_defaults_land_in_param_groups(cls):
    p = torch.nn.Parameter(torch.randn(4, 4))
    opt = cls([p])
    g = opt.param_groups[0]
    assert g["algorithm"] == {dion3.Dion3: "dion3", dion3.NorMuon: "normuon", dion3.Muon: "muon"}[cls]
    for name, default in SPEC[cls][1:]:
        assert g[name] == default, name
    assert g["orthogonalizer"] == "auto"


@pytest.mark.parametrize("cls", [dion3.Dion3, dion3.NorDion2, dion3.Dion2, dion3.NorMuon, dion3.Muon])
def test_signature_defaults_are_the_engines(cls):
    # The engine defines the defaults once; the signatures repeat them for help() and must agree.
    engine = dion3.optimizer.ENGINE_DEFAULTS
    params = inspect.signature(cls.__init__).parameters
    shared = [k for k in engine if k in params and k != "restarts"]  # restarts=None: the engine's
    assert {"lr", "weight_decay", "epsilon", "adjust_lr", "flatten"} <= set(shared)
    for k in shared:
        assert params[k].default == engine[k], k
    if "ef_decay" in params:  # Dion2's name for mu
        assert params["ef_decay"].default == engine["mu"]
    g = cls([torch.nn.Parameter(torch.randn(4, 4))]).param_groups[0]
    assert g["restarts"] is None  # None: the engine's restart positions
    assert engine["restarts"] == [2]


def test_positional_call_like_the_reference():
    p = torch.nn.Parameter(torch.randn(8, 4))
    opt = dion3.Dion3([p], None, 0.02, 0.5)
    assert opt.param_groups[0]["lr"] == 0.02 and opt.param_groups[0]["fraction"] == 0.5


class _Model(torch.nn.Module):
    def __init__(self, tie=False, head_name="lm_head"):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.block = torch.nn.ModuleDict(dict(attn=torch.nn.Linear(16, 16), output=torch.nn.Linear(16, 16)))
        self.norm = torch.nn.LayerNorm(16)
        setattr(self, head_name, torch.nn.Linear(16, 50, bias=False))
        if tie:
            getattr(self, head_name).weight = self.embed.weight


def _roles(groups):
    return {n: g["role"] for g in groups for n in g["param_names"]}


@pytest.mark.parametrize("head_name", ["lm_head", "embed_out", "head", "output"])
def test_param_groups_find_the_head_and_scale_its_lr(head_name):
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        groups = dion3.param_groups(_Model(head_name=head_name), lr=0.02)
    roles = _roles(groups)
    assert roles[f"{head_name}.weight"] == "lm_head"
    assert roles["block.output.weight"] == "matrix"  # a hidden layer named output stays a matrix
    assert roles["embed.weight"] == "embedding" and roles["norm.weight"] == "vector"
    head = next(g for g in groups if g["role"] == "lm_head")
    assert head["lr"] == pytest.approx(0.02 / 4.0)  # d_in = 16
    assert all("lr" not in g for g in groups if g["role"] != "lm_head")
    dion3.Dion3(groups, lr=0.02)


@pytest.mark.parametrize("head_name", ["head", "output"])
def test_param_groups_find_a_top_level_head_through_wrappers(head_name):
    # torch.compile's _orig_mod, DDP's and AveragedModel's module: the model's top level is below.
    model = _Model(head_name=head_name)
    for wrapped, prefix in [(torch.compile(model), "_orig_mod."), (torch.optim.swa_utils.AveragedModel(model), "module.")]:
        roles = _roles(dion3.param_groups(wrapped, lr=0.02))
        assert roles[f"{prefix}{head_name}.weight"] == "lm_head", prefix
        assert roles[f"{prefix}block.output.weight"] == "matrix", prefix


def test_param_groups_tied_head_is_an_embedding_and_lr_is_asked_for():
    groups = dion3.param_groups(_Model(tie=True), lr=0.02)
    roles = _roles(groups)
    assert roles["embed.weight"] == "embedding" and "lm_head" not in roles.values()
    with pytest.warns(UserWarning, match="pass lr="):
        dion3.param_groups(_Model())


def test_param_groups_call_vectors_in_a_matrix_shape_vectors():
    # Fewer than two dimensions above 1: a class token, weight_norm's gains, a one-output head.
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.cls_token = torch.nn.Parameter(torch.zeros(1, 1, 8))
            self.pos_embed = torch.nn.Parameter(torch.zeros(1, 5, 8))
            self.gain = torch.nn.Parameter(torch.ones(8, 1))
            self.proj = torch.nn.Linear(8, 8)
            self.conv1x1 = torch.nn.Conv2d(8, 4, 1, bias=False)
            self.score = torch.nn.Linear(8, 1, bias=False)

    roles = _roles(dion3.param_groups(M(), lr=0.02))
    assert roles["cls_token"] == roles["gain"] == roles["score.weight"] == "vector"
    assert roles["proj.weight"] == roles["conv1x1.weight"] == "matrix"
    assert roles["pos_embed"] == "embedding"  # a bare table named as one


def test_param_groups_recognise_what_real_models_hold():
    # Per-expert bias tables and a relative position bias table are biases, whatever their shape; a
    # top-level classifier is a head; embeddings= adds tables to the nn.Embedding ones; a tied head
    # can be named by its module's path.
    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.zeros(4, 8, 16))
            self.gate_up_proj_bias = torch.nn.Parameter(torch.zeros(4, 16))

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = torch.nn.Embedding(10, 8)
            self.latents = torch.nn.Parameter(torch.zeros(6, 8))
            self.experts = Experts()
            self.relative_position_bias_table = torch.nn.Parameter(torch.zeros(49, 4))
            self.block = torch.nn.Linear(8, 8)
            self.classifier = torch.nn.Linear(8, 3)

    class Embed(torch.nn.Module):  # TransformerLens's tables: bare Parameters in modules named so
        def __init__(self, shape, name):
            super().__init__()
            self.register_parameter(name, torch.nn.Parameter(torch.zeros(shape)))

    lens = torch.nn.Module()
    lens.embed, lens.pos_embed = Embed((10, 8), "W_E"), Embed((6, 8), "W_pos")
    lens.unembed = Embed((8, 10), "W_U")
    roles = _roles(dion3.param_groups(lens, lr=0.02))
    assert roles["embed.W_E"] == roles["pos_embed.W_pos"] == "embedding"
    assert roles["unembed.W_U"] == "matrix"
    roles = _roles(dion3.param_groups(M(), lr=0.02, embeddings="latents"))
    assert roles["experts.gate_up_proj"] == roles["block.weight"] == "matrix"
    assert roles["experts.gate_up_proj_bias"] == roles["relative_position_bias_table"] == "vector"
    assert roles["tok.weight"] == roles["latents"] == "embedding"
    assert roles["classifier.weight"] == roles["classifier.bias"] == "lm_head"

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = torch.nn.Embedding(10, 8)
            self.body = torch.nn.Linear(8, 8)
            self.lm_head = torch.nn.Linear(8, 10, bias=False)
            self.lm_head.weight = self.embed_tokens.weight

    groups = dion3.param_groups(Tied(), lm_head="lm_head", lr=0.02)
    assert _roles(groups)["embed_tokens.weight"] == "lm_head"
    assert next(g["lr"] for g in groups if g["role"] == "lm_head") == pytest.approx(0.02 / 8 ** 0.5)
    with pytest.raises(ValueError, match="no parameter or module of the model matches 'head'"):
        dion3.param_groups(Tied(), lm_head="head", lr=0.02)
    # A module or tensor that is not the model's own (a copy, or one from before to_empty) is
    # refused too, rather than selecting nothing and leaving the head in the matrix group.
    model, stale = Tied(), Tied()
    for selector in (stale.lm_head, stale.lm_head.weight, torch.randn(3)):
        with pytest.raises(ValueError, match="given as a selector is not \\(all\\) of the model's parameters"):
            dion3.param_groups(model, lm_head=selector, lr=0.02)
    with pytest.raises(ValueError, match="the Identity given as a selector has no parameters"):
        dion3.param_groups(model, lm_head=torch.nn.Identity(), lr=0.02)
    assert _roles(dion3.param_groups(model, lm_head=model.lm_head, lr=0.02))["embed_tokens.weight"] == "lm_head"
    # Overrides may name the tied head by its own name too, as selectors may.
    groups = dion3.param_groups(model, lm_head="lm_head", lr=0.02, overrides={"lm_head.weight": {"lr": 0.5}})
    assert next(g["lr"] for g in groups if "embed_tokens.weight" in g["param_names"]) == 0.5


@pytest.mark.parametrize("module,argv,error", [
    ("benchmark", ["--optimizers", "Foo"], "'Foo' is none of Dion3"),
    ("benchmark", ["--fractions", "0.5,2"], r"2 is not in \(0, 1\]"),
    ("benchmark", ["--warmup", "0"], "--warmup: must be at least 1"),
    ("benchmark", ["--dtype", "float64"], "invalid choice"),
    ("benchmark", ["--device", "foo"], "--device foo: Expected one of cpu"),
    ("dist_benchmark", ["--layouts", "ddp,bogus"], "'bogus' is none of local, ddp"),
    ("dist_benchmark", [], "run it under torchrun"),
    ("__main__", ["--bogus"], "unrecognized arguments"),
])
def test_command_lines_refuse_bad_arguments_with_usage(module, argv, error, capsys, monkeypatch):
    import importlib
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as e:
        importlib.import_module(f"dion3.{module}").main(argv)
    assert e.value.code == 2
    assert re.search(error, capsys.readouterr().err)


def test_the_cuda_graph_wrapper_copies_and_pickles_as_itself():
    import copy
    import pickle

    from dion3.cuda_graph import CudaGraphOptimizer
    p = torch.nn.Parameter(torch.randn(8, 8))
    opt = CudaGraphOptimizer(dion3.Dion3([p]), warmup_steps=3)
    torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)  # patches opt.step, bound to opt
    for twin in (copy.copy(opt), copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert type(twin) is CudaGraphOptimizer and twin.warmup_steps == 3 and not twin.captured
        assert twin.step.__self__ is twin  # its own step, not the original's


def test_hooks_registered_on_the_cuda_graph_wrapper_run():
    # Its eager warm-up steps run on the CPU too; torch.optim's hook signatures.
    from dion3.cuda_graph import CudaGraphOptimizer
    p = torch.nn.Parameter(torch.randn(8, 8))
    opt = CudaGraphOptimizer(dion3.Dion3([p]), warmup_steps=10)
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append(("pre", o is opt)))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append(("post", o is opt)))
    opt.register_state_dict_pre_hook(lambda o: calls.append(("sd pre", o is opt)))
    opt.register_state_dict_post_hook(lambda o, sd: dict(sd, tagged=True))
    opt.register_load_state_dict_pre_hook(lambda o, sd: {k: v for k, v in sd.items() if k != "tagged"})
    opt.register_load_state_dict_post_hook(lambda o: calls.append(("load post", o is opt)))
    for _ in range(2):
        p.grad = torch.randn(8, 8)
        opt.step()
    saved = opt.state_dict()
    assert saved["tagged"]
    opt.load_state_dict(saved)  # the pre-hook takes the tag out again
    assert calls == [("pre", True), ("post", True)] * 2 + [("sd pre", True), ("load post", True)]


@pytest.mark.parametrize("kwargs,error", [
    (dict(elementwise="sgd"), "elementwise must be 'adamw' or 'lion', got 'sgd'"),
    (dict(elementwise_options={"params": []}), "elementwise_options may not set params"),
    (dict(overrides={"body.weight": 0.1}), "overrides must map name patterns to dicts"),
    (dict(overrides=[{"body.weight": {}}]), "overrides must map name patterns to dicts"),
])
def test_param_groups_refuses_settings_it_cannot_use(kwargs, error):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    with pytest.raises((ValueError, TypeError), match=error):
        dion3.param_groups(model, **kwargs)


@pytest.mark.parametrize("cls", [dion3.Muon, dion3.NorMuon])
def test_ema_momentum_given_to_the_constructor_leaves_the_elementwise_groups_alone(cls):
    # The constructor's value reaches every group; the AdamW group steps as without it.
    def run(ema):
        torch.manual_seed(0)
        w, b = torch.nn.Parameter(torch.randn(8, 12)), torch.nn.Parameter(torch.randn(8))
        opt = cls([dict(params=[w]), dict(params=[b], algorithm="adamw")], lr=0.02, ema_momentum=ema)
        for t in range(3):
            w.grad, b.grad = torch.randn(8, 12), torch.randn(8)
            opt.step()
        return w.detach(), b.detach()

    (w0, b0), (w1, b1) = run(False), run(True)
    assert torch.equal(b0, b1) and not torch.equal(w0, w1)
    # Ignored by an element-wise group, the value is still checked there.
    with pytest.raises(ValueError, match="'ema_momentum' must be True or False"):
        cls([dict(params=[torch.nn.Parameter(torch.randn(8))], algorithm="adamw", ema_momentum="yes")])
    # A Dion3 group has no averaged form: refused, as the C++ engine does.
    with pytest.raises(ValueError, match="'ema_momentum' is a setting of muon and normuon"):
        cls([dict(params=[torch.nn.Parameter(torch.randn(8, 12))], algorithm="dion3")], ema_momentum=True)


@pytest.mark.parametrize("key", ["lr", "fraction", "mu", "weight_decay", "epsilon"])
def test_a_number_given_as_a_string_is_refused(key):
    # A config file's "1e-3" would step, then fail in a scheduler's arithmetic far from the cause.
    w = torch.nn.Parameter(torch.randn(8, 12))
    with pytest.raises(ValueError, match=f"'{key}' must be a number; got the string '0.5'"):
        dion3.Dion3([w], **{key: "0.5"})
    opt = dion3.Dion3([w])
    opt.param_groups[0][key] = "0.5"
    w.grad = torch.randn(8, 12)
    before = w.detach().clone()
    with pytest.raises(ValueError, match="must be a number"):
        opt.step()
    assert torch.equal(w.detach(), before)
    # After a step, where a change of the lr or the weight decay alone takes a shorter path.
    opt.param_groups[0][key] = 0.02
    opt.step()
    before = w.detach().clone()
    for bad, message in (("0.5", f"parameter group 0: '{key}' must be a number"),
                         (math.nan, f"parameter group 0: '{key}' must .*, got nan")):
        opt.param_groups[0][key] = bad
        with pytest.raises(ValueError, match=message):
            opt.step()
        assert torch.equal(w.detach(), before)


def test_a_scheduled_lr_alone_reaches_the_engine():
    # A step whose only change is the lr or the weight decay (a scheduler's) moves the weights as
    # an optimizer built with those values does.
    torch.manual_seed(0)
    w, v = (torch.nn.Parameter(torch.randn(8, 12)) for _ in range(2))
    v.data.copy_(w.data)
    a, b = dion3.Dion3([w], lr=0.02, weight_decay=0.1), dion3.Dion3([v], lr=0.02, weight_decay=0.1)
    for step, (lr, wd) in enumerate([(0.02, 0.1), (0.01, 0.1), (0.01, 0.3), (0.005, 0.0)]):
        a.param_groups[0].update(lr=lr, weight_decay=wd)
        b.param_groups[0].update(lr=lr, weight_decay=wd)
        w.grad = torch.randn(8, 12)
        v.grad = w.grad.clone()
        a.step()
        b._pushed = {}  # b builds its whole config at every step
        b.step()
        assert torch.equal(w, v), step
    # Another setting rewritten beside the lr with an equal value of another type (True == 1) is
    # read again, and refused as the full path refuses it.
    a.param_groups[0].update(num_heads=1)
    a.step()
    a.param_groups[0].update(lr=0.001, num_heads=True)
    with pytest.raises(ValueError, match="'num_heads' must be a positive integer"):
        a.step()


def test_param_groups_flatten_convolutions_only():
    # A convolution is one (out, in * kernel) matrix; an expert stack stays a stack.
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 16, 3)
            self.pointwise = torch.nn.Conv2d(16, 8, 1, bias=False)
            self.experts = torch.nn.Parameter(torch.randn(4, 8, 6))
            self.proj = torch.nn.Linear(8, 8)

    torch.manual_seed(0)
    m = M()
    groups = dion3.param_groups(m, lr=0.02)
    flat = {n for g in groups if g.get("flatten") for n in g["param_names"]}
    assert flat == {"conv.weight", "pointwise.weight"}
    opt = dion3.Muon(groups, lr=0.02)
    before = m.pointwise.weight.detach().clone()
    for p in m.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    assert sorted((b["count"], b["rows"], b["cols"]) for b in opt.plan()) == [(1, 8, 8), (1, 8, 16), (1, 16, 27),
                                                                              (4, 8, 6)]
    # Not signSGD: the 1x1 convolution's update is its (8 x 16) gradient orthogonalized, so its
    # elements move by different amounts.
    moved = (m.pointwise.weight.detach() - before).abs().flatten()
    assert moved.max() > 2 * moved.min()
    # Channels-last convolutions: the groups are accepted (flatten=True steps them in memory order).
    cl = M().to(memory_format=torch.channels_last)
    dion3.Dion3(dion3.param_groups(cl, lr=0.02))
    # A parametrized convolution: its original weights are flattened, and building the groups
    # computes no parametrization (spectral_norm's power iteration would move its vector u).
    from torch.nn.utils import parametrizations
    sn = parametrizations.spectral_norm(torch.nn.Conv2d(16, 8, 1, bias=False))
    wn = parametrizations.weight_norm(torch.nn.Conv2d(16, 8, 3, bias=False))
    u = sn.parametrizations.weight[0]._u.clone()
    groups = dion3.param_groups(torch.nn.Sequential(sn, wn), lr=0.02)
    assert torch.equal(sn.parametrizations.weight[0]._u, u)
    flat = {n for g in groups if g.get("flatten") for n in g["param_names"]}
    assert flat == {"0.parametrizations.weight.original", "1.parametrizations.weight.original1"}


def test_param_groups_may_name_a_frozen_head():
    # Named while frozen (by name, glob or override): accepted, and left out like every frozen tensor.
    m = _Model()
    m.lm_head.weight.requires_grad_(False)
    groups = dion3.param_groups(m, lm_head="lm_head", overrides={"lm_head.weight": {"lr": 1e-3}}, lr=0.02)
    assert "lm_head.weight" not in _roles(groups)


@pytest.mark.parametrize("norm", ["weight_norm", "spectral_norm"])
def test_param_groups_find_a_parametrized_head_and_scale_it_by_its_input_width(norm):
    # The head's weight is registered as parametrizations.weight.original(0/1): still the head's,
    # with its bias, at lr / sqrt(d_in) (weight_norm's (out, 1) gain is no input width).
    from torch.nn.utils import parametrizations
    m = _Model()
    m.lm_head = getattr(parametrizations, norm)(torch.nn.Linear(16, 50))
    groups = dion3.param_groups(m, lr=0.02)
    head = [g for g in groups if g["role"] == "lm_head"]
    assert len(head) == 1 and head[0]["lr"] == pytest.approx(0.02 / 4.0)
    assert {n for n in head[0]["param_names"]} == {n for n, _ in m.lm_head.named_parameters(prefix="lm_head")}


def test_param_groups_scale_a_head_bias_whose_weight_is_frozen():
    m = _Model()
    m.lm_head = torch.nn.Linear(16, 50)
    m.lm_head.weight.requires_grad_(False)
    groups = dion3.param_groups(m, lr=0.02)
    (head,) = [g for g in groups if g["role"] == "lm_head"]
    assert head["param_names"] == ["lm_head.bias"] and head["lr"] == pytest.approx(0.02 / 4.0)


def test_param_group_selectors_name_parameters_and_refuse_what_selects_nothing_meant():
    tied = _Model(tie=True)
    roles = _roles(dion3.param_groups(tied, lm_head="lm_head.weight", lr=0.02))
    assert roles["embed.weight"] == "lm_head"  # the tied weight, named by the head's parameter name
    with pytest.raises(ValueError, match="an empty name selects no module or parameter"):
        dion3.param_groups(_Model(), lm_head="", lr=0.02)
    with pytest.raises(ValueError, match="an empty name selects no module or parameter"):
        dion3.param_groups(_Model(), embeddings=[""], lr=0.02)
    with pytest.raises(TypeError, match="cannot select parameters with int"):
        dion3.param_groups(_Model(), lm_head=3, lr=0.02)


def test_param_groups_include_frozen_layers_that_unfreeze_later():
    # Left out by default (a frozen base model stays outside the optimizer); with include_frozen a
    # layer unfrozen during training trains from then on, its state made at its first step.
    m = _Model()
    m.block.attn.weight.requires_grad_(False)
    assert "block.attn.weight" not in _roles(dion3.param_groups(m, lr=0.02))
    groups = dion3.param_groups(m, lr=0.02, include_frozen=True)
    assert _roles(groups)["block.attn.weight"] == "matrix"
    opt = dion3.Dion3(groups, lr=0.02)
    assert not opt.state.get(m.block.attn.weight)
    m.block.attn.weight.requires_grad_(True)
    before = m.block.attn.weight.detach().clone()
    for p in m.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    assert opt.state[m.block.attn.weight]["step"] == 1 and not torch.equal(m.block.attn.weight, before)


def test_param_groups_give_each_head_its_own_lr_and_find_embedding_bags():
    # Two heads of other input widths learn at lr / sqrt(their own d_in), each bias with its weight;
    # an nn.EmbeddingBag table is an embedding, not a matrix to orthogonalize.
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bag = torch.nn.EmbeddingBag(50, 16)
            self.lm_head = torch.nn.Linear(64, 10)
            self.aux = torch.nn.ModuleDict(dict(lm_head=torch.nn.Linear(4, 10)))

    m = M()
    groups = dion3.param_groups(m, lr=0.01)
    lr = {n: g["lr"] for g in groups if g["role"] == "lm_head" for n in g["param_names"]}
    assert lr == pytest.approx({"lm_head.weight": 0.01 / 8, "lm_head.bias": 0.01 / 8,
                                "aux.lm_head.weight": 0.01 / 2, "aux.lm_head.bias": 0.01 / 2})
    assert _roles(groups)["bag.weight"] == "embedding"
    m.lm_head.weight.requires_grad_(False)  # a frozen head weight: its bias keeps the head's lr
    lr = {n: g["lr"] for g in dion3.param_groups(m, lr=0.01) if g["role"] == "lm_head" for n in g["param_names"]}
    assert lr["lm_head.bias"] == pytest.approx(0.01 / 8)


def test_plan_names_each_megabatchs_group_by_its_param_groups_index():
    # The engine leaves out groups without parameters to step; the plan maps back.
    p, q = (torch.nn.Parameter(torch.randn(8, 16)) for _ in range(2))
    opt = dion3.Dion3([dict(params=[p]), dict(params=[]), dict(params=[q], fraction=0.5)])
    p.grad, q.grad = torch.randn(8, 16), torch.randn(8, 16)
    opt.step()
    assert sorted((mb["group"], mb["selected_rows"]) for mb in opt.plan()) == [(0, 2), (2, 4)]
