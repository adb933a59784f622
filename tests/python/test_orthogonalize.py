# test_orthogonalize.py — dion3.orthogonalize against the float64 transcription of algorithm.md §2
# (reference.py), for both methods, wide and tall matrices, batches and the dtypes; and its errors.
import pytest
import torch

import dion3
import reference as ref

TOL = {torch.float32: 2e-4, torch.bfloat16: 0.25, torch.float16: 0.05}  # max |diff| / max |ref|


def reference_polar(X, method, coefficients=ref.POLAR_EXPRESS, restarts=(2,)):
    f = ref.orth_gram if method == "gram" else ref.orth_standard
    kw = dict(restarts=restarts) if method == "gram" else {}
    return f(X.cpu(), coefficients, **kw) if X.dim() == 2 else torch.stack([f(x.cpu(), coefficients, **kw) for x in X])


@pytest.mark.parametrize("method", ["standard", "gram"])
@pytest.mark.parametrize("shape", [(24, 64), (64, 24), (3, 16, 40), (2, 32, 32)])
def test_matches_the_float64_reference(device, method, shape):
    g = torch.Generator().manual_seed(7)
    X = torch.randn(shape, generator=g).to(device)
    got = dion3.orthogonalize(X, method, iteration_dtype=torch.float32)
    assert got.shape == X.shape and got.dtype == X.dtype and got.device == X.device
    want = reference_polar(X.double(), method)
    err = (got.double().cpu() - want).abs().max() / want.abs().max()
    assert err < TOL[torch.float32], f"{method} {shape}: {err:.2e}"


@pytest.mark.parametrize("dtype, method", [(torch.bfloat16, "standard"), (torch.float16, "gram")])
def test_low_precision_inputs_and_iterations(device, dtype, method):
    g = torch.Generator().manual_seed(8)
    X = torch.randn(4, 32, 96, generator=g).to(device=device, dtype=dtype)
    got = dion3.orthogonalize(X, method, iteration_dtype=dtype)
    assert got.dtype == dtype
    want = reference_polar(X.double(), method)
    err = (got.double().cpu() - want).abs().max() / want.abs().max()
    assert err < TOL[dtype], f"{dtype}: {err:.2e}"


def test_gram_does_not_iterate_in_bfloat16(device):
    # Its rounding noise along directions the input does not span would grow past order 1 with
    # the default coefficients (OrthConfig::max_gram_growth): refused, naming the fixes.
    X = torch.randn(4, 32, 96).to(device=device, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="Gram Newton-Schulz in bfloat16.*iterate in float32"):
        dion3.orthogonalize(X, "gram", iteration_dtype=torch.bfloat16)
    assert dion3.orthogonalize(X, iteration_dtype=torch.bfloat16).dtype == torch.bfloat16  # auto: standard


def test_coefficients_restarts_and_auto(device):
    X = torch.randn(16, 48, generator=torch.Generator().manual_seed(9)).to(device)
    f32 = dict(iteration_dtype=torch.float32)  # the GPU's default iterates in 16 bits
    you = dion3.orthogonalize(X, "standard", use_polar_express=False, **f32)
    assert torch.allclose(you.double().cpu(), reference_polar(X.double(), "standard", ref.YOU), atol=2e-4)
    norestart = dion3.orthogonalize(X, "gram", restarts=[], **f32)
    assert torch.allclose(norestart.double().cpu(), reference_polar(X.double(), "gram", restarts=()), atol=2e-4)
    auto = dion3.orthogonalize(X, **f32)  # either method: both equal the reference in exact arithmetic
    assert torch.allclose(auto.double().cpu(), reference_polar(X.double(), "standard"), atol=2e-3)
    # Singular values land in the Polar Express band around 1.
    s = torch.linalg.svdvals(auto.double().cpu())
    assert s.min() > 0.7 and s.max() < 1.3


