"""``per_layer``: which layer column each parameter tensor's values go to, and the host tables of them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from stabstudy.instruments.telemetry.channels import LAYER_PARTS
from stabstudy.instruments.telemetry.state import OptState
from stabstudy.instruments.telemetry.table import Table


class LayerIndex:
    """One layer per parameter tensor, named by the model (``model.named_parameters()``, a
    dict's keys or a list's positions as prefixes), in the order the optimizers hold them;
    parameters an optimizer gains later (``add_param_group``) get new layers, NaN before."""

    def __init__(self, model: Any, opts: list[OptState]):
        names: dict[int, str] = {}
        if isinstance(model, torch.nn.Module):
            mods = [("", model)]
        elif isinstance(model, Mapping):
            mods = [(f"{k}.", m) for k, m in model.items()]
        elif isinstance(model, Iterable):
            mods = [(f"m{i}.", m) for i, m in enumerate(model)]
        else:
            mods = []
        for prefix, m in mods:
            for n, p in m.named_parameters():
                names.setdefault(id(p), prefix + n)
        self.param_names = names  # also for parameters an optimizer gains later (add_param_group)
        self.names: list[str] = []
        self.index: dict[int, int] = {}  # id(parameter) -> layer column
        for st in opts:
            for gi, g in enumerate(st.opt.param_groups):
                for pi, p in enumerate(g["params"]):
                    if id(p) not in self.index:
                        self.index[id(p)] = len(self.names)
                        self.names.append(names.get(id(p), f"{st.name}.g{gi}.p{pi}"))
        self.tables = {part: Table((len(self.names),)) for part in LAYER_PARTS}  # part -> rows x layers

    def columns(self, st: OptState, params: list[torch.Tensor], ids: tuple[int, ...]) -> None:
        """Set ``st.layers`` to the layer columns of the stepped parameters (a range when
        consecutive, else an index tensor on their device), adding layers for new parameters."""
        lc = st.layers
        if ids == lc.key:
            return
        for p in params:
            if id(p) not in self.index:
                self.index[id(p)] = len(self.names)
                self.names.append(self.param_names.get(id(p), f"{st.name}.added{len(self.names)}"))
        for t in self.tables.values():
            t.widen(len(self.names))
        cols = [self.index[id(p)] for p in params]
        if cols == list(range(cols[0], cols[0] + len(cols))):
            lc.cols = (cols[0], cols[0] + len(cols))
        else:
            lc.cols = torch.tensor(cols, dtype=torch.long)
            if params[0].device.type != "cpu":
                lc.cols = lc.cols.to(params[0].device, non_blocking=True)
        lc.key, lc.end = ids, max(cols) + 1
