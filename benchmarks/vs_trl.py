"""plainrl vs TRL's GRPOTrainer: the same GRPO workload, one process, alternating step by step.

    pip install -e '.[bench]'                      # TRL, pinned
    python benchmarks/vs_trl.py                    # dtype as model.dtype=auto picks; 1 warm-up + 5 measured steps each
    python benchmarks/vs_trl.py --dtype float32
    python benchmarks/vs_trl.py --tiny --steps 1 --max-new-tokens 8   # smoke test (seconds)

Both frameworks get the embedded model (SmolLM2-135M-Instruct), the same prompts in
the same order (plainrl's arithmetic task rows, rendered with the chat template of
examples/arithmetic_grpo.yaml), the same reward function
(plainrl.rewards.builtins:correctness), group size, prompts per step, max new
tokens, temperature, LoRA rank/alpha/target modules, dtype, learning rate (constant),
clip epsilon, gradient clipping, KL off, one optimiser step per rollout, no vLLM,
no gradient checkpointing (TRL's default turns it on: --trl-gradient-checkpointing),
and the same attention kernel (plainrl's CPU choice, eager; --trl-attn to change it).

How the alternation works: TRL's own ``trainer.train()`` loop runs; a callback's
``on_step_end`` runs one plainrl step (the body of plainrl.run.loop._train),
so the order is TRL 0, plainrl 0, TRL 1, plainrl 1, ... Step 0 of each is the
warm-up. A TRL step is the wall time spent in TRL between two callbacks (data,
generation, rewards, logprobs, backward, optimiser, logging); a plainrl step is
the whole loop body including metric logging.

Prints plainrl's per-phase times, TRL's generate/reward split, the median seconds
per step and completion tokens per second of both, and last the line
``speedup_vs_trl=X.XX`` (median TRL step time / median plainrl step time).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from plainrl.durable import write_atomic

TRL_VERSION = "1.16.0"  # the `bench` extra of pyproject.toml pins this
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# the task and prompt rendering of examples/arithmetic_grpo.yaml
TASK_ARGS = {"max_value": 99, "ops": "+", "num_train": 5000}
PROMPT_TEMPLATE = "{prompt} End your reply with 'Answer: <number>'."
REWARD_FN = "plainrl.rewards.builtins:correctness"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=5, help="measured steps per framework, after 1 warm-up step each")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                   help="auto: what plainrl's model.dtype=auto picks on this machine (both frameworks use it)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompts-per-step", type=int, default=2)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lora-alpha", type=float, default=32.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--trl-grad-accum", type=int, default=1,
                   help="TRL micro-batches per rollout (per_device_train_batch_size = completions / this); "
                        "one optimiser step per rollout either way")
    p.add_argument("--trl-gradient-checkpointing", action="store_true",
                   help="TRL's default (recompute activations in backward); off by default, as in plainrl")
    p.add_argument("--trl-attn", choices=["same", "eager", "sdpa"], default="same",
                   help="TRL's attention kernel; 'same' = plainrl's (eager on CPU, sdpa on GPU)")
    p.add_argument("--decoder", choices=["auto", "static", "transformers"], default="auto",
                   help="plainrl's rollout.decoder (auto: the static decoder for this model)")
    p.add_argument("--tiny", action="store_true", help="a tiny random Llama with the real tokenizer (smoke test)")
    p.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    p.add_argument("--workdir", type=Path, default=None, help="run directories (default: a temporary directory)")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- helpers


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    """Accumulates seconds spent inside wrapped calls."""

    def __init__(self):
        self.total = 0.0
        self.calls = 0

    def reset(self) -> float:
        t, self.total, self.calls = self.total, 0.0, 0
        return t

    def wrap(self, fn, device: torch.device | None = None, only_with_grad: bool = False):
        def timed(*args, **kwargs):
            if only_with_grad and not torch.is_grad_enabled():
                return fn(*args, **kwargs)
            if device is not None:
                sync(device)
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            if device is not None:
                sync(device)
            self.total += time.perf_counter() - t0
            self.calls += 1
            return out

        return timed


@contextmanager
def patched(obj, name: str, new):
    old = getattr(obj, name)
    setattr(obj, name, new)
    try:
        yield
    finally:
        setattr(obj, name, old)


def make_tiny_model(dest: Path) -> str:
    """A 2-layer, hidden-64 Llama with the real SmolLM2 tokenizer, saved as a HF directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from plainrl.models import load_tokenizer

    tok = load_tokenizer("smollm2-135m-instruct")
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    LlamaForCausalLM(cfg).save_pretrained(dest)
    tok.save_pretrained(dest)
    return str(dest)


