"""The options of the trainer fronts: one shape for all, `X(model, tokenizer, config=None, compute=None, **options)`,
every option a named keyword argument (`named_options`).

    GRPO(model, tokenizer, eps=0.2, beta=0.0)              # every option a named keyword argument
    GRPO(model, tokenizer, GRPOConfig(loss_type="dapo"), ComputeOptions(chunk_size=256), beta=0.04)

`config` holds the options that change the math (`GRPOConfig`, `PPOConfig`, ...), `compute` how
they are computed (`ComputeOptions`); a keyword given next to them overrides their field. A
keyword left out is `UNSET`: the config's (or its dataclass') default. An unknown keyword is an
`UnknownOptionError` naming it and listing the allowed ones (a TypeError, as Python's own for a
wrong keyword; also a ValueError, which it was before).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, fields

from SimpleTorchLLMRL.model.scoring.logprobs import DEFAULT_CHUNK_SIZE, HEAD_IMPLS


class _Unset:
    """The default of a front's keyword options: "not given", so `config=`'s value (or the default) stands."""

    def __repr__(self) -> str:
        return "<default>"

    def __bool__(self) -> bool:
        return False


UNSET = _Unset()


class UnknownOptionError(TypeError, ValueError):
    """A keyword argument that names no option."""


@dataclass
class ComputeOptions:
    """How the numbers are computed, not what they are; keyword arguments of `GRPO`, `PPO` and the other fronts.

    chunk_size: trained tokens scored per chunk of the output head (None: by kernel). head_impl: the
    chunk kernel, "auto" ("triton" on CUDA, "gpu" there without Triton, else "cpu": `resolve_head_impl`), "cpu",
    "gpu" or "triton" (`model.scoring.logprobs`). fused:
    False: the two-pass head, chunked log-probs and entropy without autograd, the loss once on them, the
    logits recomputed in backward (`model.scoring.head_autograd._TwoPassHead`); True: a token-level loss (GRPO's, PPO's)
    forms its gradient chunk by chunk in the forward (`fused_token_loss`) when the head allows (one logits
    pass less, an autograd graph per chunk); None (default): two-pass on the "gpu" / "triton" kernels, fused
    on "cpu" (`grpo_loss.grpo_loss`). Same values either way. share_prefix: the rows of a group run their shared
    prompt once (`model.scoring.shared_prefix`; checked against the plain forward once per model).
    max_length / truncate: as `encode_rollout`.
    """

    chunk_size: int | None = DEFAULT_CHUNK_SIZE
    head_impl: str = "auto"
    max_length: int | None = None
    truncate: bool = False
    fused: bool | None = None
    share_prefix: bool = False

    def __post_init__(self):
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError(f"chunk_size={self.chunk_size!r} is invalid; expected None or an int >= 1")
        if self.head_impl not in HEAD_IMPLS:
            raise ValueError(f"head_impl={self.head_impl!r} is invalid; expected one of {HEAD_IMPLS}")


def named_options(init):
    """Decorate a front's `__init__` whose options are all named keywords: an unknown keyword raises
    `UnknownOptionError` naming it and the allowed ones (instead of Python's bare TypeError). The
    signature (`inspect.signature`, help()) stays the decorated one."""
    params = inspect.signature(init).parameters
    allowed = [n for n, p in params.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and n != "self"]

    @functools.wraps(init)
    def checked(self, *args, **kwargs):
        unknown = sorted(set(kwargs) - set(allowed))
        if unknown:
            raise UnknownOptionError(f"{type(self).__name__} got unknown options {unknown}; allowed: {sorted(allowed)}")
        return init(self, *args, **kwargs)

    return checked


def _check_type(name: str, what: str, value, cls) -> None:
    if value is not None and not isinstance(value, cls):
        raise TypeError(f"{name}: {what}= must be a {cls.__name__} or None, got {type(value).__name__} {value!r:.60}; "
                        f"options are keyword arguments, e.g. {name}(model, tokenizer, eps=0.2)")


def build_options(name: str, config_cls, config, compute: ComputeOptions | None, given: dict):
    """(config_cls instance, ComputeOptions) from `config`, `compute` and the keyword options `given`.

    given: option name -> value, `UNSET` where not given (left out); those of `config_cls` override
    `config`'s fields, those of `ComputeOptions` `compute`'s.
    """
    _check_type(name, "config", config, config_cls)
    _check_type(name, "compute", compute, ComputeOptions)
    math, how = [f.name for f in fields(config_cls) if f.init], [f.name for f in fields(ComputeOptions)]
    stray = sorted(set(given) - set(math) - set(how))
    if stray:  # a front that names an option no dataclass has: a bug here, not the caller's
        raise AssertionError(f"{name} names options {stray} that neither {config_cls.__name__} nor ComputeOptions has")
    set_ = {k: v for k, v in given.items() if v is not UNSET}
    base = {k: getattr(config, k) for k in math} if config is not None else {}
    cfg = config_cls(**{**base, **{k: v for k, v in set_.items() if k in math}})
    base = {k: getattr(compute, k) for k in how} if compute is not None else {}
    return cfg, ComputeOptions(**{**base, **{k: v for k, v in set_.items() if k in how}})


def old_third_argument(config, config_cls, takes) -> tuple[object, object]:
    """(config, old) from a front's third positional argument, for the fronts whose third positional argument
    was something else before the shared shape: `Distill(student, tok, teacher)`, `DPO(model, tok, ref_model)`,
    `SFT(model, tok, "token_mean")` keep working. A `config_cls` instance (or None) is the config, old =
    `UNSET`; a value that `takes(value)` accepts is the old argument, config = None; anything else stays the
    config (`build_options` then names its type)."""
    if config is None or isinstance(config, config_cls) or not takes(config):
        return config, UNSET
    return None, config


def one_of(name: str, what: str, keyword, positional):
    """`keyword` or `positional` (`old_third_argument`'s), UNSET where neither; TypeError when both are given."""
    if keyword is not UNSET and positional is not UNSET:
        raise TypeError(f"{name} got {what} twice: as the third positional argument and as {what}=")
    return positional if positional is not UNSET else keyword


def split_options(name: str, options: dict, config_cls) -> tuple[dict, ComputeOptions]:
    """Keyword arguments -> (those of `config_cls`, ComputeOptions); `UnknownOptionError` naming unknown ones."""
    compute = {f.name for f in fields(ComputeOptions)}
    math = {f.name for f in fields(config_cls)}
    unknown = sorted(set(options) - compute - math)
    if unknown:
        raise UnknownOptionError(f"{name} got unknown options {unknown}; allowed: {sorted(compute | math)}")
    return ({k: v for k, v in options.items() if k in math},
            ComputeOptions(**{k: v for k, v in options.items() if k in compute}))
