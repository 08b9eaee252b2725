"""replace_norms (layernorm_ext/replace.py): which modules it replaces, that it keeps the Parameter objects, and
that a model's outputs and gradients after it stay within the suite's accuracy rule of the original's.

The third-party norms are written here the way model libraries write them (no dependency on any): Llama's
RMSNorm (float32 statistics, cast back before the weight multiply: ``cast_before_weight``), T5's LayerNorm (an
RMSNorm), Gemma's RMSNorm (``1 + weight``: ``weight_offset=1``), and a LayerNorm subclass with its own forward
(not ours to reproduce).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
from torch import Tensor, nn

from conftest import assert_no_worse_than_aten
from layernorm_ext import FusedLayerNorm, FusedRMSNorm, replace_norms

D = 16


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.variance_epsilon = eps

    def forward(self, hidden_states: Tensor) -> Tensor:
        dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(dtype)


class T5LayerNorm(LlamaRMSNorm):
    pass


class GemmaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: Tensor) -> Tensor:
        out = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


class ScaledLayerNorm(nn.LayerNorm):
    """A subclass that changed forward: it must not be taken for an nn.LayerNorm."""

    def forward(self, x: Tensor) -> Tensor:
        return 2 * super().forward(x)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.rms = nn.RMSNorm(D, eps=1e-6)
        self.llama = LlamaRMSNorm(D)
        self.t5 = T5LayerNorm(D)
        self.gemma = GemmaRMSNorm(D)
        self.scaled = ScaledLayerNorm(D)
        self.proj = nn.Linear(D, D)
        self.bn = nn.BatchNorm1d(D)
        self.no_affine = nn.LayerNorm(D, elementwise_affine=False)

    def forward(self, x: Tensor) -> Tensor:
        y = self.ln(x)
        y = self.proj(self.rms(y)) + self.llama(x)
        y = self.t5(y) + self.gemma(y) + self.scaled(y)
        return self.no_affine(y)


def _model(dtype: torch.dtype = torch.float32) -> Block:
    torch.manual_seed(0)
    model = Block()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    return model.to(dtype)


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_what_is_replaced_and_what_is_left() -> None:
    model = _model()
    report = replace_norms(model)
    replaced = {name: new for name, _, new in report.replaced}
    # float32 weights: the probe runs float32 rows, where Llama's cast changes nothing (ATen's order is kept).
    assert replaced == {"ln": "FusedLayerNorm", "rms": "FusedRMSNorm", "llama": "FusedRMSNorm",
                        "t5": "FusedRMSNorm", "gemma": "FusedRMSNorm(weight_offset=1)",
                        "no_affine": "FusedLayerNorm"}, report  # fmt: skip
    skipped = {name: why for name, _, why in report.skipped}
    assert "scaled" in skipped and "computes something else" in skipped["scaled"], report
    assert "bn" not in skipped and "proj" not in skipped, report
    assert isinstance(model.ln, FusedLayerNorm) and isinstance(model.llama, FusedRMSNorm)
    assert isinstance(model.gemma, FusedRMSNorm) and model.gemma.weight_offset == 1.0
    assert type(model.scaled) is ScaledLayerNorm
    assert model.llama.eps == 1e-6 and model.rms.eps == 1e-6
    assert "scaled: ScaledLayerNorm left alone" in str(report)


def test_parameters_and_state_dict_are_kept() -> None:
    model = _model()
    before = {name: p for name, p in model.named_parameters()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    replace_norms(model)
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    assert all(after[name] is p for name, p in before.items())
    assert model.state_dict().keys() == state.keys()
    # The optimizer built before the swap still trains the model's parameters.
    gen = torch.Generator().manual_seed(3)
    loss = (model(torch.randn(5, D, generator=gen)) * torch.randn(5, D, generator=gen)).sum()
    loss.backward()
    optimizer.step()
    assert not torch.equal(model.llama.weight, state["llama.weight"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_outputs_and_gradients_within_the_rule(dtype: torch.dtype) -> None:
    original = _model(dtype)
    reference = copy.deepcopy(original).double()
    ours = copy.deepcopy(original)
    replace_norms(ours)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(7, D, generator=gen).to(dtype)
    cotangent = torch.randn(7, D, generator=gen)
    results = []
    for model, inp in ((ours, x), (original, x), (reference, x.double())):
        inp = inp.clone().requires_grad_()
        out = model(inp)
        out.backward(cotangent.to(out.dtype))
        grads = [inp.grad] + [p.grad for p in model.parameters()]
        results.append([out.detach()] + grads)
    names = ["out", "x"] + [name for name, _ in ours.named_parameters()]
    for name, got, want, ref in zip(names, *results, strict=True):
        if name.startswith("bn."):  # not in the forward: no gradient
            assert got is None and want is None
            continue
        assert_no_worse_than_aten(got, want, ref, f"{dtype} {name}")


def test_include_exclude_and_root() -> None:
    model = _model()
    report = replace_norms(model, include=["l*", nn.RMSNorm], exclude=["llama"])
    assert {name for name, _, _ in report.replaced} == {"ln", "rms"}
    assert isinstance(model.rms, FusedRMSNorm) and type(model.llama) is LlamaRMSNorm

    norm = nn.LayerNorm(D)
    report = replace_norms(norm)
    assert isinstance(report.model, FusedLayerNorm) and report.model.weight is norm.weight


def test_modules_with_hooks_are_left_alone() -> None:
    model = _model()
    model.ln.register_forward_hook(lambda *_: None)
    report = replace_norms(model)
    assert type(model.ln) is nn.LayerNorm
    assert any(name == "ln" and "hooks" in why for name, _, why in report.skipped)


def test_replaced_model_compiles() -> None:
    model = _model()
    replace_norms(model)
    x = torch.randn(3, D)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), model(x))
    torch._dynamo.reset()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("cls", [LlamaRMSNorm, GemmaRMSNorm], ids=["llama", "gemma"])
def test_half_rms_norms_are_reproduced_in_their_order(cls: type[nn.Module], dtype: torch.dtype) -> None:
    """Llama casts the normalized rows to the input dtype before the weight multiply, Gemma multiplies by 1 + w in
    float32 first: the probe finds each one's numerics, and the replacement then matches the module bit for bit
    but where its float32 statistics round differently from ATen's (a few elements at most, by one ulp)."""
    torch.manual_seed(2)
    norm = cls(4096).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(4096) * 0.5 + (1.0 if cls is LlamaRMSNorm else 0.0))
    x = torch.randn(16, 4096).to(dtype) * 2 + 0.3
    want = norm(x)
    report = replace_norms(norm)
    expected = "FusedRMSNorm(cast_before_weight=True)" if cls is LlamaRMSNorm else "FusedRMSNorm(weight_offset=1)"
    assert report.replaced[0][2] == expected, report
    got = report.model(x)
    differ = got != want
    assert differ.sum().item() <= want.numel() // 1000, f"{differ.sum().item()} of {want.numel()} elements differ"
    ulp = torch.finfo(dtype).eps * want.double().abs()
    assert bool(((got.double() - want.double()).abs() <= ulp + 1e-30)[differ].all()), "a difference beyond 1 ulp"


