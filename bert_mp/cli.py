"""The ``bert-mp`` command line: prepare, train, sweep, report, finetune, glue, predict, export, config.

Each subcommand reads a YAML recipe plus dotted overrides, writes a self-describing output folder,
and can be run alone. Problems with the user's input end in one line on stderr (exit code 2), not
a traceback; ``--debug`` shows the traceback. Ctrl-C ends in one line too, ``interrupted (SIGINT)``
(with what was left on disk where data was being prepared), exit code 130, with ``--debug`` as well.
``bert-mp launch`` runs ``train`` / ``finetune`` under ``accelerate launch`` (bert_mp.launch.command).
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import warnings
from typing import Any

from bert_mp.core.process import console, notes
from bert_mp.core.process.noise import quiet_libraries
from bert_mp.errors import BertMPError, BertMPWarning, Interrupted

# subcommand -> (module, function, help). Modules are imported lazily so `bert-mp --help` is instant.
COMMANDS = {
    "prepare": (
        "bert_mp.data.prepare.build",
        "command",
        "raw text -> NSP + MLM pretraining data (cached by config hash)",
    ),
    "train": (
        "bert_mp.pretrain.trainer",
        "command",
        "pretrain BertForPreTraining under fp32 / tf32 / bf16 / fp16",
    ),
    "sweep": ("bert_mp.sweep.runner", "command", "run a precision sweep and write the loss-parity report"),
    "report": ("bert_mp.sweep.report", "command", "(re)write the report of a sweep folder"),
    "finetune": ("bert_mp.finetune.trainer", "command", "fine-tune a checkpoint for sequence classification"),
    "glue": (
        "bert_mp.finetune.glue",
        "command",
        "fine-tune a checkpoint on the GLUE tasks: per-task table, glue.json, the GLUE average",
    ),
    "predict": (
        "bert_mp.finetune.predict",
        "command",
        "a fine-tuned classifier over a data file -> predictions (+ metrics)",
    ),
    "export": (
        "bert_mp.pretrain.export",
        "command",
        "a checkpoint (even of a stopped run) -> a Hugging Face folder",
    ),
    "launch": (
        "bert_mp.launch.command",
        "command",
        "accelerate launch train|finetune on N processes; Ctrl-C / SIGTERM exit 130 / 143 with one line",
    ),
    "config": (
        "bert_mp.config_reference",
        "command",
        "every config key with its type, default and description",
    ),
}
CHECKED_FIRST = ("prepare", "train", "finetune")
"""Commands whose config is loaded (and a mistake in it reported) before their module is imported:
half the start-up time (transformers and datasets are not needed to say that a key is wrong)."""
THREADED = ("train", "finetune", "glue")
"""Commands that take ``cores // local processes`` threads unless OMP_NUM_THREADS / MKL_NUM_THREADS is set."""
CONFIG_EPILOG = (
    "Every key, its default and what it does: `bert-mp config` (or `bert-mp config train`, "
    "`bert-mp config data.max_seq_length`)."
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bert-mp",
        description="BERT pretraining with Hugging Face, built for mixed-precision work.",
    )
    p.add_argument("--debug", action="store_true", help="show full tracebacks")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, _, help_) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_, description=help_, epilog=CONFIG_EPILOG)
        if name == "report":
            sp.add_argument("path", help="sweep output folder")
        elif name == "predict":
            from bert_mp.finetune.predict_args import add_arguments

            add_arguments(sp)
        elif name == "glue":
            from bert_mp.finetune import glue_args

            glue_args.add_arguments(sp)
        elif name == "export":
            sp.add_argument(
                "path", help="a train run folder (its newest complete checkpoint) or a checkpoint folder"
            )
            sp.add_argument("--out", help="destination folder (default: <run>/export-step_N)")
            sp.add_argument(
                "--push_to_hub",
                metavar="REPO",
                help="then upload the folder to this Hub model repository (user/name) with huggingface_hub",
            )
            sp.add_argument("--revision", help="with --push_to_hub: the branch to push to (e.g. step-1000)")
            sp.add_argument(
                "--private", action="store_true", help="with --push_to_hub: create the repository private"
            )
        elif name == "launch":  # parsed by bert_mp.launch.command (accelerate's options come first)
            sp.add_argument(
                "args", nargs=argparse.REMAINDER, help="[accelerate launch options] train|finetune ..."
            )
        elif name == "config":
            sp.add_argument("selector", nargs="?", help="a section (train) or a key prefix (train.fp16)")
        else:
            sp.add_argument(
                "args",
                nargs="*",
                metavar="[CONFIG.yaml] [key=value ...]",
                help="an optional YAML recipe followed by dotted overrides, e.g. train.precision=bf16",
            )
        if name == "prepare":
            sp.add_argument("--force", action="store_true", help="rebuild even if a cached copy exists")
        sp.add_argument("--debug", action="store_true", help="show full tracebacks")
    return p


def split_config_args(args: list[str]) -> tuple[str | None, list[str]]:
    """First positional may be a YAML path; the rest must be key=value overrides."""
    config = None
    rest = list(args)
    if rest and "=" not in rest[0]:
        config = rest.pop(0)
    bad = [a for a in rest if "=" not in a]
    if bad:
        raise BertMPError(f"expected key=value overrides after the config file, got {bad[0]!r}")
    return config, rest


