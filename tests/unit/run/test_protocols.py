"""A backend's class is checked against the protocol its `kind` names, with the methods that protocol declares
(kvbench.run.backend.methods_of), so a method added to a protocol is required of every backend of that kind."""

from __future__ import annotations

import inspect

import pytest

from kvbench.run.backend import PROTOCOLS, methods_of, protocol_of
from kvbench.run.plugins import BACKENDS, load_backend


def test_each_protocol_requires_its_own_methods_and_its_bases():
    for kind, proto in PROTOCOLS.items():
        methods = methods_of(proto)
        own = {n for n, v in vars(proto).items() if inspect.isfunction(v) or isinstance(v, classmethod)}
        assert {n for n in own if not n.startswith("_")} <= set(methods), kind
        assert {"cli_options", "config"} <= set(methods), kind  # the Backend base every protocol extends
    assert set(methods_of(PROTOCOLS.get("offline"))) < set(methods_of(PROTOCOLS.get("streaming")))


@pytest.mark.parametrize("kind", list(PROTOCOLS))
def test_a_class_that_lacks_one_method_of_its_protocol_is_refused(kind):
    for missing in methods_of(PROTOCOLS.get(kind)):
        body = {m: (lambda self: None) for m in methods_of(PROTOCOLS.get(kind)) if m != missing}
        cls = type("Partial", (), {"kind": kind, **body})
        with pytest.raises(TypeError, match=f"declares kind = '{kind}'.* but has no {missing}$"):
            protocol_of(cls, "partial")


def test_every_installed_backend_implements_its_protocol():
    for name in BACKENDS:
        cls = load_backend(name)
        assert all(callable(getattr(cls, m)) for m in methods_of(protocol_of(cls, name))), name
