"""Training state as plain data, put back into freshly built objects: what a checkpoint holds instead of pickles.

:meth:`Plain.encode` turns the attributes of live objects (an SB3 model, its env's wrappers,
``VecNormalize``) into a JSON tree whose leaves are plain values or references to numpy arrays
and torch tensors collected beside it; :meth:`Plain.decode` puts such a tree back into a
*freshly built object of the same construction*. Nothing is constructed from a name in the
file: objects are restored in place into the fresh object's own attributes (their class must
match), numpy bit generators only from a fixed list. With the tree read by ``json``, the arrays
by ``numpy.load(allow_pickle=False)`` and the tensors by ``torch.load(weights_only=True)``,
loading cannot run code, whatever the files hold (a tampered file can still hold wrong numbers:
the checkpoint's SHA-256 catches accidents, not tampering).

Every attribute is one of:

* plain data (None, bool, int, float, str; lists, tuples, deques, dicts of them) and numpy
  arrays and scalars: stored;
* torch tensors, modules (their state dict and the state dict of every submodule's
  ``optimizer``) and optimizers (state dict): stored in the tensor file; a module that is a part
  of one stored before (SB3's ``actor``/``critic`` aliases of the policy) is not stored twice;
* random generators (numpy ``Generator`` / ``RandomState``, a gymnasium space's generator):
  their states;
* objects of :data:`STATE_CLASSES` (VecNormalize's running statistics, SB3's Gaussian action
  noise): attribute by attribute;
* configuration that the spec rebuilds identically (classes, callables such as SB3's schedules,
  devices, enums, gymnasium's ``EnvSpec``, SB3's ``TrainFreq``): not stored; the fresh object keeps its own.

Anything else raises ``TypeError`` when the checkpoint is written, so new state is never dropped
silently.
"""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
from typing import Any

import numpy as np
import torch
from gymnasium.envs.registration import EnvSpec
from gymnasium.spaces import Space
from stable_baselines3.common.type_aliases import TrainFreq

#: Classes (by name) whose instances are state, restored attribute by attribute into the fresh object's instance.
STATE_CLASSES = ("RunningMeanStd", "NormalActionNoise")
#: numpy bit generators a stored generator state may name.
BIT_GENERATORS = ("PCG64", "PCG64DXSM", "MT19937", "Philox", "SFC64")
#: Configuration types (see the module docstring), besides classes and callables.
CONFIG_TYPES = (torch.device, enum.Enum, EnvSpec, TrainFreq)


class PlainStateError(ValueError):
    """A stored tree that does not fit the object it is put back into."""


