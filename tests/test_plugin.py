"""The plugin's registration: every hook names an existing SGLang 0.5.17 symbol, and
``--enable-freetoken`` refuses to run when the plugin or any hook is not in effect (never a
silent fallback to stock SGLang)."""

from __future__ import annotations

import pkgutil

import pytest


def test_every_hook_target_exists_in_this_sglang():
    import sglang

    from freetoken_sglang.patches import SGLANG_VERSION, all_hooks

    assert sglang.__version__ == SGLANG_VERSION
    hooks = all_hooks()
    assert len({h.target for h in hooks}) == len(hooks)
    for hook in hooks:
        owner, _, attr = hook.target.rpartition(".")
        assert hasattr(pkgutil.resolve_name(owner), attr), hook.target
        assert hook.kind in ("before", "after", "around", "replace")


def test_check_hooks_applied(monkeypatch):
    from sglang.srt.plugins.hook_registry import HookRegistry

    from freetoken_sglang import plugin
    from freetoken_sglang.patches import all_hooks

    targets = {h.target for h in all_hooks()}
    monkeypatch.setattr(plugin, "_registered", [])
    with pytest.raises(RuntimeError, match="plugin was not loaded"):
        plugin.check_hooks_applied()
    monkeypatch.setattr(plugin, "_registered", sorted(targets))
    missing = "sglang.srt.server_args.ServerArgs.__init__"
    monkeypatch.setattr(HookRegistry, "_patched", targets - {missing})
    with pytest.raises(RuntimeError, match="did not apply") as e:
        plugin.check_hooks_applied()
    assert missing in str(e.value)
    monkeypatch.setattr(HookRegistry, "_patched", set(targets))
    plugin.check_hooks_applied()


def test_every_runtime_package_is_installed():
    """pyproject.toml lists packages by hand: each folder of freetoken_sglang/ with an
    __init__.py is there (else a non-editable install leaves it out)."""
    import pathlib
    import tomllib

    root = pathlib.Path(__file__).resolve().parent.parent
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    found = {"freetoken_sglang." + p.parent.name
             for p in (root / "freetoken_sglang").glob("*/__init__.py")}
    assert found and found <= listed, sorted(found - listed)
