"""``fastrl train``: the command line generated from ``TrainConfig``.

Every field of ``TrainConfig`` is an option (``--lr 1e-4``, ``--algorithm ppo``); a YAML file
given with ``--config run.yaml`` sets any of them, and later options override it. Unknown
names are an error, before any model is loaded. ``--print_config`` shows the resolved
configuration and exits.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
import sys
import typing

from fastrl.train.config import AGENT_FIELDS, ALGORITHM_PRESETS, TrainConfig

DESCRIPTION = """Train a causal LM with GRPO-family algorithms or PPO.

With no options: the embedded default, offline on a CPU in a few minutes -- a tiny model
built from a config, the built-in arithmetic task and tokenizer, a short supervised
warm-up, then GRPO; held-out accuracy before and after is printed.
With --model and --dataset: any Hugging Face causal LM and a jsonl/parquet/hub dataset.
With --env calculator|sql|frozenlake|module:Class: an agent trained on multi-turn, tool-using
trajectories (a built-in environment brings its rows, tiny model and warm-up).
Algorithms: """ + ", ".join(f"{k} ({v.citation})" for k, v in ALGORITHM_PRESETS.items())

EPILOG = """Options are spelled with underscores (--group_size 8), as in a --config YAML file; the
dashed spelling (--group-size 8) is accepted too. Booleans take a value: --overwrite true.
--debug (or FASTRL_DEBUG=1) shows the traceback of an input error."""


# `fastrl train --help` shows the options in these groups, in this order; every TrainConfig
# field is in exactly one (tests/train/test_train_cli.py checks it).
HELP_GROUPS: dict[str, tuple[str, ...]] = {
    "model": ("model", "tokenizer", "dtype", "device", "model_hidden_size", "model_layers", "model_heads", "threads"),
    "data": ("dataset", "dataset_split", "eval_dataset", "eval_fraction", "prompt_column", "chat_template",
             "max_prompt_length", "drop_long_prompts", "task_digits", "task_operations", "task_train_size",
             "task_eval_size"),
    "warm-up (supervised, before RL)": ("sft_steps", "sft_target_accuracy", "sft_warmup_steps", "sft_probe_rows",
                                        "sft_check_every", "sft_probe_sooner", "sft_lr", "sft_batch_size", "sft_answer_weight", "sft_layout"),
    "algorithm": ("algorithm", "clip_low", "clip_high", "dual_clip", "loss_agg", "surrogate", "advantage_mode",
                  "kl_coef", "kl_estimator", "kl_in_reward", "kl_target", "kl_horizon", "entropy_coef",
                  "rollout_correction", "is_cap", "is_level", "critic_init", "critic_lr", "value_clip", "gamma",
                  "lam", "whiten_advantages",
                  "turn_gamma", "step_coef", "turn_norm", "turn_coef", "outcome_coef", "final_turn_coef"),
    "rewards": ("rewards", "reward_weights", "reward_timeout", "reward_workers"),
    "rollout": ("sampler", "sampler_url", "sampler_timeout", "sampler_decode", "async_steps", "group_size", "prompts_per_step",
                "prompt_token_budget", "max_new_tokens", "temperature", "top_p", "top_k", "dynamic_sampling",
                "max_resample_rounds", "rollout", "tree_branches", "tree_depths", "tree_turns", "sync_probe_every", "sync_probe_tolerance"),
    "optimisation": ("steps", "max_seconds", "max_generated_tokens", "ppo_epochs", "mini_batches", "shared_prefix",
                     "prefix_tree", "activation_checkpointing", "offload_activations", "reference_offload", "micro_batch_tokens", "lr", "weight_decay",
                     "adam_betas", "warmup_steps", "min_lr_ratio", "grad_clip", "seed"),
    "logging and evaluation": ("eval_every", "eval_prompts", "pass_k", "tensorboard", "progress"),
    "output and checkpoints": ("output_dir", "save_every", "save_every_minutes", "keep_checkpoints", "overwrite", "resume"),
    "agents (--env)": ("env", "env_workers", "env_step_timeout", "env_trajectory_timeout", "env_call_format",
                       "env_max_repeated_calls", "env_reward_weight", *AGENT_FIELDS),
}


# a jsonargparse type error: the option's key, then (last) the value it was given
_TYPE_ERROR = re.compile(r'Parser key "(?P<key>[^"]+)":.*(?:Expected a|Does not validate)', re.S)
_GIVEN_VALUE = re.compile(r"(?:Given value|Got value): (?P<value>.*)")


def describe_type(tp, *, plural: bool = False) -> str:
    """What values of the field type ``tp`` are accepted, in words (``Optional[float]`` ->
    "a finite number (or null)"). jsonargparse refuses nan and inf for a float."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union:
        rest = [a for a in args if a is not type(None)]
        words = " or ".join(describe_type(a, plural=plural) for a in rest)
        return words + (" (or null)" if len(rest) < len(args) else "")
    if origin is typing.Literal:
        return "one of " + ", ".join(str(a) for a in args)
    if origin in (list, tuple):
        item = args[0] if args else str
        return f"a list of {describe_type(item, plural=True)} (e.g. [a, b])"
    words = {int: ("an integer", "integers"), float: ("a finite number", "finite numbers"),
             bool: ("true or false", "true/false values"), str: ("a string", "strings")}
    if tp in words:
        return words[tp][plural]
    return f"a value of type {getattr(tp, '__name__', tp)}"


