"""One logging set-up for the whole package: `INFO shardlm.engine: message` lines on stderr."""

import logging
import sys

from shardlm import envs

_configured = False


def init_logger(name: str) -> logging.Logger:
    global _configured
    if not _configured:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s",
                                               datefmt="%H:%M:%S"))
        root = logging.getLogger("shardlm")
        root.addHandler(handler)
        root.setLevel(envs.SHARDLM_LOG_LEVEL.upper())
        root.propagate = False
        _configured = True
    return logging.getLogger(name)
