"""plainrl.integrations.textarena against textarena's own code: every episode replayed in a fresh
textarena game with the same seed and the same moves ends with the same reward, while episodes run
at once and the caller's global ``random`` goes on undisturbed; a 2-step run; a game that raises or
hangs fails its own episode; bad input."""

import json
import random
import time

import pytest

pytest.importorskip("textarena")

import textarena as ta  # noqa: E402

import plainrl.run.setup as run_setup  # noqa: E402
from conftest import REPO, tiny_overrides  # noqa: E402
from plainrl.cli import main  # noqa: E402
from plainrl.config import ConfigError  # noqa: E402
from plainrl.data import PromptRow  # noqa: E402
from plainrl.data.prompts import build_prompt_ids  # noqa: E402
from plainrl.integrations.textarena import OFFLINE_GAMES, TextArenaEnv, reward, rows, won  # noqa: E402
from plainrl.rollout import multi_turn_rollout  # noqa: E402
from plainrl.types import Generation, SamplingParams  # noqa: E402

MOVES = {  # moves a player could make, valid and not
    "GuessTheNumber-v0": [f"I guess [{n}]" for n in range(1, 21)] + ["[25]", "seven"],
    "TowerOfHanoi-v0": [f"[{a} {b}]" for a in "ABC" for b in "ABC" if a != b] + ["[A]"],
    "Mastermind-v0": ["[1 2 3 4]", "[2 1 4 5]", "[6 5 4 3]", "[1 3 5 6]", "[3 4 5 6]", "[1 1 2 2]", "[4 2 6 1]"],
    "FrozenLake-v0": ["[down]", "[right]", "[s]", "[d]", "[up]", "[left]", "go"],
}


class Player:
    """An engine that plays: each call picks a move for its game from the context (a deterministic
    choice, so episodes of one row differ only through the game's answers), and draws once from the
    global ``random`` as the rest of a run would."""

    def __init__(self, tokenizer):
        self.tok, self.draws = tokenizer, []

    def generate(self, prompts, params, *, seeds=None):
        out = []
        for ctx in prompts:
            self.draws.append(random.random())
            text = self.tok.decode(ctx)
            game = next(g for g in MOVES if g.split("-")[0].replace("GuessTheNumber", "Guess The Number")
                        .replace("TowerOfHanoi", "Tower of Hanoi").replace("FrozenLake", "Frozen Lake") in text)
            move = random.Random(len(ctx) * 31 + sum(ctx)).choice(MOVES[game])
            ids = self.tok.encode(move, add_special_tokens=False) + [self.tok.eos_token_id]
            out.append(Generation(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason="eos"))
            time.sleep(0.001)  # let the other episodes' steps interleave
        return out


def _prompt_rows(tokenizer, env_id, n, seed):
    return [PromptRow(row=r, prompt_ids=build_prompt_ids(r, tokenizer), source_index=i)
            for i, r in enumerate(rows(env_id, n=n, seed=seed))]


def _turns(tokenizer, ep):
    """The model's turns of an episode: its runs of trained tokens, decoded as the environment got them."""
    turns, cur = [], []
    for tok, m in zip(ep.completion_ids, ep.loss_mask):
        if m:
            cur.append(tok)
        elif cur:
            turns.append(cur)
            cur = []
    return [tokenizer.decode(t, skip_special_tokens=True) for t in turns + ([cur] if cur else [])]


def _replay(env_id, seed, moves):
    """textarena on its own, as its README plays a game."""
    env = ta.make(env_id)
    env.reset(num_players=1, seed=seed)
    for move in moves:
        env.get_observation()
        done, _ = env.step(action=move)
        if done:
            break
    assert done, "the replayed game did not end where the episode did"
    rewards, _ = env.close()
    return rewards[0]


@pytest.mark.parametrize("env_id", OFFLINE_GAMES)
def test_episodes_replay_in_textarena_and_global_random_is_untouched(env_id, tokenizer):
    prompts = _prompt_rows(tokenizer, env_id, n=4, seed=7)
    assert [p.row["env_args"] for p in prompts] == [{"env_id": env_id, "seed": s} for s in range(7, 11)]
    player = Player(tokenizer)
    random.seed(1234)
    # in process, every step in its own thread: episodes run at once
    eps = multi_turn_rollout(player, prompts, TextArenaEnv, SamplingParams(max_new_tokens=16), tokenizer,
                             group_size=2, step=0, max_turns=60, max_total_tokens=4000)
    following = random.random()
    reference = random.Random(1234)
    assert player.draws == [reference.random() for _ in player.draws] and following == reference.random()
    lengths = set()
    for ep in eps:
        assert ep.env.error is None and ep.env.info["end_reason"] == "env_done", ep.env
        seed = ep.row["env_args"]["seed"]
        moves = _turns(tokenizer, ep)
        lengths.add(len(moves))
        assert _replay(env_id, seed, moves) == ep.env.reward
        assert won("", env_reward=ep.env.reward) == float(ep.env.reward == 1.0) == ep.env.info["won"]
        assert reward("", **ep.columns()) == ep.env.reward
    if env_id != "TowerOfHanoi-v0":  # the one game here without chance: every seed is the same puzzle
        assert len(lengths) > 1, lengths  # the games went differently


