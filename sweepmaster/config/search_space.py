"""The Optuna side of a sweep.yaml: ``parameters:`` specs, samplers and pruners.

``study.sampler`` / ``study.pruner`` name a class of
:data:`~sweepmaster.study.SAMPLER_CLASSES` / :data:`~sweepmaster.study.PRUNER_CLASSES`, with
keywords checked against its signature (:func:`check_optuna_kwargs`).
Each entry of ``parameters:`` maps a dotted config path (``train.lr``,
``model.config.n_layer``) to one spec, in the syntax of W&B sweeps
(https://docs.wandb.ai/guides/sweeps/sweep-config-keys):

=============================================== ==============================================
spec                                            Optuna distribution
=============================================== ==============================================
``{value: x}``                                  none: a constant applied to every trial
``{values: [...]}``                             ``CategoricalDistribution(values)``
``{min, max, distribution: uniform}``           ``FloatDistribution(min, max)``
``{min, max, distribution: log_uniform_values}`` ``FloatDistribution(min, max, log=True)``
``{min, max, distribution: int_uniform}``       ``IntDistribution(min, max)``
``{min, max, q, distribution: q_uniform}``      ``FloatDistribution(min, max, step=q)``
=============================================== ==============================================

Without ``distribution``, ``min``/``max`` mean ``int_uniform`` when both are integers and
``uniform`` otherwise (W&B's inference), or ``q_uniform`` when ``q`` is given.

Example:
    >>> spec = normalize_parameter(ParameterSpec(min=1e-4, max=1e-2,
    ...                                          distribution="log_uniform_values"),
    ...                            "parameters.train.lr", "sweep.yaml")
    >>> to_distribution(spec)
    FloatDistribution(high=0.01, log=True, low=0.0001, step=None)
"""

from __future__ import annotations

import copy
import difflib
import functools
import inspect
import itertools
import math
import sys
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, Union, get_args, get_origin

from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from sweepmaster.errors import ConfigError

__all__ = [
    "DISTRIBUTIONS",
    "MAX_GRID_CELLS",
    "MAX_GRID_VALUES",
    "ParameterSpec",
    "check_optuna_kwargs",
    "check_parameter_path",
    "check_parameter_values",
    "did_you_mean",
    "grid_values",
    "normalize_parameter",
    "parameter_sets",
    "representative_values",
    "set_path",
    "to_distribution",
]

#: The supported values of ``distribution:``.
DISTRIBUTIONS = (
    "constant", "categorical", "uniform", "int_uniform", "q_uniform", "log_uniform_values"
)

#: Most grid points one parameter may have (``values``, or an ``int_uniform`` / ``q_uniform``
#: range enumerated by a grid).
MAX_GRID_VALUES = 10_000
#: Most cells a grid may have (the product of its parameters' grid points): Optuna's
#: ``GridSampler`` lists every cell when it is built.
MAX_GRID_CELLS = 1_000_000
#: Constructor arguments sweepmaster sets itself, and where the user sets them instead.
_MANAGED_KWARGS = {"search_space": "the grid is built from `parameters`",
                   "seed": "set the seed with study.seed"}


def parameter_sets(space: Mapping[str, Sequence[Any]],
                   max_sets: float) -> tuple[list[dict[str, Any]], bool]:
    """Parameter sets that cover ``space``, for checks and plans that cannot try every trial.

    Every combination of the values when there are at most ``max_sets`` of them, else each
    value of each parameter alone (the others left at the file's values).

    Example:
        >>> parameter_sets({"train.lr": [0.1, 0.2], "train.seed": [3]}, 8)
        ([{'train.lr': 0.1, 'train.seed': 3}, {'train.lr': 0.2, 'train.seed': 3}], True)
        >>> parameter_sets({"train.lr": [0.1, 0.2], "train.seed": [3, 4]}, 3)
        ([{'train.lr': 0.1}, {'train.lr': 0.2}, {'train.seed': 3}, {'train.seed': 4}], False)

    Args:
        space: Dotted config path -> the values to cover.
        max_sets: Most combinations to return; past it, one parameter at a time.

    Returns:
        The parameter sets (``[{}]`` for an empty space), and whether they are every
        combination.
    """
    if math.prod(len(values) for values in space.values()) <= max_sets:
        return [dict(zip(space, values, strict=True))
                for values in itertools.product(*space.values())], True
    return [{path: value} for path, values in space.items() for value in values], False