def versions() -> dict[str, str]:
    import peft
    import transformers
    import trl

    import plainrl

    return {
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "peft": peft.__version__, "trl": trl.__version__, "plainrl": getattr(plainrl, "__version__", "?"),
    }


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


# ----------------------------------------------------------------------------- plainrl side


def plainrl_config(args, model_path: str, run_dir: Path):
    from plainrl.config import AlgorithmConfig, load_config

    over = [
        f"run_dir={run_dir}", f"seed={args.seed}", "checkpoint.resume=never", "checkpoint.every=0",
        f"model.name={model_path}", f"model.dtype={args.dtype}", "model.lora.enabled=true",
        f"model.lora.r={args.lora_r}", f"model.lora.alpha={args.lora_alpha}", "model.lora.dropout=0.0",
        f"model.lora.target_modules={json.dumps(TARGET_MODULES)}",
        "data.task=arithmetic", f"data.task_args={json.dumps(TASK_ARGS)}",
        f"data.prompt_template={json.dumps(PROMPT_TEMPLATE)}", "data.eval_size=0",
        f"rollout.group_size={args.group_size}", f"rollout.prompts_per_step={args.prompts_per_step}",
        f"rollout.max_new_tokens={args.max_new_tokens}", f"rollout.temperature={args.temperature}",
        f"rollout.decoder={args.decoder}",
        f'rewards=[{{fn: "{REWARD_FN}", weight: 1.0}}]',
        "algorithm.name=grpo", "algorithm.kl_coef=0.0", "algorithm.clip_low=0.2", "algorithm.clip_high=0.2",
        "algorithm.loss_agg=token-mean",
        f"train.steps={args.steps + 1}", f"train.lr={args.lr}", "train.lr_schedule=constant",
        "train.warmup_steps=0", "train.weight_decay=0.0", "train.max_grad_norm=1.0",
        "eval.before=false", "eval.after=false", "log.tensorboard=false", "log.progress=false",
    ]
    # one optimiser pass per rollout (the defaults; explicit where this plainrl has the keys)
    over += [f"algorithm.{k}=1" for k in ("ppo_epochs", "mini_batches") if k in AlgorithmConfig.model_fields]
    if args.threads:
        over.append(f"threads={args.threads}")
    return load_config(None, over)


class PlainrlStepper:
    """One plainrl step at a time: the body of plainrl.run.loop.train, with each phase timed."""

    def __init__(self, cfg):
        import plainrl.train.learner
        from plainrl.run.setup import setup

        self.cfg = cfg
        self.run = setup(cfg)
        self.params = self.run.params
        self.device = self.run.learner.device
        self.fwd = Timer()
        self._learner_module = plainrl.train.learner
        self.records: list[dict] = []

    def step(self, step: int) -> dict:
        from plainrl.data import render_prompt
        from plainrl.frames import completion_frame
        from plainrl.metrics import StepTimer
        from plainrl.run.loop import collect, estimate, samples_of, step_metrics

        run, cfg, dev = self.run, self.cfg, self.device
        # the policy forward (decoder + chunked fp32 logprobs) is sequence_logps under grad
        timed_logps = self.fwd.wrap(self._learner_module.sequence_logps, dev, only_with_grad=True)
        with patched(self._learner_module, "sequence_logps", timed_logps):
            timer = StepTimer()
            sync(dev)
            t0 = time.perf_counter()
            episodes, rewards_out, extra = collect(run, step, timer)
            samples, shaping = samples_of(run, episodes, timer)
            extra.update(shaping)
            with timer("reward"):
                advantages = estimate(run, samples, completion_frame(samples))[0].advantages
            self.fwd.reset()
            t2 = time.perf_counter()
            with timer("update"):
                stats = run.learner.update(samples, advantages)
                sync(dev)
            t3 = time.perf_counter()
            run.engine.load_weights(run.model)
            sync(dev)
            t4 = time.perf_counter()
            fwd = self.fwd.reset()
            times = timer.metrics()
            run.logger.log(step, step_metrics(episodes, [f.name for f in run.prep.reward_fns], rewards_out, stats,
                                              times, extra, samples))
            run.logger.log_rollouts(step, episodes, cfg.log.rollouts_per_step, run.prep.tokenizer)
            t5 = time.perf_counter()
        generate, reward = times["time/generate"], times["time/reward"]
        rec = {
            "step": step, "generate": generate, "reward": reward, "logprobs": fwd, "backward_opt": (t3 - t2) - fwd,
            "sync": t4 - t3, "log": t5 - t4, "total": t5 - t0,
            "completion_tokens": sum(len(e.completion_ids) for e in episodes),
            "reward_mean": statistics.fmean(e.reward or 0.0 for e in episodes),
            "prompts": [render_prompt(e.row, cfg.data.prompt_template) for e in episodes],
        }
        self.records.append(rec)
        return rec


