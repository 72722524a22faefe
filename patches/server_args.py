"""Hooks into SGLang 0.5.17's ``sglang.srt.server_args.ServerArgs``: the FreeToken flags.

- ``ServerArgs.add_cli_args`` (after): adds ``--enable-freetoken`` and ``--freetoken-*``.
- ``ServerArgs.from_cli_args`` (around): carries the parsed flags, which are not dataclass
  fields, into the constructor; a FreeToken refusal (``errors.RefusedError``) ends the
  command with its one-line message and exit code 2, no traceback (kept with
  ``--log-level debug``).
- ``ServerArgs.__init__`` (around): takes ``enable_freetoken`` / ``freetoken_*`` keywords
  (so ``sglang.Engine(enable_freetoken=True, freetoken_cache_ratio=0.25)`` works), applies
  the ServerArgs changes the mode needs before SGLang's ``__post_init__``, refuses an
  unsupported model before any process starts, and stores the config as
  ``server_args.freetoken`` (pickled with it to the scheduler processes).
"""

from __future__ import annotations

import contextvars
import sys

from freetoken_sglang import config as ft_config
from freetoken_sglang.errors import EXIT_REFUSED, RefusedError
from freetoken_sglang.patches import Hook

_cli_flags: contextvars.ContextVar = contextvars.ContextVar(
    "freetoken_cli_flags", default=None
)


def add_cli_args(result, parser):
    ft_config.add_cli_args(parser)


def from_cli_args(original, cls, args):
    flags = {
        k: v
        for k, v in vars(args).items()
        if k == "enable_freetoken" or k.startswith("freetoken_")
    }
    token = _cli_flags.set(flags)
    try:
        server_args = original(cls, args)
    except RefusedError as e:
        if getattr(args, "log_level", None) == "debug":
            raise
        sys.stderr.write(f"FreeToken refused to start: {e}\n")
        sys.exit(EXIT_REFUSED)
    finally:
        _cli_flags.reset(token)
    if getattr(server_args, ft_config.SERVER_ARGS_ATTR, None) is not None:
        from freetoken_sglang.patches.engine import LAUNCHED_FROM_CLI

        LAUNCHED_FROM_CLI["value"] = True
    return server_args


def server_args_init(original, self, *args, **kwargs):
    pending = _cli_flags.get()
    if pending is not None:
        _cli_flags.set(None)  # once: a nested ServerArgs must not inherit the CLI flags
        kwargs.update(pending)
    cfg = ft_config.pop_config(kwargs)
    if cfg is not None:
        from freetoken_sglang.errors import take_note
        from freetoken_sglang.plugin import check_hooks_applied

        take_note()  # a note an earlier launch of this pid left is not this launch's

        check_hooks_applied()
        kwargs = ft_config.apply_server_args_overrides(kwargs, cfg)
    original(self, *args, **kwargs)
    if cfg is not None:
        from freetoken_sglang.families import check_model_path

        check_model_path(self.model_path, self.trust_remote_code, self.revision)
    # ServerArgs is read-only once resolved; the config is an extension attribute, not a
    # resolved SGLang field, so it is set past that guard.
    object.__setattr__(self, ft_config.SERVER_ARGS_ATTR, cfg)


HOOKS = [
    Hook("sglang.srt.server_args.ServerArgs.add_cli_args", add_cli_args, "after"),
    Hook("sglang.srt.server_args.ServerArgs.from_cli_args", from_cli_args, "around"),
    Hook("sglang.srt.server_args.ServerArgs.__init__", server_args_init, "around"),
]