def did_you_mean(word: object, options: Iterable[str]) -> str:
    """Return ``"; did you mean 'x'?"`` for the option closest to ``word``, or ``""``."""
    if not isinstance(word, str):
        return ""
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


class ParameterSpec(BaseModel):
    """One entry of ``parameters:``.

    After :func:`normalize_parameter` (which the config loader applies), ``distribution`` is
    always set to one of :data:`DISTRIBUTIONS` and ``q`` is set exactly for ``q_uniform``.

    Attributes:
        value: The constant of a ``constant`` parameter.
        values: The choices of a ``categorical`` parameter.
        min: Lower bound of a range distribution (inclusive).
        max: Upper bound of a range distribution (inclusive).
        q: Step of ``q_uniform`` (default 1.0).
        distribution: One of :data:`DISTRIBUTIONS`, or ``None`` to infer it.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    value: Any = None
    values: list[Any] | None = None
    min: Any = None
    max: Any = None
    q: float | None = Field(default=None, gt=0)
    distribution: str | None = None


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def normalize_parameter(spec: ParameterSpec, key: str, source: str) -> ParameterSpec:
    """Check one spec and return it with ``distribution`` (and ``q``) made explicit.

    Args:
        spec: The spec as written.
        key: Its key path for error messages, e.g. ``"parameters.train.lr"``.
        source: The file it came from, for error messages.

    Returns:
        A copy whose ``distribution`` is one of :data:`DISTRIBUTIONS`.

    Raises:
        ConfigError: Unknown distribution; both ``values`` and ``min``/``max`` (or ``value``);
            empty ``values`` or a choice Optuna cannot store; a missing or non-numeric bound;
            ``min >= max``; a log distribution with ``min <= 0``; non-integer ``int_uniform``
            bounds; ``q`` without ``q_uniform``; ``q`` larger than ``max - min`` (every value
            would be ``min``); a choice given twice in ``values`` (its trials would repeat).
    """
    dist = spec.distribution
    if dist is not None and dist not in DISTRIBUTIONS:
        raise ConfigError(source, f"{key}.distribution",
                          f"one of {', '.join(DISTRIBUTIONS)}, got {dist!r}"
                          f"{did_you_mean(dist, DISTRIBUTIONS)}")
    # A dumped spec carries ``value: null``; it only counts as a constant where nothing else does.
    has_value = "value" in spec.model_fields_set and (
        spec.value is not None or dist in (None, "constant"))
    has_values = spec.values is not None
    has_range = spec.min is not None or spec.max is not None
    given = [name for name, flag in (("value", has_value), ("values", has_values),
                                     ("min/max", has_range)) if flag]
    if len(given) > 1:
        raise ConfigError(source, key, "exactly one of `value`, `values` or `min`/`max`, "
                          f"got {' and '.join(given)}")
    if spec.q is not None and dist not in (None, "q_uniform"):
        raise ConfigError(source, f"{key}.q", f"only with distribution q_uniform, got {dist}")
    if dist == "constant" or (dist is None and has_value):
        if not has_value:
            raise ConfigError(source, f"{key}.value", "required with distribution constant")
        return spec.model_copy(update={"distribution": "constant"})
    if dist == "categorical" or (dist is None and has_values):
        if not has_values:
            raise ConfigError(source, f"{key}.values", "required with distribution categorical")
        if not spec.values:
            raise ConfigError(source, f"{key}.values", "a non-empty list, got []")
        for choice in spec.values:
            if not (choice is None or isinstance(choice, (bool, int, float, str))):
                hint = (" (a list of names or numbers is one comma-separated string, e.g. "
                        f"{','.join(map(str, choice))!r})" if isinstance(choice, list) else "")
                raise ConfigError(source, f"{key}.values", "choices that are null, booleans, "
                                  f"numbers or strings (Optuna's categorical), got {choice!r}"
                                  + hint)
        seen: set[tuple[str, Any]] = set()
        for choice in spec.values:
            same = _choice_identity(choice)
            if same in seen:
                raise ConfigError(source, f"{key}.values", "choices that differ (each one is "
                                  f"trained, so a repeated one trains the same thing twice), got "
                                  f"{choice!r} more than once in {spec.values!r}")
            seen.add(same)
        return spec.model_copy(update={"distribution": "categorical"})
    if dist is None and not has_range:
        raise ConfigError(source, key, "a mapping with `value`, `values`, or `min` and `max`")
    if has_values:
        raise ConfigError(source, f"{key}.distribution",
                          f"categorical with `values`, got {dist} (which needs `min` and `max`)")
    for bound in ("min", "max"):
        x = getattr(spec, bound)
        if x is None:
            raise ConfigError(source, f"{key}.{bound}",
                              f"required with distribution {dist or 'uniform'}")
        if not _is_number(x):
            raise ConfigError(source, f"{key}.{bound}", f"a number, got {x!r}")
        if not math.isfinite(x):
            raise ConfigError(source, f"{key}.{bound}", f"a finite number, got {x!r}")
    if dist is None:
        dist = "int_uniform" if _is_int(spec.min) and _is_int(spec.max) else "uniform"
        if spec.q is not None:
            dist = "q_uniform"
    if dist == "int_uniform":
        for bound in ("min", "max"):
            if not _is_int(getattr(spec, bound)):
                raise ConfigError(source, f"{key}.{bound}",
                                  f"an integer for int_uniform, got {getattr(spec, bound)!r}")
    if spec.min >= spec.max:
        raise ConfigError(source, f"{key}.max",
                          f"a number greater than min ({spec.min}), got {spec.max}")
    if dist == "log_uniform_values" and spec.min <= 0:
        raise ConfigError(source, f"{key}.min",
                          f"a number > 0 for log_uniform_values, got {spec.min}")
    q = (1.0 if spec.q is None else spec.q) if dist == "q_uniform" else None
    if q is not None and q > spec.max - spec.min:
        raise ConfigError(source, f"{key}.q", f"a step of at most max - min "
                          f"({spec.max - spec.min:g}), so that the range holds more than min, "
                          f"got {q:g}")
    num_steps = (spec.max - spec.min) / q if q is not None else 0.0
    if q is not None and abs(num_steps - round(num_steps)) > 1e-9 * max(1.0, num_steps):
        last = spec.min + math.floor(num_steps) * q
        raise ConfigError(source, f"{key}.q", f"a step that divides max - min "
                          f"({spec.max - spec.min:g}), so that max is one of the values, got "
                          f"{q:g} (the range would end at {last:g}, not {spec.max:g})")
    return spec.model_copy(update={"distribution": dist, "q": q})


def _choice_identity(choice: Any) -> tuple[str, Any]:
    """What makes two categorical choices the same: 1 and 1.0 are, ``true`` and 1 are not."""
    if isinstance(choice, bool) or choice is None or isinstance(choice, str):
        return type(choice).__name__, choice
    return "number", choice  # an int and a float of one value compare (and hash) equal


def to_distribution(spec: ParameterSpec) -> BaseDistribution:
    """Return the Optuna distribution of a normalized, non-constant spec."""
    dist = spec.distribution
    assert dist in DISTRIBUTIONS and dist != "constant", f"not a sampled spec: {spec!r}"
    if dist == "categorical":
        assert spec.values is not None
        return CategoricalDistribution(spec.values)
    if dist == "int_uniform":
        return IntDistribution(spec.min, spec.max)
    low, high = float(spec.min), float(spec.max)
    if dist == "q_uniform":
        assert spec.q is not None
        return FloatDistribution(low, high, step=spec.q)
    return FloatDistribution(low, high, log=dist == "log_uniform_values")


def grid_values(spec: ParameterSpec, key: str, source: str) -> list[Any]:
    """Enumerate the grid points of a normalized, non-constant spec.

    Args:
        spec: The spec.
        key: Its key path for error messages, e.g. ``"parameters.train.lr"``.
        source: The file it came from, for error messages.

    Returns:
        ``values``; ``min..max`` for ``int_uniform``; ``min, min + q, ...`` up to ``max`` for
        ``q_uniform``.

    Raises:
        ConfigError: A continuous distribution (``uniform``, ``log_uniform_values``), or more
            than :data:`MAX_GRID_VALUES` points.
    """
    dist = spec.distribution
    if dist == "categorical":
        assert spec.values is not None
        num_values = len(spec.values)
    elif dist == "int_uniform":
        num_values = spec.max - spec.min + 1
    elif dist == "q_uniform":
        assert spec.q is not None
        num_values = math.floor((float(spec.max) - float(spec.min)) / spec.q + 1e-9) + 1
    else:
        raise ConfigError(source, key, "a grid needs `values` (or int_uniform / q_uniform), "
                          f"got distribution {dist}")
    if num_values > MAX_GRID_VALUES:
        raise ConfigError(source, key, f"a grid of at most {MAX_GRID_VALUES} values per "
                          f"parameter, got {num_values} (a TPE or random sampler with "
                          "study.n_trials samples a large range)")
    if dist == "categorical":
        assert spec.values is not None
        return list(spec.values)
    if dist == "int_uniform":
        return list(range(spec.min, spec.max + 1))
    assert spec.q is not None
    low, q = float(spec.min), spec.q
    return [round(low + i * q, 12) for i in range(num_values)]


def representative_values(spec: ParameterSpec) -> list[Any]:
    """Values that stand for everything a normalized spec can produce, for type checking.

    The constant, each categorical choice, or both bounds (as floats for the float
    distributions, since that is what Optuna will suggest).
    """
    if spec.distribution == "constant":
        return [spec.value]
    if spec.distribution == "categorical":
        assert spec.values is not None
        return list(spec.values)
    if spec.distribution == "int_uniform":
        return [spec.min, spec.max]
    return [float(spec.min), float(spec.max)]


def set_path(raw: dict[str, Any], path: str, value: Any) -> None:
    """Set the entry at a dotted ``path`` of a raw config mapping, creating mappings on the way."""
    *parents, last = path.split(".")
    node = raw
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[last] = value


def check_parameter_path(path: str, key: str, source: str, paths: Sequence[str],
                         model_fields: Sequence[str] | None, model_class: str = "") -> None:
    """Check that a dotted path names a setting a parameter may set.

    Args:
        path: The dotted path, e.g. ``"train.lr"`` or ``"model.config.n_layer"``.
        key: Its key path for error messages, e.g. ``"parameters.train.lr"``.
        source: The file it came from, for error messages.
        paths: Every valid path outside ``model.config``.
        model_fields: The fields ``model.config.<field>`` may name, or ``None`` when the config
            has no ``model.config`` (a pretrained model).
        model_class: The name of the model config class, for error messages.

    Raises:
        ConfigError: The path names nothing settable (with a did-you-mean).
    """
    if path in paths:
        return
    options = list(paths)
    if model_fields is not None:
        if path.startswith("model.config."):
            name = path.removeprefix("model.config.")
            if name in model_fields and name != "model_type":
                return
            raise ConfigError(source, key, f"a field of {model_class} under model.config"
                              f"{did_you_mean(name, model_fields)}")
        options += [f"model.config.{name}" for name in model_fields]
    elif path.startswith("model.config."):
        raise ConfigError(source, key, "model.config to be set (with model.pretrained the "
                          "architecture comes from the checkpoint)")
    raise ConfigError(source, key, "a dotted path to a model, data or train setting, "
                      f"e.g. train.lr or model.config.n_layer{did_you_mean(path, options)}")


def check_parameter_values(parameters: Mapping[str, ParameterSpec], base: dict[str, Any],
                           source: str, validate: Callable[[dict[str, Any]], object]) -> None:
    """Check that every value a parameter can take fits the config schema.

    Each of :func:`representative_values` of each parameter is applied alone to ``base``, which
    is then validated in full.

    Args:
        parameters: Dotted path -> normalized spec.
        base: The raw config the values are applied to.
        source: The file, for error messages.
        validate: Validates a raw config, raising ConfigError.

    Raises:
        ConfigError: Keyed ``parameters.<path>``, with the error the value caused.
    """
    for path, spec in parameters.items():
        for value in representative_values(spec):
            raw = copy.deepcopy(base)
            set_path(raw, path, value)
            try:
                validate(raw)
            except ConfigError as err:
                detail = err.expected if err.key == path else \
                    f"with {value!r}, {err.key or 'the config'}: {err.expected}"
                raise ConfigError(source, f"parameters.{path}", detail) from None


def check_optuna_kwargs(cls: type, kwargs: Mapping[str, Any], key: str, source: str) -> None:
    """Check the keywords a sweep.yaml gives to an Optuna sampler or pruner class.

    Args:
        cls: The class, e.g. ``TPESampler``.
        kwargs: Its keywords from the file, e.g. ``{"n_startup_trials": 5}``.
        key: Their key path for error messages, e.g. ``"study.sampler"``.
        source: The file, for error messages.

    Raises:
        ConfigError: A keyword that is not in the class signature (with a did-you-mean), that
            sweepmaster sets itself (``seed``, ``search_space``), that takes a Python object,
            or whose value does not match the annotation.
    """
    settable = _settable_kwargs(cls)
    for name, value in kwargs.items():
        if name in _MANAGED_KWARGS:
            raise ConfigError(source, f"{key}.{name}",
                              f"not settable here: {_MANAGED_KWARGS[name]}")
        if name in inspect.signature(cls).parameters and name not in settable:
            raise ConfigError(source, f"{key}.{name}", "a Python object; not settable from YAML")
        if name not in settable:
            raise ConfigError(source, f"{key}.{name}",
                              f"a keyword of optuna's {cls.__name__}: one of "
                              f"{', '.join(settable) or '(none)'}{did_you_mean(name, settable)}")
        try:
            TypeAdapter(settable[name]).validate_python(value, strict=True)
        except ValidationError:
            raise ConfigError(source, f"{key}.{name}",
                              f"expected {_type_name(settable[name])}, got {value!r}") from None


@functools.cache
def _settable_kwargs(cls: type) -> dict[str, Any]:
    """Constructor keywords of an Optuna class that YAML can express -> their type hints."""
    namespace = dict(vars(sys.modules[cls.__module__]))
    hints: dict[str, Any] = {}
    for name, param in inspect.signature(cls).parameters.items():
        if name in _MANAGED_KWARGS or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        hint: Any = Any if param.annotation is param.empty else param.annotation
        if isinstance(hint, str):

            def holder() -> None: ...

            holder.__annotations__ = {"value": hint}
            try:
                hint = typing.get_type_hints(holder, globalns=namespace)["value"]
            except (NameError, TypeError, SyntaxError):  # a type only imported for checking:
                continue  # a Python object (callable, sampler, trial), not YAML
        if _is_plain_data(hint):
            hints[name] = hint
    return hints


def _is_plain_data(hint: Any) -> bool:
    if hint in (int, float, bool, str, type(None)) or hint is Any or hint is Ellipsis:
        return True
    origin = get_origin(hint)
    if origin is Literal:
        return True
    return origin in (list, dict, tuple, Union, types.UnionType) and all(
        _is_plain_data(arg) for arg in get_args(hint))


def _type_name(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")
