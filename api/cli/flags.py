"""Command-line flags made from the config models' fields (api/config.py), so that an option's
default and meaning are written once: `--max-step-tokens` is `EngineConfig.max_step_tokens`,
its default and help are the field's. A flag's value is read back into the model
(`options`), which validates it as `Engine.open` and `create_app` would."""

from __future__ import annotations

import argparse
import json
import types
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from stepline.api.config import EngineConfig, EventLogConfig


def _read_file(path: str) -> str:
    try:
        return Path(path).expanduser().read_text(encoding="utf-8")
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {exc.strerror or exc}") from None


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


# How a few fields read from the command line, where not as their type says.
FILE = {"type": _read_file, "metavar": "FILE"}  # the flag names a file; the field holds its text
JSON_OBJECT = {"type": _json_object, "metavar": "JSON"}


def _on(value: str) -> bool:
    """A yes/no flag's value: on (true, yes, 1) or off (false, no, 0)."""
    word = value.lower()
    if word not in ("on", "true", "yes", "1", "off", "false", "no", "0"):
        raise argparse.ArgumentTypeError(f"{value!r}: say on or off")
    return word in ("on", "true", "yes", "1")


def _base(annotation: Any) -> tuple[Any, bool]:
    """The field's type without None, and whether None is allowed."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return (args[0] if len(args) == 1 else annotation), True
    return annotation, False


def _flag(name: str, info: FieldInfo, special: dict[str, Any]) -> dict[str, Any]:
    kind, _ = _base(info.annotation)
    default = info.default
    kw: dict[str, Any] = {"dest": name, "default": default}
    help_text = (info.description or "").replace("%", "%%")
    if typing.get_origin(kind) is Literal:
        kw["choices"] = list(typing.get_args(kind))
        if all(isinstance(c, int) and not isinstance(c, bool) for c in kw["choices"]):
            kw["type"] = int  # a number among a few (--kv-bits 4|8)
    elif kind is bool:
        if default:  # a flag that is on unless turned off
            kw.update(choices=[True, False], type=_on)
            kw["metavar"] = "{on,off}"
        else:
            kw["action"] = "store_true"
    elif typing.get_origin(kind) is tuple:
        kw.update(action="append", default=None, metavar="VALUE")
    elif kind in (int, float, str):
        kw["type"] = kind
    kw.update(special)
    shown = default if not isinstance(default, tuple) else None
    if isinstance(shown, bool):
        shown = "on" if shown else "off"
    if shown is not None and "store_true" != kw.get("action"):
        help_text += f" (default: {shown})" if help_text else f"(default: {shown})"
    kw["help"] = help_text
    return kw


def add_flags(
    parser: argparse.ArgumentParser | Any,
    model: type[BaseModel],
    special: dict[str, dict[str, Any]] | None = None,
    skip: tuple[str, ...] = (),
) -> None:
    """A `--field-name` flag for each of `model`'s fields (but `skip`); `special[name]`
    overrides how one reads (argparse keywords)."""
    special = special or {}
    for name, info in model.model_fields.items():
        if name in skip:
            continue
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, **_flag(name, info, special.get(name, {})))


def options(args: argparse.Namespace, model: type[BaseModel]) -> dict[str, Any]:
    """The values of `model`'s flags in `args`, by field name (those left at their default
    are left out, so the model's own default applies)."""
    out = {}
    for name, info in model.model_fields.items():
        if not hasattr(args, name):
            continue
        value = getattr(args, name)
        if value is None and info.default != value:
            continue  # a repeatable flag never given
        if isinstance(value, list):
            value = tuple(value)
        out[name] = value
    return out


MODEL_HELP = (
    "a GGUF file, an mlx-lm directory, a Hugging Face id, or a built-in name: "
    "SmolLM2-135M-Instruct (the default: a real 135M instruct model from the package index, "
    "fetched once) or the random-weight demos stepline-demo, stepline-demo-hybrid, "
    "stepline-demo-sliding, stepline-demo-large"
)


def add_engine_args(p: argparse.ArgumentParser, *, several: bool = False) -> None:
    """`--model` (repeatable with `several`) and a flag for each `EngineConfig` and
    `EventLogConfig` field."""
    if several:
        p.add_argument(
            "--model",
            action="append",
            default=None,
            metavar="[NAME=]MODEL",
            help=MODEL_HELP + "; repeat it to serve several models (each loaded on its first "
            "request), NAME= serving one under that name",
        )
    else:
        p.add_argument("--model", default=None, help=MODEL_HELP)
    add_flags(p, EngineConfig, skip=("seed",))  # `generate --seed` is its request's
    add_flags(p, EventLogConfig)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """`Engine.open`'s keyword arguments from the flags of `add_engine_args`."""
    return {**options(args, EngineConfig), **options(args, EventLogConfig)}
