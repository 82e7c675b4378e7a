"""Input-injection schemes: how the prelude output enters each recurrence (design §2).

Every scheme implements one small interface:

- `prepare(e)` -> q: the per-forward injected quantity, computed once from the prelude output
  (for the diagonal schemes q = dt * (W e~), the injected vector of design §2 / paper 4.2);
- `forward(s, q)` -> s': the injection at the core entrance of one recurrence;
- `exit(s)` -> s: applied after the core: the exit norm of `cfg.exit_norm` (design §14; "auto" is
  the scheme's own: Huginn-Linear's gain-free RMSNorm, none for the others);
- `qkv_offsets(e)` -> per-core-layer additive (dQ, dK, dV) or None (only DEQ-QKV uses it);
- `carryover(s, q)` -> the part of s' that comes from s (carryover diagnostics, design §11), so
  that s' = carryover(s, q) + q for every scheme but DEQ-QKV and "none".
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from looplm.config import ALL_INJECTIONS, ModelConfig
from looplm.model.blocks import RMSNorm


def _inv_softplus(y: float) -> float:
    return math.log(math.expm1(y))


class Injection(nn.Module):
    """Base class: additive injection s' = s + e (the plain baseline)."""

    exit_norm_kind = "none"
    """The exit norm `cfg.exit_norm="auto"` resolves to for this scheme."""

    def __init__(self):
        super().__init__()
        self.exit_norm: RMSNorm | None = None  # set by build_injection from cfg.exit_norm

    def prepare(self, e: torch.Tensor) -> torch.Tensor:
        return e

    def forward(self, s: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return self.carryover(s, q) + q

    def exit(self, s: torch.Tensor) -> torch.Tensor:
        return s if self.exit_norm is None else self.exit_norm(s)

    def qkv_offsets(self, e: torch.Tensor) -> list | None:
        return None

    def carryover(self, s: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return s

    def reset_parameters(self) -> None:
        pass


class Additive(Injection):
    """s' = s + e: the plain additive baseline."""


class NoInjection(Injection):
    """s' = s: the input enters only through the initial state (Ouro: s0 = e, `state_init="input"`)."""

    def forward(self, s, q):
        return s

    def prepare(self, e):
        return e


class ParcaeDiagonal(Injection):
    """Diagonal retention: s' = exp(-dt*a) * s + dt * (W e~) (design §2, parcae-decay / parcae-nonorm).

    dt = softplus(dt_raw), a = exp(A_log), W identity-initialised and bias-free. `prelude_norm`
    makes e~ = RMSNorm(e) with a learned gain (Parcae-Decay); otherwise e~ = e.
    """

    def __init__(self, cfg: ModelConfig, *, prelude_norm: bool, dt_init: float):
        super().__init__()
        d = cfg.d_model
        self.dt_init = dt_init
        self.dt_raw = nn.Parameter(torch.empty(d))
        self.A_log = nn.Parameter(torch.empty(d))
        self.W = nn.Linear(d, d, bias=False)
        self.prelude_norm = RMSNorm(d, cfg.norm_eps) if prelude_norm else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.dt_raw.fill_(_inv_softplus(self.dt_init))
            self.A_log.zero_()
            self.W.weight.copy_(torch.eye(self.W.weight.shape[0]))
            if self.prelude_norm is not None:
                self.prelude_norm.weight.fill_(1.0)

    def dt(self) -> torch.Tensor:
        return F.softplus(self.dt_raw)

    def decay(self) -> torch.Tensor:
        return torch.exp(-self.dt() * torch.exp(self.A_log))

    def prepare(self, e):
        e_tilde = self.prelude_norm(e) if self.prelude_norm is not None else e
        return self.dt().to(e.dtype) * self.W(e_tilde)

    def carryover(self, s, q):
        return self.decay().to(s.dtype) * s


class OrthoInj(ParcaeDiagonal):
    """OrthoInj (design §2, paper 4.2): r = decay*s, u = dt*(W e); s' = (r - alpha u) + u,
    alpha = <r,u>/(|u|^2 + eps) per token in fp32, so the component of s' along u is u (eps = 0)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, prelude_norm=False, dt_init=0.5 * math.log(5.0))
        self.eps = cfg.ortho_eps

    def carryover(self, s, q):
        return project_off(super().carryover(s, q), q, self.eps)


def project_off(r: torch.Tensor, u: torch.Tensor, eps: float) -> torch.Tensor:
    """r - alpha*u with alpha = <r,u>/(|u|^2 + eps), inner products in fp32 (design §2)."""
    r32, u32 = r.float(), u.float()
    alpha = (r32 * u32).sum(-1, keepdim=True) / (u32.pow(2).sum(-1, keepdim=True) + eps)
    return (r32 - alpha * u32).type_as(r)


class HuginnLinear(Injection):
    """s' = A [s; e] + b with A in R^{d x 2d} (std 0.02), b = 0; by default ("auto") a parameter-free
    exit RMSNorm follows the core (the paper's variant; Huginn-0125 has none: exit_norm="none")."""

    exit_norm_kind = "rms"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.d_model
        self.A_state = nn.Linear(d, d, bias=False)  # the s half of A
        self.A_input = nn.Linear(d, d, bias=True)  # the e half of A, and b
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for lin in (self.A_state, self.A_input):
            nn.init.trunc_normal_(lin.weight, std=0.02, a=-0.06, b=0.06)
        nn.init.zeros_(self.A_input.bias)

    def prepare(self, e):
        return self.A_input(e)  # computed once per forward

    def carryover(self, s, q):
        return self.A_state(s)


class DeqQKV(Injection):
    """DEQ-QKV (design §2, paper B.4): no entrance injection (s' = s); each core attention adds
    bias-free Gaussian-initialised projections of e to Q, K and V, shared across recurrences."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, hd = cfg.d_model, cfg.head_dim
        self.proj = nn.ModuleList(
            nn.ModuleDict(
                {
                    "q": nn.Linear(d, cfg.n_heads * hd, bias=False),
                    "k": nn.Linear(d, cfg.n_kv_heads * hd, bias=False),
                    "v": nn.Linear(d, cfg.n_kv_heads * hd, bias=False),
                }
            )
            for _ in range(cfg.n_core)
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for layer in self.proj:
            for lin in layer.values():
                nn.init.normal_(lin.weight, std=0.02)

    def forward(self, s, q):
        return s

    def qkv_offsets(self, e):
        return [(p["q"](e), p["k"](e), p["v"](e)) for p in self.proj]


def build_injection(cfg: ModelConfig) -> Injection:
    """The injection scheme named by `cfg.injection`, with the exit norm of `cfg.exit_norm`."""
    inj = _scheme(cfg)
    kind = inj.exit_norm_kind if cfg.exit_norm == "auto" else cfg.exit_norm
    if kind != "none":
        inj.exit_norm = RMSNorm(cfg.d_model, cfg.norm_eps, gain=kind == "rms-gain")
    return inj


def _scheme(cfg: ModelConfig) -> Injection:
    name = cfg.injection
    if name == "parcae-decay":
        return ParcaeDiagonal(cfg, prelude_norm=True, dt_init=0.5 * math.log(5.0))
    if name == "parcae-nonorm":
        return ParcaeDiagonal(cfg, prelude_norm=False, dt_init=1.0)
    if name == "ortho":
        return OrthoInj(cfg)
    if name == "huginn-linear":
        return HuginnLinear(cfg)
    if name == "deq-qkv":
        return DeqQKV(cfg)
    if name == "additive":
        return Additive()
    if name == "none":
        return NoInjection()
    raise ValueError(f"unknown injection {name!r}; choose one of {', '.join(ALL_INJECTIONS)}")
