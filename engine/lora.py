"""LoRA and DoRA adapters that share their base model's weights and batch.

An adapter is a directory in `mlx_lm.lora`'s format: `adapter_config.json` (its
`fine_tune_type`, "lora" or "dora", and `lora_parameters`: `rank`, `scale`) and
`adapters.safetensors` (each adapted Linear's `lora_a` (D_in, r) and `lora_b` (r, D_out), a
DoRA one's magnitude `m` (D_out,) too, named by the module's path in the model).

Every Linear an adapter touches is replaced, once, by a `MultiLoraLinear` that keeps the base
Linear and each adapter's matrices: the base runs once over every row of a forward, then each
adapter's low-rank product is added to its own rows only (gathered, multiplied, put back), as
mlx-lm's `LoRALinear` / `DoRALinear` compute it for a row alone. Which adapter each row of a
forward belongs to is set by the runner right around that forward (`Routes.rows`), from the
row order it builds: one row per prompt chunk (a (1, L) forward), one per decode row, one per
token of a fused step. Outside such a call every row is the base model's.

An adapter is refused at load (`AdapterError`, the reason in its message) when its files are
missing or malformed, it is a full fine-tune, its rank is not the rank of its matrices, or it
adapts a module the base model lacks or has with other shapes (trained on another model).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from stepline.actors.scheduler.spans import adapter_key

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapters.safetensors"
KINDS = ("lora", "dora")  # `fine_tune_type`s served ("full" replaces weights: a model of its own)
_LEAVES = ("lora_a", "lora_b", "m")


class AdapterError(ValueError):
    """An adapter that cannot be served on this model; the message says why."""


@dataclass(frozen=True)
class _Delta:
    """One adapter's change to one Linear: `(x @ a) @ b * scale` added to the base's output;
    DoRA's `gain` (D_out,) (its magnitude over the adapted weight's row norms) multiplies
    the sum, the bias kept out of it."""

    a: mx.array
    b: mx.array
    scale: float
    gain: mx.array | None = None

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + self.b.nbytes + (0 if self.gain is None else self.gain.nbytes)


class Routes:
    """Which adapter each leading row of the forward being built belongs to: owned by the
    runner, read by every `MultiLoraLinear` of its model while the forward is built."""

    def __init__(self) -> None:
        self.slots: dict[str, int] = {}  # adapter name -> its slot in every layer
        self.num_rows: int | None = None  # rows of the forward being built; None: none set
        # (slot, its rows: None for every row) for each adapter with rows in it
        self.groups: list[tuple[int, mx.array | None]] = []
        # The same rows as one gather: `order` the adapters' rows, slot after slot (`spans`:
        # each slot's [start, end) in it), and `back`, for each row of the forward, where
        # its delta is among them (len(order): a zero row, a base row's).
        self.order: mx.array | None = None
        self.spans: list[tuple[int, int, int]] = []
        self.back: mx.array | None = None

    def slot(self, name: str | None) -> int | None:
        """`name`'s slot (None: the base model). Raises KeyError for an adapter not loaded."""
        return None if name is None else self.slots[name]

    @contextmanager
    def rows(self, adapters: Sequence[str | None]) -> Iterator[None]:
        """Within the block, row i of a forward is adapter `adapters[i]`'s (None: the base's).
        Raises KeyError for an adapter not loaded."""
        if not self.slots or not any(adapters):
            yield  # every row the base's: nothing to route
            return
        slots = [self.slot(a) for a in adapters]
        groups: dict[int, list[int]] = {}
        for i, s in enumerate(slots):
            if s is not None:
                groups.setdefault(s, []).append(i)
        self.num_rows = len(slots)
        self.groups = [
            (s, None if len(rows) == len(slots) else mx.array(rows, dtype=mx.int32))
            for s, rows in groups.items()
        ]
        if self.groups[0][1] is not None:  # rows of several adapters, or of the base too
            order = [i for rows in groups.values() for i in rows]
            at = {row: k for k, row in enumerate(order)}
            self.order = mx.array(order, dtype=mx.int32)
            self.back = mx.array([at.get(i, len(order)) for i in range(len(slots))], mx.int32)
            start = 0
            for s, rows in groups.items():
                self.spans.append((s, start, start + len(rows)))
                start += len(rows)
        try:
            yield
        finally:
            self.num_rows, self.groups, self.spans = None, [], []
            self.order = self.back = None