def explain_type_error(message: str, argv: list[str], field_types: dict) -> str | None:
    """A jsonargparse type error as one line: ``--lr: expected a finite number (or null),
    got 'inf'``; ``None`` for any other message. The value is the one on the command line
    when it is there (a list's element otherwise names only the wrong element), else the
    parser's."""
    match = _TYPE_ERROR.search(message)
    if not match or match.group("key") not in field_types:
        return None
    key = match.group("key")
    given = _GIVEN_VALUE.findall(message)
    value = given[-1].strip() if given else None
    option = f"--{key}"
    for i, token in enumerate(argv):
        name, eq, rest = token.partition("=")
        if name == option:
            value = rest if eq else (argv[i + 1] if i + 1 < len(argv) else value)
    got = f", got {value!r}" if value is not None else ""
    choices = [str(a) for a in _literal_choices(field_types[key])]
    close = difflib.get_close_matches(str(value), choices, n=1, cutoff=0.6) if choices and value is not None else []
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"{option}: expected {describe_type(field_types[key])}{got}{hint}"


_UNKNOWN_KEY = re.compile(r"Option '(?P<key>[^']+)' is not accepted")


def config_files(argv: list[str]) -> list[str]:
    """The ``--config`` files of a command line, in order."""
    files = []
    for i, token in enumerate(argv):
        name, eq, rest = token.partition("=")
        if name == "--config":
            files.append(rest if eq else (argv[i + 1] if i + 1 < len(argv) else ""))
    return files


def explain_config_key(message: str, argv: list[str]) -> str | None:
    """jsonargparse's "Option 'group_sizes' is not accepted" from a ``--config`` file as one
    line naming the file, the key and the closest option; ``None`` for any other message."""
    match = _UNKNOWN_KEY.search(message)
    files = config_files(argv)
    if not match or not files:
        return None
    key = match.group("key")
    fields = [f.name for f in dataclasses.fields(TrainConfig)]
    close = difflib.get_close_matches(key, fields, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]}?)" if close else " (fastrl train --help lists the options)"
    where = next((f for f in files if _file_has_key(f, key)), files[-1])
    return f"--config {where}: unknown key {key!r}{hint}"


def _file_has_key(path: str, key: str) -> bool:
    try:
        with open(path) as handle:
            return re.search(rf"^\s*{re.escape(key)}\s*:", handle.read(), flags=re.M) is not None
    except OSError:
        return False


def _literal_choices(tp) -> tuple:
    """The values of the ``Literal`` in ``tp`` (``Optional[Literal[...]]`` included), else ``()``."""
    if typing.get_origin(tp) is typing.Literal:
        return typing.get_args(tp)
    return tuple(a for arg in typing.get_args(tp) if typing.get_origin(tp) is typing.Union for a in _literal_choices(arg))