_PLAIN_FORMAT = warnings.formatwarning


def _format_warning(message, category, filename, lineno, line=None):  # noqa: ANN001 (warnings' signature)
    """:class:`BertMPWarning` as ``bert-mp <command>: warning: ...`` (no source line under it), on the
    main process only (every process of a launch would warn alike)."""
    if issubclass(category, BertMPWarning):
        return f"{console.speaker()}: warning: {message}\n" if console.is_main_process() else ""
    return _PLAIN_FORMAT(message, category, filename, lineno, line)


def _launch(argv: list[str]) -> int:
    """``bert-mp launch ...``: accelerate launch's own options come before the command, so argparse
    does not see them."""
    console.set_command("launch")
    try:
        launch = importlib.import_module("bert_mp.launch.command")
        if argv[:1] not in (["-h"], ["--help"], []):  # a config mistake: one line before any process starts
            from bert_mp.core.config import load_config

            _, cmd, args = launch.split_launch_args(argv)
            cfg = load_config(*split_config_args(args))
            if cmd == "train":
                from bert_mp.data.prepare.cache import check_corpus

                check_corpus(cfg.data)
        return int(launch.command(argv) or 0)
    except BertMPError as e:
        print(f"bert-mp launch: error: {e}", file=sys.stderr)
        return 2


def _check_model_references(command: str, cfg: Any) -> None:
    """Where the weights come from (``model.init_from``; ``finetune.checkpoint`` and ``.tokenizer``),
    checked before the command's libraries load: a mistyped folder or an unknown Hub name is one line at
    once, not after torch's and transformers' start-up. Loading them resolves them again from this
    process's memory (the Hub is asked once a process: bert_mp.model.hub)."""
    if command == "train" and cfg.model.init_from:
        from bert_mp.model.sources import check_init_from

        check_init_from(cfg.model)
    elif command == "finetune" and cfg.finetune.checkpoint:  # an unset one: the command says so
        from bert_mp.finetune.model import resolve_checkpoint, resolve_tokenizer

        resolve_checkpoint(cfg.finetune.checkpoint)
        if cfg.finetune.tokenizer:
            resolve_tokenizer(cfg.finetune.tokenizer)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["launch"]:
        return _launch(argv[1:])
    parser = build_parser()
    ns, extra = parser.parse_known_args(argv)
    if extra:  # glue's overrides may follow its options (argparse ends a positional list at an option)
        if ns.command != "glue" or any(x.startswith("-") for x in extra):
            parser.parse_args(argv)  # argparse's own error line, exit 2
        ns.args = [*ns.args, *extra]
    debug = ns.debug or os.environ.get("BERT_MP_DEBUG") == "1"
    console.set_command(ns.command)
    if ns.command in THREADED:
        notes.guard_stderr_under_launch()  # a rank whose launcher is killed still finishes and saves
    warnings.formatwarning = _format_warning
    quiet_libraries(debug)
    module_name, func_name, _ = COMMANDS[ns.command]
    try:
        if ns.command in CHECKED_FIRST:
            from bert_mp.core.config import load_config

            cfg = load_config(*split_config_args(ns.args))
            if ns.command == "train":  # a mistyped corpus path before the start-up work, as prepare says it
                from bert_mp.data.prepare.cache import check_corpus

                check_corpus(cfg.data)
            _check_model_references(ns.command, cfg)
        elif ns.command == "glue":
            from bert_mp.finetune.glue_args import load_request

            request = load_request(ns.checkpoint, *split_config_args(ns.args), ns.data, ns.tasks)
            cfg = request.cfg
            _check_model_references("finetune", cfg)
        func = getattr(importlib.import_module(module_name), func_name)
        if ns.command in THREADED:
            from bert_mp.core.numerics.subnormal import flush_denormal
            from bert_mp.core.process.conditions import apply_default_threads

            apply_default_threads()
            if cfg.hardware.flush_denormal:  # before torch's thread pool starts: its threads inherit it
                flush_denormal(True)
        if ns.command == "report":
            return int(func(ns.path) or 0)
        if ns.command == "predict":
            return int(func(ns) or 0)
        if ns.command == "glue":
            return int(func(request) or 0)
        if ns.command == "export":
            return int(func(ns.path, ns.out, ns.push_to_hub, ns.revision, ns.private) or 0)
        if ns.command == "config":
            return int(func(ns.selector) or 0)
        if ns.command == "sweep":
            return int(func(*split_config_args(ns.args)) or 0)
        kwargs = {"force": ns.force} if ns.command == "prepare" else {}
        code = int(func(cfg, **kwargs) or 0)  # the config loaded and checked above, once
        if ns.command in THREADED:
            console.ended(code)  # under bert-mp launch: its exit code, without torch elastic's report
        return code
    except BertMPError as e:
        if debug:
            raise
        code = getattr(e, "exit_code", 2)
        console.error(f"bert-mp {ns.command}: error: {e}", code)
        return code
    except KeyboardInterrupt as e:  # Ctrl-C: one line, with or without --debug
        stop = e if isinstance(e, Interrupted) else Interrupted(signal.SIGINT)
        if console.is_main_process():
            print(stop.line(ns.command), file=sys.stderr)
        return 128 + stop.signum
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