class MultiLoraLinear(nn.Module):
    """A base Linear (or QuantizedLinear) and the deltas of every adapter that touches it,
    each applied to the rows `routes` gives it (see the module docstring)."""

    def __init__(self, base: nn.Module, routes: Routes):
        super().__init__()
        self.base = base
        self._routes = routes
        self._deltas: dict[int, _Delta] = {}  # slot -> delta (a plain dict: not parameters)

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)
        routes = self._routes
        if not routes.groups:
            return y
        if routes.num_rows != x.shape[0]:
            raise RuntimeError(
                f"adapter routing for {routes.num_rows} rows, a forward of {x.shape[0]}"
            )
        if routes.order is None:  # every row one adapter's
            slot = routes.groups[0][0]
            delta = self._deltas.get(slot)
            return y if delta is None else self._apply(delta, x, y)
        # LoRA deltas add: computed on the adapters' rows gathered once, slot after slot,
        # and put back in one gather (a base row, or an adapter's that leaves this layer
        # alone, adds a zero row: exactly its base output)
        order, back = routes.order, routes.back
        assert back is not None
        xs, parts, lora = x[order], [], False
        for slot, start, end in routes.spans:
            delta = self._deltas.get(slot)
            if delta is not None and delta.gain is None:
                z = (xs[start:end] @ delta.a) @ delta.b
                parts.append((delta.scale * z).astype(x.dtype))
                lora = True
            else:
                parts.append(mx.zeros((end - start, *y.shape[1:]), dtype=y.dtype))
        if lora:
            parts.append(mx.zeros((1, *y.shape[1:]), dtype=y.dtype))
            y = y + mx.concatenate(parts)[back]
        for slot, rows in routes.groups:  # DoRA's do not add: each on its own rows
            delta = self._deltas.get(slot)
            if delta is not None and delta.gain is not None:
                assert rows is not None
                y[rows] = self._apply(delta, x[rows], y[rows])
        return y

    def _apply(self, d: _Delta, x: mx.array, y: mx.array) -> mx.array:
        z = (x @ d.a) @ d.b
        if d.gain is None:  # mlx-lm's LoRALinear
            return y + (d.scale * z).astype(x.dtype)
        bias = self.base.get("bias") if "bias" in self.base else None
        plain = y if bias is None else y - bias
        out = d.gain.astype(x.dtype) * (plain + (d.scale * z).astype(x.dtype))  # DoRALinear
        return out if bias is None else out + bias

    @property
    def adapter_bytes(self) -> int:
        return sum(d.nbytes for d in self._deltas.values())


@dataclass(frozen=True)
class AdapterInfo:
    """An adapter as loaded: what the server reports of it."""

    name: str
    path: str
    kind: str  # "lora" or "dora"
    rank: int
    scale: float
    num_modules: int  # Linears it adapts
    num_bytes: int  # its matrices' memory