def test_rows_are_the_games_first_observations():
    (row,) = rows("TowerOfHanoi-v0", n=1, seed=3)
    env = ta.make("TowerOfHanoi-v0-raw")
    env.reset(num_players=1, seed=3)
    _, obs = env.get_observation()
    assert row["messages"] == [{"role": "user", "content": "\n".join(m for _, m, _ in obs).strip()}]


@pytest.mark.parametrize("args, needles", [
    ({"env_id": "GuessTheNumbr-v0"}, ["data.source_args.env_id", "'GuessTheNumbr-v0'", "GuessTheNumber-v0"]),
    ({"env_id": "TicTacToe-v0"}, ["data.source_args.env_id", "one-player game", "Mastermind-v0"]),
    ({"env_id": "Mastermind-v0", "n": 0}, ["data.source_args.n", "positive"]),
])
def test_bad_input_is_a_config_error(args, needles):
    with pytest.raises(ConfigError) as e:
        rows(**args)
    assert all(n in str(e.value) for n in needles), str(e.value)


def test_unknown_game_stops_the_run_before_the_model_loads(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(run_setup, "load_policy", lambda *a, **k: pytest.fail("the model loaded"))
    code = main(["train", str(REPO / "examples" / "textarena_guess.yaml"), *tiny_overrides(tiny_model_dir, tmp_path),
                 "data.source_args.env_id=GuessTheNumbr-v0"])
    err = capsys.readouterr().err
    assert code == 2 and "data.source_args.env_id" in err and "GuessTheNumber-v0" in err, err


class _Breaks(ta.Env):
    """A one-player textarena game whose moves raise (``boom``) or never return (``hang``)."""

    def __init__(self, how: str):
        self.how = how

    def reset(self, num_players, seed=None):
        self.state = ta.SinglePlayerState(num_players=num_players, seed=seed, max_turns=5)
        self.state.reset(game_state={}, player_prompt_function=lambda **kw: f"Play the {self.how} game.")

    def step(self, action):
        if self.how == "boom":
            raise ValueError("the game broke")
        time.sleep(3600)


@pytest.mark.parametrize("how, needle", [("boom", "ValueError: the game broke"), ("hang", "did not return within")])
def test_a_game_that_raises_or_hangs_fails_its_own_episode(how, needle, tiny_model_dir, tmp_path):
    env_id = f"PlainrlTest{how.title()}-v0"
    if env_id not in ta.envs.registration.ENV_REGISTRY:
        ta.register(id=env_id, entry_point=_Breaks, how=how)  # the workers are forked from this process
    run = tmp_path / "run"
    assert main(["train", str(REPO / "examples" / "textarena_guess.yaml"), *tiny_overrides(tiny_model_dir, run),
                 f"data.source_args.env_id={env_id}", "data.source_args.n=4", "rollout.env_timeout_s=3",
                 "eval.before=false", "eval.after=false", "train.steps=1"]) == 0
    errors = [json.loads(line) for line in (run / "errors.jsonl").read_text().splitlines()]
    assert len(errors) == 4 and all(e["source"] == "environment" and needle in e["error"] for e in errors), errors


def test_two_steps_in_process(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    assert main(["train", str(REPO / "examples" / "textarena_guess.yaml"), *tiny_overrides(tiny_model_dir, run),
                 "rollout.env_timeout_s=null", "rollout.max_total_tokens=160", "data.eval_size=2"]) == 0
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in metrics if "reward/mean" in r]
    assert [r["step"] for r in steps] == [0, 1] and all(r["env/error_rate"] == 0 for r in steps), steps
    assert [r["step"] for r in metrics if "eval/pass@1" in r] == [0, 2]
    rollouts = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    for r in rollouts:  # the random model never ends a reply within 8 tokens: each game is cut short, reward 0
        assert r["env"]["info"]["end_reason"] == "length" and r["env"]["reward"] is None and r["reward"] == 0.0, r


def test_reward_of_a_game_cut_short_or_failed():
    assert reward("", env_reward=0.75) == 0.75
    assert reward("", env_reward=None) == 0.0  # the run's limits ended it before the game did
    assert reward("", env_reward=None, env_error="ValueError: x") is None
