"""Fixtures the gateway's tests share: the calculator environment and one served gateway per module.

A module sets `SERVED = dict(...)` to change the served generator's sampling (defaults below)."""

import pytest

from tests.support.gateway_helpers import calc_env

SERVED_DEFAULTS = dict(max_new_tokens=40, temperature=1.0, tool_call_stop=["</tool_call>"])


@pytest.fixture(scope="module")
def env():
    """The calculator tool environment the embedded model was trained with."""
    return calc_env()


@pytest.fixture(scope="module")
def served(request, calc):
    """(gateway, base url): one server over the embedded model for the module; tests name their own sessions."""
    pytest.importorskip("fastapi")
    from SimpleTorchLLMRL.gateway import Gateway
    from tests.support.generation_helpers import make_generator

    model, tok = calc
    options = SERVED_DEFAULTS | getattr(request.module, "SERVED", {})
    gw = Gateway(make_generator(model, tok, seed=0, **options))
    with gw.serve() as url:
        yield gw, url