def test_gemma_is_recognised_whatever_its_weights() -> None:
    """With trained weights of 8 or more, 1 + w is within bf16's rounding of w: the probe uses weights of its own,
    and finds 1 + w."""
    gemma = GemmaRMSNorm(64).bfloat16()
    with torch.no_grad():
        gemma.weight.fill_(8.0)
    report = replace_norms(nn.Sequential(gemma))
    assert report.replaced[0][2] == "FusedRMSNorm(weight_offset=1)", report
    assert torch.equal(gemma.weight, torch.full((64,), 8.0, dtype=torch.bfloat16))  # the probe left it alone


def test_a_tied_norm_stays_tied() -> None:
    norm = nn.LayerNorm(8)
    model = nn.Sequential(nn.Linear(8, 8), norm, nn.Linear(8, 8), norm)
    report = replace_norms(model)
    assert isinstance(model[1], FusedLayerNorm) and model[1] is model[3]
    assert [name for name, _, _ in report.replaced] == ["1"]


def test_one_pattern_alone_is_a_pattern() -> None:
    model = nn.Sequential()
    model.add_module("enc", nn.LayerNorm(8))
    model.add_module("dec", nn.LayerNorm(8))
    replace_norms(model, exclude="enc")
    assert type(model.enc) is nn.LayerNorm and isinstance(model.dec, FusedLayerNorm)
    model = nn.Sequential(nn.LayerNorm(8), nn.RMSNorm(8))
    replace_norms(model, include=nn.RMSNorm)
    assert type(model[0]) is nn.LayerNorm and isinstance(model[1], FusedRMSNorm)


def test_meta_third_party_norm_is_reported_not_probed() -> None:
    with torch.device("meta"):
        model = nn.Sequential(LlamaRMSNorm(8), nn.RMSNorm(8))
    report = replace_norms(model)
    assert isinstance(model[1], FusedRMSNorm) and model[1].weight.is_meta
    assert type(model[0]) is LlamaRMSNorm and "meta device" in report.skipped[0][2], report


def test_every_kind_of_hook_keeps_the_module() -> None:
    norm = nn.LayerNorm(8)
    norm.register_full_backward_pre_hook(lambda *_: None)
    report = replace_norms(nn.Sequential(norm))
    assert not report.replaced and "hooks" in report.skipped[0][2]


class ResidualRMSNorm(LlamaRMSNorm):
    """A norm whose forward takes more than the input (as flash-attn's does): not ours to stand in for."""

    def forward(self, hidden_states: Tensor, residual: Tensor | None = None, prenorm: bool = False) -> Tensor:
        return super().forward(hidden_states if residual is None else hidden_states + residual)


def test_a_forward_with_more_arguments_keeps_the_module() -> None:
    report = replace_norms(nn.Sequential(ResidualRMSNorm(8)))
    assert not report.replaced and "residual, prenorm" in report.skipped[0][2], report
