"""The engine flags, one per EngineArgs field with vLLM's names (each knob declared once in
engine/arg_utils.py), and the sampling flags of `generate` and `chat`."""

from __future__ import annotations

import argparse
import dataclasses

from shardlm.engine.arg_utils import VLLM_ALIASES, EngineArgs
from shardlm.executor.selection import BACKENDS
from shardlm.logger import init_logger

logger = init_logger(__name__)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineArgs field, named as vLLM names them."""
    parser.add_argument("--config", default=None, metavar="FILE.yaml",
                        help="flags from a YAML file (flag: value; the command line's win), as vLLM's --config")
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineArgs):
        if f.name == "model":
            parser.add_argument("model", nargs="?", default=None, help=f.metadata["help"])
            group.add_argument("--model", dest="model_option", default=None, metavar="MODEL",
                               help="the model, as vLLM's --model (the positional MODEL wins where both are given)")
            continue
        flags = [f"--{f.name.replace('_', '-')}"] + ([f.metadata["short"]] if f.metadata["short"] else [])
        kwargs = {"dest": f.name, "default": f.default, "help": f.metadata["help"]}
        if isinstance(f.default, bool):
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = _flag_type(f)
        if f.name == "distributed_executor_backend":
            kwargs["choices"] = list(BACKENDS)
        if "list[str]" in f.type:
            kwargs["nargs"] = "+"           # several values, as vLLM's (served names, media domains)
        if f.name == "hf_token":
            kwargs.update(nargs="?", const=True)     # alone: huggingface_hub's stored token
        if kwargs["help"] and f.default is not None and not isinstance(f.default, bool):
            kwargs["help"] += " (default: %(default)s)"
        group.add_argument(*flags, **kwargs)
    group.add_argument("--disable-log-requests", dest="enable_log_requests", action="store_false",
                       help="as --no-enable-log-requests: vLLM's older flag, kept for its command lines")
    knobs = {f.name: f for f in dataclasses.fields(EngineArgs)}
    for alias, name in VLLM_ALIASES.items():
        group.add_argument(f"--{alias.replace('_', '-')}", dest=name, default=argparse.SUPPRESS,
                           type=_flag_type(knobs[name]), help=f"as --{name.replace('_', '-')}: vLLM's name")


def _flag_type(f: dataclasses.Field):
    """From the annotation: "int | str" takes a string (e.g. 4GiB), "float", else int."""
    return str if "str" in f.type else float if "float" in f.type else int


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    args = {f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)}
    option = getattr(ns, "model_option", None)
    if option is not None and args["model"] not in (None, option):
        logger.warning("The model is given twice (%s, and --model %s): serving the positional one, as vLLM does.",
                       args["model"], option)
    args["model"] = args["model"] if args["model"] is not None else option
    return EngineArgs(**args)


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)


def sampling_params_from(ns):
    from shardlm.sampling_params import SamplingParams
    return SamplingParams(temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k, max_tokens=ns.max_tokens)
