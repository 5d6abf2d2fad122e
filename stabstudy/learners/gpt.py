"""A small GPT for stability studies, readable top to bottom (nanoGPT-style).

Token + position embeddings, pre-LayerNorm blocks (``post_ln``: post-LayerNorm, as in
the original Transformer) of causal self-attention and an MLP, a final LayerNorm and a
(tied or untied) output head. Two options from
Wortsman et al. 2023 ("Small-scale proxies for large-scale Transformer training
instabilities"):

* ``qk_layernorm``: LayerNorm on queries and keys (per head) before the dot
  product, which bounds attention-logit growth;
* ``z_loss``: an auxiliary loss ``coef * mean(log^2 Z)``, ``Z = sum_i exp(y_i)``
  over the output logits ``y``, which keeps ``log Z`` near 0 (output-logit
  divergence).

``GPT.forward(idx, targets, diagnostics=True)`` also returns cheap diagnostics of
that same forward pass (the attention is then computed explicitly instead of with
the fused kernel): the maximum attention logit ``max |q.k|/sqrt(d)`` overall and
per layer, the maximum absolute output logit, and the minimum attention entropy.
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass, field, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from stabstudy.hparams import GPTArch


@dataclass(frozen=True)
class GPTConfig(GPTArch):
    """Architecture of :class:`GPT`: the fields of :class:`~stabstudy.hparams.GPTArch` (shared with the
    ``lm`` learner's hyperparameters, documented there) and two the learner never changes."""

    vocab_size: int = 256
    """Number of token ids (256 for the byte-level corpus)."""
    bias: bool = True
    """Biases in Linear and LayerNorm layers."""

    @classmethod
    def from_hparams(cls, hp: dict, **extra: object) -> GPTConfig:
        """The config of the shared architecture fields of merged hyperparameters ``hp`` (cast to
        their declared types) and ``extra`` (``vocab_size``, ``bias``)."""
        types = typing.get_type_hints(GPTArch)  # Annotated ranges resolved to int / float / bool
        return cls(**{f.name: types[f.name](hp[f.name]) for f in fields(GPTArch)}, **extra)  # type: ignore[arg-type]


@dataclass
class GPTOutput:
    """What :meth:`GPT.forward` returns."""

    logits: torch.Tensor
    """Output logits, shape (batch, time, vocab)."""
    loss: torch.Tensor | None = None
    """Training objective: cross-entropy + z-loss (None without targets)."""
    ce: torch.Tensor | None = None
    """Cross-entropy alone (nats per token)."""
    zloss: torch.Tensor | None = None
    """The z-loss term (coefficient included)."""
    diag: dict[str, float] = field(default_factory=dict)
    """Diagnostics (empty unless ``diagnostics=True``)."""


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0, "n_head must divide n_embd"
        self.n_head, self.head_dim = cfg.n_head, cfg.n_embd // cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.q_ln = nn.LayerNorm(self.head_dim, bias=cfg.bias) if cfg.qk_layernorm else None
        self.k_ln = nn.LayerNorm(self.head_dim, bias=cfg.bias) if cfg.qk_layernorm else None
        self.dropout = cfg.dropout
        self.resid_drop = nn.Dropout(cfg.dropout)
        mask = torch.tril(torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool))
        self.register_buffer("mask", mask.view(1, 1, cfg.block_size, cfg.block_size), persistent=False)

    def forward(self, x: torch.Tensor, diag: dict | None = None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, self.head_dim).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hd)
        if self.q_ln is not None:
            q, k = self.q_ln(q), self.k_ln(k)
        if diag is None:  # fast path: fused kernel
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               dropout_p=self.dropout if self.training else 0.0)
        else:  # explicit attention, measured on the way
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
            mask = self.mask[:, :, :T, :T]
            with torch.no_grad():
                diag["attn_logit_max"] = float(att.detach().float().abs().masked_fill(~mask, 0).max())
            att = F.softmax(att.masked_fill(~mask, float("-inf")).float(), dim=-1).to(q.dtype)
            with torch.no_grad():
                p = att.detach().float()
                ent = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)  # (B, nh, T)
                # query 0 sees one key (entropy 0 by construction): leave it out
                diag["attn_entropy_min"] = float(ent[:, :, 1:].mean(dim=(0, 2)).min()) if T > 1 else 0.0
            att = F.dropout(att, self.dropout, self.training)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)
        self.post_ln = cfg.post_ln

    def forward(self, x: torch.Tensor, diag: dict | None = None) -> torch.Tensor:
        if self.post_ln:
            # the final ln_f then acts on an already normalised stream (at init nearly the identity)
            x = self.ln_1(x + self.attn(x, diag))
            return self.ln_2(x + self.mlp(x))
        x = x + self.attn(self.ln_1(x), diag)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer language model (see module docstring)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.wte.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nanoGPT init (N(0, 0.02), residual projections / sqrt(2 n_layer)), times ``init_scale``."""
        std = 0.02 * self.cfg.init_scale
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue  # LayerNorm weights stay 1, biases 0 (nn defaults)
            s = std / math.sqrt(2 * self.cfg.n_layer) if name.endswith("c_proj.weight") else std
            nn.init.normal_(p, 0.0, s)
        for m in self.modules():
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def num_params(self) -> int:
        """Number of distinct parameters (tied weights counted once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                diagnostics: bool = False) -> GPTOutput:
        """Logits for token ids ``idx`` (batch, time); loss when ``targets`` (batch, time) is given.

        With ``diagnostics=True`` the output's ``diag`` holds ``attn_logit_max`` (max over
        layers), ``attn_logit_max_l<i>`` per layer, ``attn_entropy_min`` (min over layers and
        heads of the mean attention entropy in nats, query 0 excluded) and ``out_logit_max``
        (max |logit|), measured on this very forward pass.
        """
        B, T = idx.shape
        assert T <= self.cfg.block_size, f"sequence length {T} > block_size {self.cfg.block_size}"
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        diag: dict[str, float] = {}
        for i, block in enumerate(self.blocks):
            d = {} if diagnostics else None
            x = block(x, d)
            if d is not None:
                diag[f"attn_logit_max_l{i}"] = d["attn_logit_max"]
                diag[f"attn_entropy_l{i}"] = d["attn_entropy_min"]
        logits = self.lm_head(self.ln_f(x))
        if diagnostics:
            n = self.cfg.n_layer
            diag["attn_logit_max"] = max(diag[f"attn_logit_max_l{i}"] for i in range(n))
            diag["attn_entropy_min"] = min(diag[f"attn_entropy_l{i}"] for i in range(n))
            diag["out_logit_max"] = float(logits.detach().float().abs().max())
        out = GPTOutput(logits=logits, diag=diag)
        if targets is not None:
            flat = logits.float().view(-1, logits.size(-1))
            out.ce = F.cross_entropy(flat, targets.reshape(-1))
            out.zloss = self.cfg.z_loss * torch.logsumexp(flat, dim=-1).pow(2).mean()
            out.loss = out.ce + out.zloss if self.cfg.z_loss else out.ce
        return out


def resolve_device(device: str = "auto") -> torch.device:
    """``"auto"`` -> CUDA when present, else CPU; anything else is passed to ``torch.device``."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)
