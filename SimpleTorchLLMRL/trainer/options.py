"""The fronts' options, written once: in their config dataclasses, each field with its own docstring.

`X(model, tokenizer, config=None, compute=None, *, <its objects>, **options)`: `config` holds the math
(`GRPOConfig`, ...), `compute` how it is computed (`ComputeOptions`); a keyword overrides their field.
`front_options` writes each front's signature (`inspect.signature`, `help()`) from the two dataclasses,
`options_table` docs/losses.md's tables; an unknown keyword is an `UnknownOptionError` naming it.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import MISSING, fields

from SimpleTorchLLMRL.model.scoring.logprobs import ComputeOptions

_FRONT = ("self", "model", "tokenizer", "config", "compute")


class UnknownOptionError(TypeError, ValueError):
    """A keyword argument that names no option."""


def field_docs(cls) -> dict[str, str]:
    """A dataclass' attribute docstrings (the string literal under each field), one line each."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body, docs = tree.body[0].body, {}
    for node, after in zip(body, body[1:], strict=False):
        if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            docs[node.target.id] = " ".join(str(after.value.value).split())
    return docs


def _option_parameters(config_cls) -> list[inspect.Parameter]:
    out = []
    for f in [*fields(config_cls), *fields(ComputeOptions)]:
        if f.init:
            default = f.default if f.default is not MISSING else f.default_factory()  # noqa: B023
            out.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=f.type))
    return out


def front_options(config_cls):
    """Class decorator of a front whose `__init__` takes `**options`: its signature names every option of
    `config_cls` and `ComputeOptions` (type and default; `help()` shows them) after the front's own keywords."""

    def wrap(cls):
        init = cls.__init__
        own = [p for p in inspect.signature(init).parameters.values() if p.kind is not p.VAR_KEYWORD]
        init.__signature__ = inspect.signature(init).replace(parameters=own + _option_parameters(config_cls))
        cls.config_class = config_cls
        return cls

    return wrap


def _check_type(name: str, what: str, value, cls) -> None:
    if value is not None and not isinstance(value, cls):
        raise TypeError(f"{name}: {what}= must be a {cls.__name__} or None, got {type(value).__name__} {value!r:.60}; "
                        f"options are keyword arguments, e.g. {name}(model, tokenizer, eps=0.2)")


def build_options(front, config, compute: ComputeOptions | None, options: dict):
    """(the front's config, ComputeOptions) from `config`, `compute` and the keyword `options` given beside them.

    An option names a field of either dataclass and overrides `config`'s or `compute`'s value of it."""
    name, config_cls = front.__name__, front.config_class
    _check_type(name, "config", config, config_cls)
    _check_type(name, "compute", compute, ComputeOptions)
    math = [f.name for f in fields(config_cls) if f.init]
    how = [f.name for f in fields(ComputeOptions)]
    unknown = sorted(set(options) - set(math) - set(how))
    if unknown:
        allowed = [p for p in inspect.signature(front.__init__).parameters if p not in _FRONT]
        raise UnknownOptionError(f"{name} got unknown options {unknown}; allowed: {sorted(allowed)}")
    base = {k: getattr(config, k) for k in math} if config is not None else {}
    cfg = config_cls(**{**base, **{k: v for k, v in options.items() if k in math}})
    base = {k: getattr(compute, k) for k in how} if compute is not None else {}
    return cfg, ComputeOptions(**{**base, **{k: v for k, v in options.items() if k in how}})


def options_table(fronts) -> str:
    """docs/losses.md's tables of options, generated from the fronts' config dataclasses (a test holds them equal)."""
    lines = []
    for front in (*fronts, None):
        cls = ComputeOptions if front is None else front.config_class
        title = "every front: `ComputeOptions`" if front is None else f"`{front.__name__}`: `{cls.__name__}`"
        others = [] if front is None else [p for p in inspect.signature(front.__init__).parameters.values()
                                            if p.name not in _FRONT and p.name not in {f.name for f in fields(cls)}
                                            and p.name not in {f.name for f in fields(ComputeOptions)}]
        lines += [f"#### {title}", "", "| option | default | what it does |", "|---|---|---|"]
        docs = field_docs(cls)
        for f in fields(cls):
            if f.init:
                default = f.default if f.default is not MISSING else f.default_factory()
                what = docs.get(f.name, "").replace("|", "\\|")  # a pipe inside a table cell
                lines.append(f"| `{f.name}` | `{default!r}` | {what} |")
        if others:
            lines += ["", "Beside them: " + ", ".join(f"`{p.name}`" for p in others) + " (see the class)."]
        lines.append("")
    return "\n".join(lines)
