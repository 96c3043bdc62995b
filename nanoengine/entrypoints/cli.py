"""The ``nanoengine`` command: ``nanoengine serve [MODEL] [flags]`` and ``nanoengine proxy``.

Chapter 8 (online serving). The engine arguments are checked before anything
starts (``create_engine_config`` reads the model's config, no weights). A value
the engine refuses -- a bad ``--speculative-config`` (chapter 9), a model that
cannot be found -- ends the command with one line in argparse's own form
(``nanoengine serve: error: ...``, exit status 2), as a flag of the wrong type
does: a traceback would bury the one sentence the user needs.

``nanoengine proxy --prefill URL... --decode URL...`` (chapter 10) starts the
proxy of ``disagg_proxy.py`` in front of prefill and decode servers.

vLLM 0.32 counterpart: ``vllm/entrypoints/cli/main.py`` and
``vllm/entrypoints/cli/serve.py`` (the ``vllm serve`` subcommand).
"""

from __future__ import annotations

import sys

from nanoengine.engine.arg_utils import EngineArgs
from nanoengine.entrypoints import disagg_proxy
from nanoengine.entrypoints.openai import api_server

_USAGE = ("usage: nanoengine serve [MODEL] [--host H] [--port P] [--api-key KEY] [engine arguments]\n"
          "       nanoengine proxy --prefill URL [URL ...] --decode URL [URL ...] [--host H] [--port P]")


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "proxy":
        disagg_proxy.main(args[1:])
        return
    if not args or args[0] != "serve":
        sys.exit(f"{_USAGE}\n(the subcommands are 'serve' and 'proxy'; 'nanoengine serve --help' lists the flags)")
    parser = api_server.make_arg_parser()
    parsed = parser.parse_args(args[1:])
    try:
        # Checked here, in this process, before the engine core's process is
        # started; the server checks again when it builds the engine, which
        # costs one more read of config.json.
        EngineArgs.from_cli_args(parsed).create_engine_config()
    except (ValueError, TypeError) as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    api_server.run_server(parsed)


if __name__ == "__main__":
    main()