def test_errors(device):
    with pytest.raises(ValueError, match="2 or 3 dimensions"):
        dion3.orthogonalize(torch.randn(2, 2, 2, 2, device=device))
    with pytest.raises(ValueError, match="float64"):
        dion3.orthogonalize(torch.randn(4, 4, dtype=torch.float64, device=device))
    with pytest.raises(ValueError, match="'orthogonalizer' must be"):
        dion3.orthogonalize(torch.randn(4, 4, device=device), "svd")
    with pytest.raises(ValueError, match="'coefficients'"):
        dion3.orthogonalize(torch.randn(4, 4, device=device), coefficients=[(1e30, 0, 0)])
    assert dion3.orthogonalize(torch.randn(0, 4, 4, device=device)).shape == (0, 4, 4)


def test_a_lazily_negated_view_reads_as_its_values_and_a_fake_tensor_is_refused(device):
    X = torch.randn(4, 8, device=device)
    neg = torch._neg_view(X)  # what .conj().imag of a complex tensor gives: the neg bit, not values
    assert neg.is_neg()
    assert torch.equal(dion3.orthogonalize(neg), dion3.orthogonalize(-X))
    if device == "cpu":  # FakeTensorMode reports the CPU: nothing to read, refused (it crashed)
        from torch._subclasses.fake_tensor import FakeTensorMode
        with FakeTensorMode():
            fake = torch.empty(4, 8)
        with pytest.raises(ValueError, match="has no data"):
            dion3.orthogonalize(fake)


# The reference package's default set, as it runs there: X / (1.02 |X|_F + eps), then five
# quintic steps of the Polar Express set with a 2% safety factor (float64 here).
REFERENCE_RAW = [
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]


def reference_package_polar(X):
    X = X.double().cpu()
    tall = X.shape[0] > X.shape[1]
    X = X.T if tall else X
    X = X / (X.norm() * 1.02 + 1e-6)
    for a, b, c in REFERENCE_RAW:
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


@pytest.mark.parametrize("method", ["standard", "gram"])
@pytest.mark.parametrize("shape", [(32, 64), (64, 32)])
def test_the_reference_packages_set_by_name(device, method, shape):
    g = torch.Generator().manual_seed(3)
    X = torch.randn(shape, generator=g)
    got = dion3.orthogonalize(X.to(device), method, coefficients="reference", iteration_dtype=torch.float32)
    want = reference_package_polar(X)
    assert (got.double().cpu() - want).abs().max() / want.abs().max() < TOL[torch.float32]
    # It is another polynomial than the default: the two results differ by about a tenth.
    ours = dion3.orthogonalize(X.to(device), method, iteration_dtype=torch.float32).double().cpu()
    rel = ((ours - want).norm() / want.norm()).item()
    assert 0.05 < rel < 0.2, rel


def test_an_unknown_coefficient_set_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="names one of polar_express, you, reference"):
        dion3.orthogonalize(torch.randn(4, 8), coefficients="polar")
    p = torch.nn.Parameter(torch.randn(8, 4))
    with pytest.raises(ValueError, match="'coefficients' names one of"):
        dion3.Dion3([p], coefficients="quintic")
    dion3.Dion3([p], coefficients="reference")  # accepted


def test_short_coefficient_lists_take_the_default_restarts_they_reach():
    # The default restart position (2) lies past one- and two-step lists: it is dropped, not
    # refused as a setting the caller never gave; a restart the caller gives is still checked.
    cubic = (1.5, -0.5, 0.0)
    X = torch.randn(6, 10, dtype=torch.float64).float()
    for steps in (1, 2):
        for method in ("standard", "gram"):
            got = dion3.orthogonalize(X, method, coefficients=[cubic] * steps, iteration_dtype=torch.float32)
            Y = X.double() / X.double().norm()
            for _ in range(steps):
                Y = 1.5 * Y - 0.5 * (Y @ Y.T) @ Y
            assert (got.double() - Y).abs().max() < 1e-5
        p = torch.nn.Parameter(torch.randn(8, 4))
        opt = dion3.Dion3([p], coefficients=[cubic] * steps)
        p.grad = torch.randn(8, 4)
        opt.step()
    with pytest.raises(ValueError, match=r"'restarts' positions must lie in \[0, 1\), got 2"):
        dion3.orthogonalize(X, coefficients=[cubic], restarts=[2])