# ----------------------------------------------------------------------------- TRL side


def trl_dataset(stepper: PlainrlStepper, args):
    """The prompts plainrl's sampler will draw, in the same order, as TRL conversational rows."""
    from datasets import Dataset

    from plainrl.data import PromptSampler, render_prompt

    cfg, prep = stepper.cfg, stepper.run.prep
    sampler = PromptSampler(prep.data.train, cfg.rollout.prompts_per_step, seed=cfg.seed, shuffle=cfg.data.shuffle)
    rows = [r for _ in range(args.steps + 1) for r in sampler.next_batch()]
    records = []
    for r in rows:
        messages = [{"role": "user", "content": render_prompt(r.row, cfg.data.prompt_template)}]
        # TRL tokenises with the same chat template; check the prompt ids are identical
        ids = prep.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        if list(ids["input_ids"]) != list(r.prompt_ids):
            raise AssertionError(f"TRL and plainrl prompt ids differ for {r.row['prompt']!r}")
        records.append({"prompt": messages, "answer": r.row["answer"]})
    return Dataset.from_list(records)


def trl_reward(fn, seen_prompts: list[list[str]]):
    """plainrl's per-completion reward function as a TRL reward function (batched);
    records each call's prompts (user messages) so the script can check they match plainrl's."""

    def correctness(completions, answer, prompts=None, **kwargs):
        if prompts is not None:
            seen_prompts.append([p[-1]["content"] if isinstance(p, list) else p for p in prompts])
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [fn(t, answer=a) for t, a in zip(texts, answer, strict=True)]

    return correctness


def make_trl_trainer(args, model_path: str, dataset, output_dir: Path, callback, attn: str, device: torch.device,
                     seen_prompts: list[list[str]]):
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    from plainrl.rewards.loading import load_reward_fn

    n = args.group_size * args.prompts_per_step
    if n % args.trl_grad_accum:
        raise SystemExit(f"--trl-grad-accum={args.trl_grad_accum} must divide the {n} completions per step")
    config = GRPOConfig(
        output_dir=str(output_dir), seed=args.seed, report_to="none", save_strategy="no",
        logging_steps=1, disable_tqdm=True, max_steps=args.steps + 1,
        # one rollout of n completions -> gradient_accumulation micro-batches -> one optimiser step
        per_device_train_batch_size=n // args.trl_grad_accum, gradient_accumulation_steps=args.trl_grad_accum,
        steps_per_generation=args.trl_grad_accum,  # generation batch = n
        num_generations=args.group_size, max_completion_length=args.max_new_tokens,
        temperature=args.temperature, top_p=1.0, top_k=0,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, beta=0.0, num_iterations=1, epsilon=0.2, loss_type="dapo", scale_rewards="group",
        use_vllm=False, shuffle_dataset=False,
        # (`activation_checkpointing` is transformers 5's name; it overrides TRL's gradient_checkpointing=True)
        activation_checkpointing=args.trl_gradient_checkpointing,
        bf16=args.dtype == "bfloat16", use_cpu=device.type == "cpu",
        model_init_kwargs={"dtype": args.dtype, "attn_implementation": attn},
    )
    peft_config = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=0.0,
                             target_modules=TARGET_MODULES, task_type="CAUSAL_LM")
    return GRPOTrainer(model=model_path, reward_funcs=[trl_reward(load_reward_fn(REWARD_FN), seen_prompts)], args=config,
                       train_dataset=dataset, peft_config=peft_config, callbacks=[callback])