class Adapters:
    """The adapters loaded on one model (each in a slot of every layer it touches), and the
    `Routes` its forwards read."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.routes = Routes()
        self.loaded: dict[str, AdapterInfo] = {}
        self._layers: dict[str, MultiLoraLinear] = {}  # module path -> its layer

    def load(self, name: str, path: str | Path) -> AdapterInfo:
        """Read adapter `name` from `path` and add it to the model's layers (every check
        done before any layer changes). Raises AdapterError naming what does not fit."""
        if name in self.loaded:
            raise AdapterError(f"an adapter named {name!r} is loaded already")
        same_keys = [n for n in self.loaded if adapter_key((0,), n) == adapter_key((0,), name)]
        if same_keys:  # its prefix-cache keys would be another adapter's: name it otherwise
            raise AdapterError(f"the name {name!r} hashes as {same_keys[0]!r} does: rename it")
        kind, rank, scale, weights = read_adapter(path)
        modules = _by_module(weights, path)
        deltas: dict[str, _Delta] = {}
        try:
            for module_path, leaves in modules.items():
                base = self._base_of(module_path, path)
                deltas[module_path] = _delta(base, leaves, kind, rank, scale, module_path, path)
        except AdapterError as exc:
            trained_on = _trained_on(path)
            if trained_on is None:
                raise
            raise AdapterError(f"{exc}; its adapter_config.json names {trained_on!r}") from None
        slot = max(self.routes.slots.values(), default=-1) + 1
        for module_path, delta in deltas.items():
            self._layer(module_path)._deltas[slot] = delta
        mx.eval([[d.a, d.b] + ([d.gain] if d.gain is not None else []) for d in deltas.values()])
        self.routes.slots[name] = slot
        info = AdapterInfo(
            name=name,
            path=str(path),
            kind=kind,
            rank=rank,
            scale=scale,
            num_modules=len(deltas),
            num_bytes=sum(d.nbytes for d in deltas.values()),
        )
        self.loaded[name] = info
        return info

    def _base_of(self, module_path: str, path: str | Path) -> nn.Module:
        """The Linear at `module_path` in the model (the base of a layer installed already)."""
        if module_path in self._layers:
            return self._layers[module_path].base
        parent, leaf = _find_parent(self.model, module_path)
        module = _child(parent, leaf) if parent is not None else None
        if module is None:
            raise AdapterError(
                f"the adapter at {path} adapts {module_path!r}, which this model does not "
                "have (trained on another model?)"
            )
        if ".layers." not in f".{module_path}":
            raise AdapterError(
                f"the adapter at {path} adapts {module_path!r}: only the Linear layers of the "
                "model's transformer blocks are served with adapters (not its embeddings or "
                "output head)"
            )
        if not isinstance(module, (nn.Linear, nn.QuantizedLinear)):
            raise AdapterError(
                f"the adapter at {path} adapts {module_path!r}, a {type(module).__name__}: "
                "only Linear layers are served with adapters (not experts or embeddings)"
            )
        return module

    def _layer(self, module_path: str) -> MultiLoraLinear:
        layer = self._layers.get(module_path)
        if layer is None:
            parent, leaf = _find_parent(self.model, module_path)
            assert parent is not None
            layer = MultiLoraLinear(_child(parent, leaf), self.routes)
            if isinstance(parent, list):
                parent[int(leaf)] = layer
            else:
                setattr(parent, leaf, layer)
            self._layers[module_path] = layer
        return layer


def adapter_bytes(model: nn.Module) -> int:
    """The memory of every adapter's matrices in `model` (not among its parameters)."""
    return sum(m.adapter_bytes for _, m in model.named_modules() if isinstance(m, MultiLoraLinear))


def read_adapter(path: str | Path) -> tuple[str, int, float, dict[str, mx.array]]:
    """An adapter directory's kind, rank, scale and arrays. Raises AdapterError."""
    path = Path(path).expanduser()
    config_file, weights_file = path / CONFIG_FILE, path / WEIGHTS_FILE
    for f in (config_file, weights_file):
        if not f.is_file():
            raise AdapterError(
                f"{path} is not an mlx_lm.lora adapter: it has no {f.name} "
                f"(an adapter directory holds {CONFIG_FILE} and {WEIGHTS_FILE})"
            )
    try:
        config = json.loads(config_file.read_text())
    except ValueError as exc:
        raise AdapterError(f"{config_file} is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{config_file} is not a JSON object")
    kind = config.get("fine_tune_type", "lora")
    if kind not in KINDS:
        raise AdapterError(
            f"{path} is a {kind!r} fine-tune: only LoRA and DoRA adapters ({', '.join(KINDS)}) "
            "share a base model's weights (serve a full fine-tune as a model of its own)"
        )
    params = config.get("lora_parameters")
    if not isinstance(params, dict) or "rank" not in params or "scale" not in params:
        raise AdapterError(f"{config_file} has no lora_parameters with a rank and a scale")
    try:
        rank, scale = int(params["rank"]), float(params["scale"])
    except (TypeError, ValueError):
        raise AdapterError(f"{config_file}'s rank and scale are not numbers") from None
    try:
        weights = mx.load(str(weights_file))
    except Exception as exc:  # noqa: BLE001 - MLX's reader says what is wrong with the file
        raise AdapterError(f"{weights_file} could not be read: {exc}") from None
    assert isinstance(weights, dict)
    return kind, rank, scale, weights


