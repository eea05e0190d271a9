"""Command line: ``plainrl train CONFIG [key=value ...]`` (RL, or SFT/DPO/RM when
``algorithm.name`` is sft, dpo or rm), ``plainrl eval CONFIG_OR_RUN_DIR [key=value ...]``,
``plainrl report RUN_DIR [RUN_DIR ...] [-o OUT.html]``, ``plainrl export RUN_DIR --merge OUT``,
``plainrl cache list|clear``, ``plainrl examples [copy NAME [DIR]]`` and ``plainrl tinker [CONFIG]`` (Tinker's
training API served for the config's model). A CONFIG that is not a file
may name a packaged example (``plainrl train arithmetic_grpo``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from plainrl.config import ConfigError, load_config


def _cmd_train(args) -> int:
    from plainrl.run.lifecycle import Preempted
    from plainrl.run.loop import train
    from plainrl.run.offline import train_offline

    from plainrl.run.runlog import run_log

    cfg = load_config(args.config, args.overrides)
    try:
        # algorithm.name picks the trainer: sft/dpo/rm learn from data rows, the rest by RL;
        # third-party warnings and logging go to RUN_DIR/log.txt, not the console
        with run_log(cfg.run_dir):
            (train_offline if cfg.algorithm.offline else train)(cfg)
    except Preempted as e:
        print(f"plainrl: {e}; run the same command again to resume", file=sys.stderr)
        return Preempted.exit_code
    return 0


def _cmd_eval(args) -> int:
    import torch

    from plainrl.rollout.engines.factory import make_engine, read_only
    from plainrl.run.evaluate import evaluate, interval_methods
    from plainrl.run.lifecycle import seed_everything
    from plainrl.rollout.reaper import Reaper
    from plainrl.run.setup import prepare
    from plainrl.models import load_policy, resolve_device

    target = Path(args.target)
    run_dir = target if target.is_dir() else None
    if run_dir is not None and not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"{target} is a directory without config.yaml; pass a config file or a plainrl run directory")
    overrides = list(args.overrides)
    # a dataset named on the command line is evaluated whole, unless data.eval_holdout is named too:
    # then its held-out rows, the rows a run of this config over that dataset holds out
    whole = any(o.startswith("data.path=") for o in overrides) and \
        not any(o.startswith("data.eval_holdout=") for o in overrides)
    if whole:
        overrides.append("data.eval_holdout=0")
    cfg = load_config(run_dir / "config.yaml" if run_dir else target, overrides)
    if cfg.algorithm.name == "rm":
        raise ConfigError("plainrl eval measures a policy's answers; a reward model (algorithm.name=rm) has none. "
                          "Its held-out accuracy is logged as eval/accuracy in metrics.jsonl")
    seed_everything(cfg.seed)
    prep = prepare(cfg)
    # otherwise the run's own held-out rows (a task's eval set, data.eval_path/eval_split/eval_holdout)
    rows = prep.data.train if whole and not cfg.data.eval_path else (prep.data.eval or prep.data.train)
    device = resolve_device(cfg.device)
    final = run_dir / "final" if run_dir else None
    if read_only(cfg.rollout):  # the served model is evaluated as it is: no local weights to load or push
        model = None
    elif final is not None and (final / "adapter_config.json").is_file():
        from peft import PeftModel

        base = load_policy(cfg.model.model_copy(update={"lora": cfg.model.lora.model_copy(update={"enabled": False})}), device)
        model = PeftModel.from_pretrained(base, str(final))
    elif final is not None and (final / "config.json").is_file():
        model = load_policy(cfg.model.model_copy(update={"name": str(final)}), device)
    else:
        model = load_policy(cfg.model.model_copy(update={"lora": cfg.model.lora.model_copy(update={"enabled": False})}), device)
    with Reaper():  # as in a run: vLLM's engine core and agents' subprocesses die with this process
        engine = make_engine(cfg.model, cfg.rollout, model, prep.tokenizer, device, seed=cfg.seed)
        try:
            if cfg.rollout.engine != "hf" and model is not None:
                engine.load_weights(model)
            result = evaluate(
                engine, rows, prep.tokenizer,
                max_new_tokens=cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens, stop=tuple(cfg.rollout.stop),
                k=cfg.eval.k, temperature=cfg.eval.temperature,
                generator=torch.Generator(device=device).manual_seed(cfg.seed), multi_turn=prep.multi_turn,
                grader=prep.grader, chunk_size=cfg.rollout.batch_size, progress=True,
            )
        finally:
            prep.close()
            engine.close()
    label = f"{engine.models[0]} at {cfg.rollout.remote.urls[0]}" if model is None else str(final or cfg.model.name)
    from plainrl.intervals import eval_keys, figure

    # "figures": each result as printed elsewhere, with its interval's method and n
    figures = {k.removeprefix("eval/"): figure(result, k) for k in eval_keys(result)}
    print(json.dumps({"model": label, **result, "intervals": interval_methods(result), "figures": figures}, indent=2))
    return 0


def _cmd_serve(args) -> int:
    from plainrl.run.engines import serve

    serve(load_config(args.config, args.overrides), host=args.host, port=args.port, colocated=args.colocated)
    return 0  # (serve replaces this process)


def _cmd_tinker(args) -> int:
    try:
        import tinker  # noqa: F401  (the service speaks the SDK's own types)
    except ImportError:
        print("plainrl: plainrl tinker needs the tinker SDK: pip install 'plainrl[tinker]'", file=sys.stderr)
        return 2
    from plainrl.tinker import serve

    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config and not Path(config).is_file():  # no CONFIG, overrides only
        config, overrides = None, [config, *overrides]
    if config is None:
        # the service reads no rows and scores nothing, but a config must name both to validate
        overrides[:0] = ["run_dir=runs/tinker", "data.task=arithmetic",
                         "rewards=[{fn: 'plainrl.rewards.builtins:correctness'}]"]
    api_key = args.api_key or os.environ.get("TINKER_API_KEY") or None
    serve(load_config(config, overrides), host=args.host, port=args.port, api_key=api_key)
    return 0


def _cmd_report(args) -> int:
    from plainrl.report import RunDirError, read_runs, write_report
    from plainrl.report.plots import curves_png

    try:
        if args.png:
            curves_png(read_runs(args.run_dirs), args.png, args.metrics, args.eval_metric)
            print(args.png)
            if args.out is None:
                return 0
        path = write_report(args.run_dirs, args.out)
    except (RunDirError, ValueError) as e:
        print(f"plainrl: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


def _cmd_export(args) -> int:
    from plainrl.run.export import export_merged

    print(export_merged(args.run_dir, args.merge, dtype=args.dtype))
    return 0


def _cmd_cache(args) -> int:
    from plainrl.models.cache import cache_root, clear_entries, describe_age, disk_bytes, list_entries

    root = cache_root(args.cache_dir)
    if args.action == "clear":
        try:
            gone = clear_entries(root, args.names, legacy_only=args.legacy)
        except KeyError as e:
            print(f"plainrl: {e.args[0]}", file=sys.stderr)
            return 2
        for e in gone:
            print(f"removed {e.path} ({e.size_bytes / 1e6:.0f} MB)")
        print(f"{len(gone)} entr{'y' if len(gone) == 1 else 'ies'} removed from {root}")
        return 0
    entries = list_entries(root)
    print(f"{root}: {len(entries)} GGUF conversion(s), {disk_bytes(root) / 1e6:.0f} MB on disk")
    for e in entries:
        src = e.source or {}
        what = (f"{src.get('source_file', '?')} sha256 {str(src.get('source_sha256', '?'))[:16]}, "
                f"hub {src.get('hub_id') or '-'}, transformers {src.get('transformers_version', '?')}, "
                f"{describe_age(src.get('created_unix'))}") if e.source else {
            "legacy": "keyed on a file path by older plainrl (`clear --legacy` removes these)",
            "incomplete": "a conversion under way, or one a killed process left",
            "unknown": "not made by plainrl"}.get(e.state, "")
        print(f"  {e.name}  {e.state}  {e.size_bytes / 1e6:.0f} MB  {what}")
    return 0


def _cmd_examples(args) -> int:
    from plainrl.config.examples import copy_example, examples_dir, list_examples

    if args.action == "copy":
        written = copy_example(args.name, args.dir)
        for path in written:
            print(f"copied {path}")
        print(f"run it: plainrl train {written[0]}")
        return 0
    examples = list_examples()
    width = max(len(e.name) for e in examples)
    for e in examples:
        print(f"{e.name:<{width}}  {e.description}")
    print(f"({len(examples)} configs in {examples_dir()}; run one: plainrl train NAME; "
          "copy one and the files it names: plainrl examples copy NAME [DIR])")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``plainrl`` command line: one sub-parser per command, each with its handler as ``func``
    (read by ``main``, and by ``tools/docs_check.py`` to check that the documented commands and flags exist)."""
    parser = argparse.ArgumentParser(prog="plainrl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="training from a YAML config: RL, or sft/dpo/rm per algorithm.name")
    p.add_argument("config", help="a YAML file, or the name of a packaged example (plainrl examples lists them)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=1e-5")
    p.set_defaults(func=_cmd_train)
    p = sub.add_parser("eval", help="accuracy of a base model (config) or a trained run (run directory)")
    p.add_argument("target", help="a YAML config or a run directory")
    p.add_argument("overrides", nargs="*")
    p.set_defaults(func=_cmd_eval)
    p = sub.add_parser("serve", help="a vLLM server for the config's model that runs with rollout.engine=remote "
                                     "sample from and push weights to (needs vLLM: see docs/engines.md)")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="dotted overrides, as for train")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: the weight-sync "
                                                       "endpoints let any client change the weights)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--colocated", action="store_true",
                   help="the server shares the trainer's GPU: the config's rollout.vllm.gpu_memory_utilization (a "
                        "number) and sleep mode (default: a GPU of its own, 0.9 of its memory, no sleep mode)")
    p.set_defaults(func=_cmd_serve)
    p = sub.add_parser("tinker", help="Tinker's training API on this machine: the tinker SDK's ServiceClient("
                                      "base_url=...) trains LoRA adapters of the config's model (docs/tinker.md)")
    p.add_argument("config", nargs="?", help="a YAML config or packaged example (default: the embedded model)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.name=... run_dir=...")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: without --api-key any "
                                                       "client can train and read checkpoints)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="answer only clients that send this key (it starts with tml-); "
                                                   "default $TINKER_API_KEY; neither: any tml- key")
    p.set_defaults(func=_cmd_tinker)
    p = sub.add_parser("report", help="a self-contained HTML report of one or several runs (curves overlaid, "
                                      "eval, config diff, rollout browser, errors)")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    p.add_argument("-o", "--out", help="the HTML file to write (default: RUN_DIR/report.html for one run, "
                                       "./report.html for several)")
    p.add_argument("--png", help="write the curves as one PNG instead (with -o, both): --metrics side by side, "
                                 "then --eval-metric with its 95%% intervals")
    p.add_argument("--metrics", nargs="+", default=["reward/mean"], help="training curves of --png "
                                                                        "(default: reward/mean)")
    p.add_argument("--eval-metric", default="eval/pass@1", help="the evaluation panel of --png (default: eval/pass@1)")
    p.set_defaults(func=_cmd_report)
    p = sub.add_parser("export", help="a run's final/ as full weights with any LoRA adapter merged in (safetensors, "
                                      "tokenizer, generation config, model card): loads in transformers and vLLM")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--merge", metavar="OUT", required=True, help="the directory to write (must not exist yet)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="the weights' dtype (default float32; merging is always done in float32)")
    p.set_defaults(func=_cmd_export)
    p = sub.add_parser("examples", help="the example configs that ship with plainrl: list them (one line each), "
                                        "or copy one with the files it names")
    actions = p.add_subparsers(dest="action")
    actions.add_parser("list", help="the examples, one line each (the default)")
    a = actions.add_parser("copy", help="copy an example config and the files it names (agents, row sources)")
    a.add_argument("name", metavar="NAME", help="an example's name, as `plainrl examples` lists it")
    a.add_argument("dir", metavar="DIR", nargs="?", default=".", help="where to copy them (default: here)")
    p.set_defaults(func=_cmd_examples, action="list")
    p = sub.add_parser("cache", help="plainrl's model cache (GGUF conversions, one per file content): list or clear")
    actions = p.add_subparsers(dest="action", required=True)
    for action, text in (("list", "the conversions, their sources and sizes"),
                         ("clear", "remove conversions: those named, --legacy ones, or all")):
        a = actions.add_parser(action, help=text)
        a.add_argument("--cache-dir", help="the cache (default: $PLAINRL_CACHE, else ~/.cache/plainrl)")
        if action == "clear":
            a.add_argument("names", nargs="*", metavar="NAME", help="entries to remove (names from `cache list`)")
            a.add_argument("--legacy", action="store_true",
                           help="only conversions an older plainrl keyed on a file path")
        a.set_defaults(func=_cmd_cache)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from plainrl.checkpoint import CheckpointError
    from plainrl.data import DataError
    from plainrl.rollout.envs import EnvError
    from plainrl.models import ModelLoadError
    from plainrl.rewards import RewardError, RewardLoadError
    from plainrl.rollout.engines.requests import EngineError
    from plainrl.rollout.event_loop import LoopBlocked
    from plainrl.run.export import ExportError

    try:
        return args.func(args)
    except (ConfigError, DataError, ModelLoadError, RewardLoadError, CheckpointError, ExportError) as e:
        # the user's input is wrong: say what and how to fix it, without a traceback
        print(f"plainrl: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except EngineError as e:  # vLLM missing, a server unreachable, dead or serving another model
        print(f"plainrl: EngineError: {e}", file=sys.stderr)
        return 1
    except (RewardError, EnvError) as e:  # rollout.fail_fast: a sample could not be scored
        print(f"plainrl: {e}", file=sys.stderr)
        return 1
    except LoopBlocked as e:  # a stop signal while an agent blocked the episodes' loop
        print(f"plainrl: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("plainrl: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
