"""What the registry holds, as Markdown: the source of ``stabstudy list`` and of docs/registry.md."""

from __future__ import annotations

import dataclasses

from stabstudy import registry
from stabstudy.hparams import annotations, describe, field_docs

SECTIONS = ("domains", "kinds", "channels", "hparams")


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return out + ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]


def markdown(sections: tuple[str, ...] = SECTIONS, domain: str | None = None) -> str:
    """The registry's tables; ``sections`` chooses among :data:`SECTIONS` (ValueError names them).

    With ``domain``, only what a run of that domain can use: its learners and tasks, the perturbation
    kinds that apply to it, the channels its runs carry, its learners' hyperparameters.
    """
    bad = [s for s in sections if s not in SECTIONS]
    if bad:
        raise ValueError(f"unknown section(s) {bad}; valid: {', '.join(SECTIONS)}")
    domains = [registry.domain(domain)] if domain is not None else list(registry.DOMAINS.values())
    lines: list[str] = []
    if "domains" in sections:
        lines += ["## Domains and learners", ""]
        lines += _table(("domain", "learners", "tasks", "steps count"),
                        [(d.name, ", ".join(f"`{n}`" for n in d.learners), d.tasks, d.step_unit)
                         for d in domains]) + [""]
    if "kinds" in sections:
        lines += ["## Perturbation kinds", ""]
        lines += _table(("kind", "dimension", "domains", "dose", "once"),
                        [(f"`{k.name}`", k.dimension, ", ".join(k.domains), k.dose, "yes" if k.instantaneous else "")
                         for k in registry.KINDS.values() if domain is None or domain in k.domains]) + [""]
    if "channels" in sections:
        lines += ["## Channels", "",
                  "Every stored run carries the channels marked *always* for its domains (NaN where its learner "
                  "cannot measure them). A multi-optimizer Monitor (SAC, TD3) adds `<channel>_<optimizer>` for the "
                  "channels per optimizer; the LM adds `attn_logit_max_l<i>` per layer. `units`: `1` dimensionless, "
                  "`loss` the objective's own unit, `param` / `grad` the parameters' / the gradient's.", ""]
        every = set(registry.DOMAINS)
        rows = [(f"`{c.name}`", "all" if set(c.domains) == every else ", ".join(c.domains), c.unit, c.source,
                 "yes" if c.always else "", {"optimizer": "per optimizer", "layer": "per layer"}.get(c.per, ""),
                 c.meaning) for c in registry.CHANNELS.values() if domain is None or domain in c.domains]
        lines += _table(("channel", "domains", "units", "source", "always", "family", "meaning"), rows) + [""]
    if "hparams" in sections:
        lines += ["## Hyperparameters", ""]
        seen: set[type] = set()
        for d in domains:
            for cls in d.learners.values():
                if cls in seen:
                    continue
                seen.add(cls)
                users = ", ".join(f"`{n}`" for n, c in d.learners.items() if c is cls)
                docs, ann = field_docs(cls), annotations(cls)
                lines += [f"### {d.name}: {users} (`{cls.__name__}`)", "", (cls.__doc__ or "").strip(), ""]
                lines += _table(("name", "default", "valid", "meaning"),
                                [(f"`{f.name}`", f"`{f.default!r}`", describe(ann[f.name]), docs.get(f.name, ""))
                                 for f in dataclasses.fields(cls)]) + [""]
    return "\n".join(lines)
