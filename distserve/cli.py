"""The ``distserve`` command line.

Engine flags are generated from the config dataclasses, so each flag is also a YAML key
(``--block-size`` is ``cache.block_size``) and ``--config FILE`` can set any of them.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from collections.abc import Sequence

from distserve.config import SECTIONS, EngineConfig
from distserve.sampling_params import SamplingParams

# SamplingParams fields whose flag would clash with an engine flag.
_SAMPLING_FLAG_NAMES = {"seed": "sampling_seed"}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, rename: dict[str, str] | None = None) -> None:
    """One flag per dataclass field; values left unset on the command line stay out of the namespace."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        dest = (rename or {}).get(f.name, f.name)
        kind = hints[f.name]
        kwargs: dict[str, typing.Any] = {"dest": dest, "default": argparse.SUPPRESS}
        help_text = f.metadata.get("help", "")
        if f.metadata.get("choices"):
            kwargs["choices"] = f.metadata["choices"]
        args = typing.get_args(kind)
        if isinstance(kind, types.UnionType):  # "X | None": the flag takes an X
            kind = next(a for a in args if a is not type(None))
            args = typing.get_args(kind)
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kind) is list:
            kwargs.update(action="append", type=args[0])
        else:
            kwargs["type"] = kind
        default = f.default if f.default is not dataclasses.MISSING else None
        parser.add_argument(_flag(dest), help=f"{help_text} (default: {default})".strip(), **kwargs)


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    fields = {f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls)}
    given = {k: v for k, v in vars(args).items() if k in fields}
    if args.config:
        return EngineConfig.from_yaml(args.config, **given)
    return EngineConfig.from_flat(**given)


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    options = {}
    for f in dataclasses.fields(SamplingParams):
        dest = _SAMPLING_FLAG_NAMES.get(f.name, f.name)
        if hasattr(args, dest):
            options[f.name] = getattr(args, dest)
    return SamplingParams(**options)


def cmd_generate(args: argparse.Namespace) -> int:
    from distserve.llm import LLM

    params = _sampling_params(args)
    engine = LLM(config=_engine_config(args)).engine  # LLM refuses a one-phase scheduler here
    try:
        for i, prompt in enumerate(args.prompts):
            engine.add_request(prompt, params, request_id=str(i))
        stream = len(args.prompts) == 1
        texts: dict[str, str] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if stream:
                    print(out.new_text, end="", flush=True)
                if out.finished:
                    texts[out.request_id] = out.text
    finally:
        engine.shutdown()
    if stream:
        print()
    else:
        for i, prompt in enumerate(args.prompts):
            print(f"--- {prompt!r}\n{texts[str(i)]}")
    return 0


def cmd_make_model(args: argparse.Namespace) -> int:
    from distserve.tiny_models import make_tiny_model

    out = make_tiny_model(args.name, args.out)
    print(f"wrote {args.name} to {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from distserve.tiny_models import TINY_MODELS

    parser = argparse.ArgumentParser(prog="distserve", description="Disaggregated prefill/decode LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for prompts with an in-process engine")
    gen.add_argument("prompts", nargs="+", help="prompt texts")
    gen.add_argument("--config", help="YAML file with model/cache/scheduler sections; flags override it")
    for cls in SECTIONS.values():
        add_dataclass_args(gen.add_argument_group(cls.__name__), cls)
    add_dataclass_args(gen.add_argument_group("SamplingParams"), SamplingParams, _SAMPLING_FLAG_NAMES)
    gen.set_defaults(func=cmd_generate)

    make = sub.add_parser("make-model", help="write a built-in tiny model as a Hugging Face directory")
    make.add_argument("name", choices=TINY_MODELS)
    make.add_argument("--out", required=True, help="directory to write")
    make.set_defaults(func=cmd_make_model)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"distserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