def _parser_class():
    from jsonargparse import ArgumentParser

    from fastrl import cli_style

    class TrainArgumentParser(ArgumentParser):
        """jsonargparse's parser with fastrl's CLI convention (fastrl/cli_style.py)."""

        def parse_args(self, args=None, namespace=None, **kwargs):
            args = sys.argv[1:] if args is None else list(args)
            self._fastrl_argv = cli_style.normalize_spelling(args, self._option_string_actions)
            return super().parse_args(self._fastrl_argv, namespace, **kwargs)

        def error(self, message, ex=None):
            field_types = typing.get_type_hints(TrainConfig)
            argv = getattr(self, "_fastrl_argv", [])
            message = explain_type_error(message, argv, field_types) or explain_config_key(message, argv) or message
            cli_style.print_usage_error(self.prog, message, self._option_string_actions)
            self.exit(cli_style.USAGE_ERROR_STATUS)

    return TrainArgumentParser


def _group_help(parser) -> None:
    """Move each TrainConfig option into its HELP_GROUPS section of --help."""
    flat = parser._action_groups[1]  # argparse's "options" group, where add_class_arguments put them
    by_dest = {a.dest: a for a in flat._group_actions}
    for title, names in HELP_GROUPS.items():
        group = parser.add_argument_group(title)
        for name in names:
            for dest in (name, f"{name}+"):  # list fields also get an append action
                action = by_dest.get(dest)
                if action is not None:
                    flat._group_actions.remove(action)
                    group._group_actions.append(action)


def _agent_help(parser) -> None:
    """The --help text of the options derived from ``AgentConfig`` (``AGENT_FIELDS``): that
    class's field docstrings, so the words are written once."""
    from docstring_parser import parse_from_object

    from fastrl.agents.driver import AgentConfig

    docs = {p.arg_name: " ".join(p.description.split()) for p in parse_from_object(AgentConfig).params}
    defaults = AgentConfig()
    for action in parser._actions:
        if action.dest in AGENT_FIELDS:
            action.help = (f"{docs.get(action.dest, '')} None: the environment's default "
                           f"(a user's environment: {getattr(defaults, action.dest)!r}).")


def build_train_parser():
    from jsonargparse import ActionConfigFile, set_parsing_settings

    # field docstrings become the --help text of each option
    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    parser = _parser_class()(prog="fastrl train", usage="%(prog)s [--config FILE] [OPTIONS]", description=DESCRIPTION, exit_on_error=True, allow_abbrev=False,
                             epilog=EPILOG, formatter_class=_formatter())
    parser.add_argument("--config", action=ActionConfigFile, help="A YAML file of options (any field below).")
    parser.add_class_arguments(TrainConfig, None, as_group=False)
    _agent_help(parser)
    _group_help(parser)
    return parser


def _formatter():
    from jsonargparse import DefaultHelpFormatter

    class Formatter(DefaultHelpFormatter):
        def _fill_text(self, text, width, indent):  # keep the description's and epilog's line breaks
            return "".join(indent + line for line in text.splitlines(keepends=True))

    return Formatter


def expand_sampler_url(argv: list[str]) -> list[str]:
    """``--sampler vllm-server URL`` (the server's address right after the sampler's name)
    as ``--sampler vllm-server --sampler_url URL``."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        out.append(a)
        if a in ("--sampler", "--sampler=vllm-server"):
            name_given = a == "--sampler=vllm-server"
            if not name_given and i + 1 < len(argv):
                out.append(argv[i + 1])
                name_given = argv[i + 1] == "vllm-server"
                i += 1
            if name_given and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
                out += ["--sampler_url", argv[i + 1]]
                i += 1
        i += 1
    return out


def _list_fields() -> dict[str, type]:
    """TrainConfig's list options (``Optional[list[X]]`` included) -> their item type."""
    out = {}
    for name, tp in typing.get_type_hints(TrainConfig).items():
        for candidate in (tp, *typing.get_args(tp)):
            if typing.get_origin(candidate) is list:
                out[name] = (typing.get_args(candidate) or (str,))[0]
    return out


def _is_value(token: str) -> bool:
    """A command-line word that is a value, not an option (``-1.5`` is a value)."""
    return not token.startswith("-") or re.fullmatch(r"-\d[\d.e+-]*|-inf|-\.\d+", token) is not None


