"""One log format for the api process and every actor process.

The api process calls `configure(level)` from the CLI; that also exports
TRILLIUM_LOG_LEVEL, so actor processes (started by the supervisor, which
calls `configure_from_env(actor)`) log at the same level, to the same
stderr, with the actor's name in each line.
"""

from __future__ import annotations

import logging
import os

ENV_VAR = "TRILLIUM_LOG_LEVEL"
_FORMAT = "%(asctime)s %(levelname)s {where}%(name)s: %(message)s"


def configure(level: str) -> None:
    os.environ[ENV_VAR] = level.upper()
    logging.basicConfig(level=level.upper(), format=_FORMAT.format(where=""))


def configure_from_env(actor: str) -> None:
    level = os.environ.get(ENV_VAR)
    if level:
        logging.basicConfig(level=level, format=_FORMAT.format(where=f"[{actor}] "))