class Plain:
    """The arrays and tensors of one encoded tree: ``arrays`` (name -> numpy array, for an ``.npz``),
    ``tensors`` (name -> tensor or state dict, for ``torch.save``)."""

    def __init__(self, arrays: dict[str, np.ndarray] | None = None, tensors: dict[str, Any] | None = None):
        self.arrays = dict(arrays or {})
        self.tensors = dict(tensors or {})
        self._modules: dict[int, str] = {}  # id of every stored module and submodule -> where it was stored

    # -- writing -----------------------------------------------------------------------------

    def encode_vars(self, attrs: dict[str, Any], path: str) -> dict[str, Any]:
        """``{name: encoded value}`` of an object's attributes ``attrs``."""
        return {k: self.encode(v, f"{path}.{k}") for k, v in attrs.items()}

    def encode(self, v: Any, path: str) -> Any:
        """The JSON-able form of ``v``; arrays and tensors go to :attr:`arrays` / :attr:`tensors` under ``path``."""
        if isinstance(v, (np.ndarray, np.generic)):  # before float: np.float64 is a float
            a = np.asarray(v)
            if a.dtype.hasobject:
                raise TypeError(f"{path}: a numpy array of Python objects cannot be stored without pickle")
            self.arrays[path] = a
            return {"__array__": path, "scalar": isinstance(v, np.generic)}
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, torch.Tensor):
            self.tensors[path] = v.detach().clone()
            return {"__tensor__": path}
        if isinstance(v, torch.nn.Module):
            if id(v) in self._modules:
                return {"__part_of__": self._modules[id(v)]}
            self._modules.update((id(m), path) for m in v.modules())
            opts = {n: m.optimizer.state_dict() for n, m in v.named_modules()
                    if isinstance(getattr(m, "optimizer", None), torch.optim.Optimizer)}
            self.tensors[path] = {"state": v.state_dict(), "optimizers": opts}
            return {"__module__": path}
        if isinstance(v, torch.optim.Optimizer):
            self.tensors[path] = v.state_dict()
            return {"__optimizer__": path}
        if type(v).__name__ in STATE_CLASSES:
            return {"__object__": type(v).__name__, "state": self.encode_vars(vars(v), path)}
        if isinstance(v, CONFIG_TYPES) or isinstance(v, type) or callable(v):
            return {"__config__": type(v).__name__}
        if isinstance(v, deque):
            return {"__deque__": [self.encode(x, f"{path}.{i}") for i, x in enumerate(v)], "maxlen": v.maxlen}
        if isinstance(v, (list, tuple)):
            return {"__list__" if isinstance(v, list) else "__tuple__": [self.encode(x, f"{path}.{i}") for i, x in enumerate(v)]}
        if isinstance(v, dict):
            return {"__dict__": [[self.encode(k, f"{path}.k{i}"), self.encode(x, f"{path}.{i}")]
                                 for i, (k, x) in enumerate(v.items())], "ordered": isinstance(v, OrderedDict)}
        if isinstance(v, np.random.Generator):
            return {"__generator__": self.encode(v.bit_generator.state, path)}
        if isinstance(v, np.random.RandomState):
            return {"__randomstate__": self.encode(v.get_state(legacy=False), path)}
        if isinstance(v, Space):
            g = v._np_random
            return {"__space__": None if g is None else self.encode(g.bit_generator.state, path)}
        raise TypeError(f"{path}: {type(v).__module__}.{type(v).__qualname__} is neither plain data nor a known "
                        "kind of state or configuration (stabstudy.learners.rl.plainstate); it cannot be stored "
                        "without pickle")

    # -- reading -----------------------------------------------------------------------------

    def decode_into(self, obj: Any, tree: dict[str, Any], path: str = "") -> None:
        """Set the attributes of ``obj`` (a freshly built object) from ``tree`` (:meth:`encode_vars`)."""
        if not isinstance(tree, dict):
            raise PlainStateError(f"{path}: expected the attributes of {type(obj).__name__}, got {type(tree).__name__}")
        # the policy first: a model's actor/critic attributes are parts of it
        for k in sorted(tree, key=lambda k: k != "policy"):
            if not isinstance(k, str) or k.startswith("__"):
                raise PlainStateError(f"{path}: {k!r} is not an attribute name this loader sets")
            cur = vars(obj).get(k)
            new = self.decode(tree[k], cur, f"{path}.{k}")
            if new is not cur:
                setattr(obj, k, new)

    def decode(self, enc: Any, current: Any = None, path: str = "") -> Any:
        """The value of ``enc``, restored into ``current`` (the fresh object's value) where it is an
        object, a generator, a tensor, a module or an optimizer."""
        if enc is None or isinstance(enc, (bool, int, float, str)):
            return enc
        if not isinstance(enc, dict) or len(enc) > 2:
            raise PlainStateError(f"{path}: not an encoded value: {str(enc)[:80]}")
        if "__array__" in enc:
            a = self._get(self.arrays, enc["__array__"], path)
            return a[()] if enc.get("scalar") else a
        if "__tensor__" in enc:
            t = self._get(self.tensors, enc["__tensor__"], path)
            if not isinstance(t, torch.Tensor):
                raise PlainStateError(f"{path}: the stored value is not a tensor")
            if isinstance(current, torch.Tensor) and current.shape == t.shape and current.dtype == t.dtype:
                with torch.no_grad():  # in place: optimizers hold the fresh tensor (SAC's log_ent_coef)
                    current.copy_(t)
                return current
            return t
        if "__module__" in enc:
            st = self._get(self.tensors, enc["__module__"], path)
            self._need(current, torch.nn.Module, path)
            current.load_state_dict(st["state"])
            parts = dict(current.named_modules())
            for name, sd in st["optimizers"].items():
                if name not in parts or not isinstance(getattr(parts[name], "optimizer", None), torch.optim.Optimizer):
                    raise PlainStateError(f"{path}: the module has no optimizer at {name!r}")
                parts[name].optimizer.load_state_dict(sd)
            return current
        if "__part_of__" in enc:
            return self._need(current, torch.nn.Module, path)
        if "__optimizer__" in enc:
            self._need(current, torch.optim.Optimizer, path).load_state_dict(
                self._get(self.tensors, enc["__optimizer__"], path))
            return current
        if "__config__" in enc:
            if current is None or type(current).__name__ != enc["__config__"] and not callable(current):
                raise PlainStateError(f"{path}: configuration {enc['__config__']} is not rebuilt by the fresh object")
            return current
        if "__deque__" in enc:
            return deque(self._items(enc["__deque__"], None, path), maxlen=enc.get("maxlen"))
        if "__list__" in enc:
            return self._items(enc["__list__"], current, path)
        if "__tuple__" in enc:
            return tuple(self._items(enc["__tuple__"], current, path))
        if "__dict__" in enc:
            out = OrderedDict() if enc.get("ordered") else {}
            for i, (k, x) in enumerate(enc["__dict__"]):
                key = self.decode(k, None, f"{path}.k{i}")
                out[key] = self.decode(x, current.get(key) if isinstance(current, dict) else None, f"{path}.{i}")
            return out
        if "__generator__" in enc:
            st = self.decode(enc["__generator__"], None, path)
            g = current if isinstance(current, np.random.Generator) else _generator(st, path)
            g.bit_generator.state = st
            return g
        if "__randomstate__" in enc:
            rs = current if isinstance(current, np.random.RandomState) else np.random.RandomState()
            rs.set_state(self.decode(enc["__randomstate__"], None, path))
            return rs
        if "__space__" in enc:
            self._need(current, Space, path)
            if enc["__space__"] is None:
                current._np_random = None
            else:
                current.np_random.bit_generator.state = self.decode(enc["__space__"], None, path)
            return current
        if "__object__" in enc:
            if type(current).__name__ != enc["__object__"] or enc["__object__"] not in STATE_CLASSES:
                raise PlainStateError(f"{path}: stored {enc['__object__']}, the fresh object has {type(current).__name__}")
            self.decode_into(current, enc["state"], path)
            return current
        raise PlainStateError(f"{path}: unknown encoding {sorted(enc)}")

    def _items(self, items: Any, current: Any, path: str) -> list[Any]:
        if not isinstance(items, list):
            raise PlainStateError(f"{path}: expected a list")
        cur = list(current) if isinstance(current, (list, tuple)) and len(current) == len(items) else [None] * len(items)
        return [self.decode(x, c, f"{path}.{i}") for i, (x, c) in enumerate(zip(items, cur, strict=True))]

    @staticmethod
    def _get(store: dict[str, Any], name: Any, path: str) -> Any:
        if not isinstance(name, str) or name not in store:
            raise PlainStateError(f"{path}: the checkpoint lacks the stored value {name!r}")
        return store[name]

    @staticmethod
    def _need(current: Any, kind: type, path: str) -> Any:
        if not isinstance(current, kind):
            raise PlainStateError(f"{path}: stored a {kind.__name__}, the fresh object has {type(current).__name__}")
        return current


def _generator(state: Any, path: str) -> np.random.Generator:
    name = state.get("bit_generator") if isinstance(state, dict) else None
    if name not in BIT_GENERATORS:
        raise PlainStateError(f"{path}: unknown bit generator {name!r}; valid: {', '.join(BIT_GENERATORS)}")
    return np.random.Generator(getattr(np.random, name)())