# ----------------------------------------------------------------------------- main


def summarise(records: list[dict], key: str = "total") -> dict:
    times = [r[key] for r in records]
    toks = [r["completion_tokens"] for r in records]
    return {
        "median_step_s": statistics.median(times),
        "mean_step_s": statistics.fmean(times),
        "completion_tokens_per_step": statistics.fmean(toks),
        "completion_tokens_per_s": sum(toks) / sum(times),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.steps < 1:
        raise SystemExit("--steps must be >= 1")
    t_start = time.perf_counter()
    try:
        import trl
    except ImportError:
        raise SystemExit("TRL is not installed; install the pinned version with: pip install -e '.[bench]'") from None
    if trl.__version__ != TRL_VERSION:
        print(f"warning: trl {trl.__version__} installed; the benchmark is pinned to {TRL_VERSION}", file=sys.stderr)
    from transformers import PrinterCallback, TrainerCallback

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.dtype == "auto":  # one concrete dtype for both sides, as plainrl would choose it here
        from plainrl.models import cpu_summary, resolve_dtype

        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        args.dtype = str(resolve_dtype("auto", device_type).dtype).removeprefix("torch.")
        print(f"dtype: {args.dtype} (auto); CPU: {cpu_summary()}", file=sys.stderr)
    tmp = tempfile.TemporaryDirectory(prefix="plainrl-vs-trl-")
    work = args.workdir or Path(tmp.name)
    work.mkdir(parents=True, exist_ok=True)

    from plainrl.models import resolve_model_path

    model_path = make_tiny_model(work / "tiny-llama") if args.tiny else resolve_model_path("smollm2-135m-instruct")

    t_setup = time.perf_counter()
    stepper = PlainrlStepper(plainrl_config(args, model_path, work / "plainrl"))
    attn = stepper.run.model.config._attn_implementation if args.trl_attn == "same" else args.trl_attn
    dataset = trl_dataset(stepper, args)

    trl_records: list[dict] = []
    gen_timer, reward_timer = Timer(), Timer()
    trl_tokens = {"n": 0}
    failures: list[BaseException] = []

    class Alternate(TrainerCallback):
        """After each TRL optimiser step, one plainrl step; times TRL between callbacks."""

        def on_train_begin(self, a, state, control, **kw):
            self.resume = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            sync(stepper.device)
            now = time.perf_counter()
            total = now - self.resume
            gen, rew = gen_timer.reset(), reward_timer.reset()
            trl_records.append({
                "step": state.global_step - 1, "total": total, "generate": gen, "reward": rew,
                "rest": total - gen - rew, "completion_tokens": trl_tokens["n"],
            })
            trl_tokens["n"] = 0
            try:
                p = stepper.step(state.global_step - 1)
            except BaseException as e:  # stop TRL's loop too; re-raised below
                failures.append(e)
                control.should_training_stop = True
                return control
            t = trl_records[-1]
            tag = "warm-up" if t["step"] == 0 else f"step {t['step']}"
            print(f"[{tag}] trl {t['total']:.2f}s ({t['completion_tokens']} tok) | "
                  f"plainrl {p['total']:.2f}s ({p['completion_tokens']} tok)", flush=True)
            self.resume = time.perf_counter()
            return control

    trl_prompts: list[list[str]] = []
    trainer = make_trl_trainer(args, model_path, dataset, work / "trl", Alternate(), attn, stepper.device, trl_prompts)
    trainer.remove_callback(PrinterCallback)  # TRL still computes and logs its metrics every step, unprinted

    # TRL's generation and reward phases, timed per step (plain wrappers on this instance)
    inner_generate = trainer._generate_single_turn

    def generate_and_count(*a, **kw):
        completion_ids, logprobs = inner_generate(*a, **kw)
        trl_tokens["n"] += sum(len(c) for c in completion_ids)
        return completion_ids, logprobs

    trainer._generate_single_turn = gen_timer.wrap(generate_and_count, stepper.device)
    trainer._calculate_rewards = reward_timer.wrap(trainer._calculate_rewards, stepper.device)
    setup_s = time.perf_counter() - t_setup

    def trainable(model) -> tuple[int, set[str]]:
        ps = [p for p in model.parameters() if p.requires_grad]
        return sum(p.numel() for p in ps), {str(p.dtype).removeprefix("torch.") for p in ps}

    (n_plain, dt_plain), (n_trl, dt_trl) = trainable(stepper.run.model), trainable(trainer.model)
    if n_plain != n_trl:
        raise SystemExit(f"LoRA shapes differ: plainrl trains {n_plain} parameters, TRL {n_trl}")

    trainer.train()
    if failures:
        raise failures[0]

    same_prompts = [r["prompts"] for r in stepper.records] == trl_prompts
    if not same_prompts:
        print("warning: TRL and plainrl did not see the same prompts at every step", file=sys.stderr)
    plain = [r for r in stepper.records if r["step"] > 0]
    trl = [r for r in trl_records if r["step"] > 0]
    if len(plain) < args.steps or len(trl) < args.steps:
        raise SystemExit(f"expected {args.steps} measured steps each, got plainrl {len(plain)}, trl {len(trl)}")

    print()
    print(f"machine: {cpu_name()}, {torch.get_num_threads()} torch threads; device {stepper.device}")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in versions().items()))
    print(f"model: {'tiny random Llama' if args.tiny else 'SmolLM2-135M-Instruct'} ({model_path}), {args.dtype}; "
          f"LoRA r={args.lora_r} alpha={args.lora_alpha:g} on {','.join(TARGET_MODULES)}")
    print(f"workload: {args.prompts_per_step} prompts x group {args.group_size} = "
          f"{args.prompts_per_step * args.group_size} completions/step, max_new_tokens={args.max_new_tokens}, "
          f"temperature={args.temperature:g}, lr={args.lr:g}, KL off, 1 optimiser step per rollout; "
          f"plainrl decoder={stepper.run.engine.decoder}; "
          f"TRL: micro-batches/step={args.trl_grad_accum}, gradient_checkpointing={args.trl_gradient_checkpointing}, "
          f"attn={attn}; trainable params {n_plain} each, in {'/'.join(sorted(dt_plain))} in plainrl (AdamW on fp32 masters) "
          f"and {'/'.join(sorted(dt_trl))} in TRL; same prompts at every step: {'yes' if same_prompts else 'NO'}; setup {setup_s:.0f}s")
    print()
    cols = ["generate", "reward", "logprobs", "backward_opt", "sync", "log", "total"]
    print("plainrl per phase (s):")
    print(f"  {'step':>4} " + " ".join(f"{c:>12}" for c in cols) + f" {'tokens':>7} {'reward':>7}")
    for r in plain:
        print(f"  {r['step']:>4} " + " ".join(f"{r[c]:>12.3f}" for c in cols)
              + f" {r['completion_tokens']:>7} {r['reward_mean']:>7.3f}")
    print("  " + "med  " + " ".join(f"{statistics.median(r[c] for r in plain):>12.3f}" for c in cols))
    print("TRL per phase (s) (rest = logprobs, backward, optimiser, trainer overhead):")
    tcols = ["generate", "reward", "rest", "total"]
    print(f"  {'step':>4} " + " ".join(f"{c:>12}" for c in tcols) + f" {'tokens':>7}")
    for r in trl:
        print(f"  {r['step']:>4} " + " ".join(f"{r[c]:>12.3f}" for c in tcols) + f" {r['completion_tokens']:>7}")
    print("  " + "med  " + " ".join(f"{statistics.median(r[c] for r in trl):>12.3f}" for c in tcols))

    sp, st = summarise(plain), summarise(trl)
    speedup = st["median_step_s"] / sp["median_step_s"]
    print()
    print(f"{'':10} {'median s/step':>14} {'completion tok/step':>20} {'completion tok/s':>17}")
    for name, s in (("plainrl", sp), ("trl", st)):
        print(f"{name:10} {s['median_step_s']:>14.3f} {s['completion_tokens_per_step']:>20.1f} "
              f"{s['completion_tokens_per_s']:>17.1f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(args.json, json.dumps({
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "machine": cpu_name(), "threads": torch.get_num_threads(), "versions": versions(), "trl_attn": attn,
            "same_prompts": same_prompts, "speedup_vs_trl": speedup,
            "plainrl": {"steps": [{k: v for k, v in r.items() if k != "prompts"} for r in plain], **sp},
            "trl": {"steps": trl, **st},
        }, indent=2))
    print(f"wall time {time.perf_counter() - t_start:.0f} s")
    print(f"speedup_vs_trl={speedup:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
