"""The ``nanoengine`` command: ``nanoengine serve [MODEL] [flags]``.

Chapter 8 (online serving). vLLM 0.32 counterpart: ``vllm/entrypoints/cli/main.py``
and ``vllm/entrypoints/cli/serve.py`` (the ``vllm serve`` subcommand).
"""

from __future__ import annotations

import sys

from nanoengine.entrypoints.openai import api_server

_USAGE = "usage: nanoengine serve [MODEL] [--host H] [--port P] [--api-key KEY] [engine arguments]"


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] != "serve":
        sys.exit(f"{_USAGE}\n(the only subcommand is 'serve'; 'nanoengine serve --help' lists the flags)")
    api_server.main(args[1:])


if __name__ == "__main__":
    main()