def _trained_on(path: str | Path) -> str | None:
    """The base model an adapter's config names (mlx_lm.lora records `model`), if any."""
    model = json.loads((Path(path).expanduser() / CONFIG_FILE).read_text()).get("model")
    return model if isinstance(model, str) else None


def _by_module(weights: dict[str, mx.array], path: str | Path) -> dict[str, dict[str, mx.array]]:
    out: dict[str, dict[str, mx.array]] = {}
    for key, array in weights.items():
        module, _, leaf = key.rpartition(".")
        if leaf not in _LEAVES or not module:
            raise AdapterError(
                f"the adapter at {path} holds {key!r}, not an adapter matrix "
                "(lora_a, lora_b or a DoRA magnitude m)"
            )
        out.setdefault(module, {})[leaf] = array
    if not out:
        raise AdapterError(f"the adapter at {path} holds no matrices")
    return out


def _delta(
    base: nn.Module,
    leaves: dict[str, mx.array],
    kind: str,
    rank: int,
    scale: float,
    module_path: str,
    path: str | Path,
) -> _Delta:
    """One module's delta, checked against the base Linear it changes."""
    where = f"the adapter at {path}, {module_path!r}"
    if "lora_a" not in leaves or "lora_b" not in leaves:
        raise AdapterError(f"{where}: lora_a and lora_b are both needed")
    a, b = leaves["lora_a"], leaves["lora_b"]
    d_out, d_in = _dims(base)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise AdapterError(f"{where}: lora_a {a.shape} and lora_b {b.shape} do not multiply")
    if a.shape[1] != rank:
        raise AdapterError(
            f"{where}: its matrices have rank {a.shape[1]}, its adapter_config.json says "
            f"rank {rank}"
        )
    if (a.shape[0], b.shape[1]) != (d_in, d_out):
        raise AdapterError(
            f"{where}: it maps {a.shape[0]} -> {b.shape[1]} features, this model's layer "
            f"{d_in} -> {d_out} (trained on another model?)"
        )
    gain = None
    if kind == "dora":
        m = leaves.get("m")
        if m is None or m.shape != (d_out,):
            raise AdapterError(f"{where}: a DoRA adapter needs a magnitude m of ({d_out},)")
        w = _weight(base)
        adapted = w + (scale * b.T) @ a.T  # as DoRALinear normalises it
        gain = m / mx.linalg.norm(adapted, axis=1)
    elif "m" in leaves:
        raise AdapterError(f"{where}: a magnitude m, in an adapter whose fine_tune_type is lora")
    return _Delta(a, b, scale, gain)


def _dims(linear: nn.Module) -> tuple[int, int]:
    """(D_out, D_in) of a Linear or QuantizedLinear."""
    out, inner = linear.weight.shape
    if isinstance(linear, nn.QuantizedLinear):
        inner = inner * 32 // linear.bits
    return int(out), int(inner)


def _weight(linear: nn.Module) -> mx.array:
    if isinstance(linear, nn.QuantizedLinear):
        return mx.dequantize(
            linear.weight,
            linear.scales,
            linear.biases,
            group_size=linear.group_size,
            bits=linear.bits,
            mode=linear.mode,
        )
    return linear.weight


def _child(parent: Any, leaf: str) -> Any:
    if isinstance(parent, list):
        return parent[int(leaf)] if leaf.isdigit() and int(leaf) < len(parent) else None
    if isinstance(parent, nn.Module):
        if leaf in parent:
            return parent[leaf]
        return getattr(parent, leaf, None) if not leaf.startswith("_") else None
    return None


def _find_parent(model: nn.Module, module_path: str) -> tuple[Any, str]:
    """The module (or list) holding `module_path`'s last part, and that part; (None, part)
    where the path leads nowhere."""
    *parts, leaf = module_path.split(".")
    node: Any = model
    for part in parts:
        node = _child(node, part)
        if node is None:
            return None, leaf
        if isinstance(node, MultiLoraLinear):
            return None, leaf
    return node, leaf
