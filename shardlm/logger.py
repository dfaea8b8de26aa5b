"""One logging set-up for the whole package: `INFO shardlm.engine: message` lines on stderr."""

import logging
import sys

from shardlm import envs

_configured = False
_FORMAT = "%(levelname)s %(asctime)s {prefix}%(name)s: %(message)s"


def init_logger(name: str) -> logging.Logger:
    global _configured
    if not _configured:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT.format(prefix=""), datefmt="%H:%M:%S"))
        root = logging.getLogger("shardlm")
        root.addHandler(handler)
        root.setLevel(envs.SHARDLM_LOG_LEVEL.upper())
        root.propagate = False
        _configured = True
    return logging.getLogger(name)


def set_log_prefix(prefix: str) -> None:
    """Mark every line of this process, e.g. '(rank 1) ' in a worker."""
    init_logger("shardlm")
    for handler in logging.getLogger("shardlm").handlers:
        handler.setFormatter(logging.Formatter(_FORMAT.format(prefix=prefix), datefmt="%H:%M:%S"))