def expand_list_values(argv: list[str]) -> list[str]:
    """A list option given as plain words, ``--rewards f1 f2`` or ``--rewards probe.py:record``,
    as the list jsonargparse parses (``--rewards ["f1", "f2"]``); a value already written as a
    list (``'[f1, f2]'``) or ``null`` is left as it is."""
    fields = _list_fields()
    out: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        name, eq, inline = token.partition("=")
        key = name[2:].replace("-", "_") if name.startswith("--") else None
        if key not in fields:
            out.append(token)
            i += 1
            continue
        values = [inline] if eq else []
        j = i + 1
        if not eq:
            while j < len(argv) and _is_value(argv[j]):
                values.append(argv[j])
                j += 1
        if not values or values[0].lstrip().startswith("[") or (len(values) == 1 and values[0] in ("null", "None")):
            out.extend([token] if eq else argv[i:j])
        else:
            items = [json.dumps(v) for v in values] if fields[key] is str else values
            out.extend([f"--{key}", "[" + ", ".join(items) + "]"])
        i = j
    return out


def parse_train_args(argv: list[str]) -> TrainConfig:
    """The resolved ``TrainConfig`` of a ``fastrl train`` command line. A parse error exits
    with status 2 (usage line + error); an invalid combination raises ``InputError``."""
    from fastrl.errors import InputError

    parser = build_train_parser()
    ns = parser.parse_args(expand_list_values(expand_sampler_url(argv)))
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(TrainConfig)}
    config = TrainConfig(**values)
    try:
        return config.resolved()
    except InputError:
        raise
    except ValueError as e:  # TrainConfig's checks name the field: a user's mistake
        raise InputError(str(e)) from e


def run_train(argv: list[str]) -> int:
    from fastrl.train.run.interrupt import RunInterrupted, StopRequests, exit_status, interrupted_message

    config = trainer = None
    try:
        with StopRequests() as stop:  # from the first import on: a Ctrl-C anywhere is one line, never a traceback
            from fastrl.train.run.progress import describe_run, quiet_hf_progress_bars

            config = parse_train_args(argv)
            if os.environ.get("RANK", "0") == "0":
                print(describe_run(config), file=sys.stderr, flush=True)
            quiet_hf_progress_bars()  # transformers' shard-writing bars would interleave with fastrl's lines
            from fastrl.rollout.process import SamplerProcessError
            from fastrl.rollout.remote import ServerError, ServerTimeout, ServerUnavailable
            from fastrl.train.trainer import Trainer, TrainingDivergedError, WeightSyncError

            try:
                with Trainer(config, stop=stop) as trainer:
                    result = trainer.train(stop=stop)
            except (TrainingDivergedError, WeightSyncError) as e:
                print(f"fastrl train: stopped: {e}", file=sys.stderr)
                return 3
            except (ServerError, ServerTimeout, ServerUnavailable) as e:
                # the shared vLLM server failed, stopped or restarted: the run's checkpoints are intact
                print(f"fastrl train: stopped: {e}\nStart the server again and continue the run with --resume latest "
                      f"(from the last checkpoint in {config.output_dir}).", file=sys.stderr)
                return 4
            except SamplerProcessError as e:  # async_steps: the sampler process failed or timed out
                print(f"fastrl train: stopped: {e}\nContinue the run with --resume latest (from the last checkpoint in "
                      f"{config.output_dir}).", file=sys.stderr)
                return 4
    except RunInterrupted as e:  # Ctrl-C or SIGTERM: one line, the shell's status, no traceback
        if os.environ.get("RANK", "0") == "0":
            last = trainer.last_checkpoint if trainer is not None else None
            where = config.output_dir if config is not None else "the output folder"
            print(interrupted_message(e, output_dir=where, last_checkpoint=last), file=sys.stderr, flush=True)
        return exit_status(e.signum)
    if os.environ.get("RANK", "0") != "0":  # torchrun: rank 0 reports
        return 0
    first, last = result.first_eval, result.last_eval
    print(f"fastrl train: {result.steps} steps, outputs in {result.output_dir}")
    if first and last:
        keys = [k for k in last if k.startswith("eval/")]
        for k in keys:
            print(f"  {k:<24} {first.get(k, float('nan')):.3f} -> {last[k]:.3f}")
    print(f"  final model: {result.final_model_dir} (load with from_pretrained)")
    return 0
