"""The HTML report (plainrl.report): real tiny runs (one single-turn, one multi-turn) read back,
rendered, checked as a file, and opened in a real headless Chromium (Playwright driving the
system browser): no console errors, the curves drawn, the smoothing toggle and the rollout
filters working."""

import json
import re
import shutil

import pytest

from conftest import REPO, tiny_overrides
from plainrl.cli import main
from plainrl.report import RunDirError, read_run, read_runs

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


def _tool_episode(tokenizer):
    """A multi-turn episode as the python tool makes one: policy turn, tool output (loss mask 0), policy turn."""
    from plainrl.types import EnvOutcome, Episode

    turns = [("```python\nprint(321 * 333)\n```", 1), ("\n<output>\n106893\n</output>\n", 0), ("Answer: 106893", 1)]
    ids, mask = [], []
    for text, m in turns:
        t = tokenizer.encode(text, add_special_tokens=False)
        ids += t
        mask += [m] * len(t)
    return Episode(sample_id="s9-tool", group=0, row={"answer": "106893"}, prompt_ids=tokenizer.encode("What is 321 * 333?"),
                   completion_ids=ids, logprobs=[0.0] * len(ids), loss_mask=mask, finish_reason="eos",
                   completion_text="".join(t for t, _ in turns), reward=1.5,
                   reward_parts={"correctness": 1.0, "tool_success": 1.0}, advantage=0.75,
                   env=EnvOutcome(reward=None, error=None, info={"tool_calls": 1, "turns": 2, "end_reason": "answer"}))


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory, tokenizer):
    """Two real tiny runs: arithmetic GRPO (3 steps, its run-end report on) and the python-tool
    example; into the second's files go one hand-made tool-using episode (written by the
    real rollout_record) and one error record."""
    from plainrl.metrics import rollout_record

    root = tmp_path_factory.mktemp("report")
    a, b = root / "grpo", root / "tool"
    common = ["log.report=true", "log.tensorboard=false", "log.rollouts_per_step=4"]
    assert main(["train", str(REPO / "examples" / "arithmetic_grpo.yaml"), *tiny_overrides(tiny_model_dir, a),
                 *common, "train.steps=3"]) == 0
    assert main(["train", str(REPO / "examples" / "arithmetic_python_tool.yaml"), *tiny_overrides(tiny_model_dir, b),
                 *common, "log.report=false"]) == 0
    with open(b / "rollouts.jsonl", "a") as f:
        f.write(json.dumps(rollout_record(1, _tool_episode(tokenizer), tokenizer)) + "\n")
    with open(b / "errors.jsonl", "a") as f:
        f.write(json.dumps({"step": 1, "sample_id": "s1-x", "source": "reward 'correctness'",
                            "error": "ValueError: <bad> & worse (at r.py:3)"}) + "\n")
    return a, b


@pytest.fixture(scope="module")
def report(runs, tmp_path_factory):
    """Both runs' report, written by the CLI: ``(path, what it printed)``."""
    out = tmp_path_factory.mktemp("html") / "both.html"
    return out, main(["report", str(runs[0]), str(runs[1]), "-o", str(out)])


def test_rollout_record_separates_environment_tokens(tokenizer):
    from plainrl.metrics import rollout_record

    rec = rollout_record(4, _tool_episode(tokenizer), tokenizer)
    assert [s["policy"] for s in rec["segments"]] == [True, False, True]
    assert "106893" in rec["segments"][1]["text"] and rec["segments"][2]["text"].endswith("Answer: 106893")
    assert rec["reward_parts"] == {"correctness": 1.0, "tool_success": 1.0} and rec["advantage"] == 0.75
    assert rec["env"]["info"]["tool_calls"] == 1 and rec["trained"]
    assert rec["tokens"] == len(_tool_episode(tokenizer).completion_ids)


def test_run_end_writes_the_report(runs):
    a, b = runs
    assert (a / "report.html").is_file() and not (b / "report.html").exists()  # log.report=false
    rows = [json.loads(line) for line in (a / "rollouts.jsonl").read_text().splitlines()]
    assert len(rows) == 12 and all({"segments", "reward_parts", "advantage", "finish_reason"} <= r.keys() for r in rows)


def test_report_is_one_self_contained_file_with_every_section(report):
    out, status = report
    assert status == 0
    html = out.read_text()
    # nothing fetched: no external scripts, styles, images or fonts
    assert not re.search(r'(?:src|href)="(?:https?:)?//', html) and "<link rel=\"stylesheet\"" not in html
    for section in ("overview", "curves", "eval", "config", "rollouts", "errors"):
        assert f'<section id="{section}">' in html
    for chart in ("reward", "reward_fns", "length", "kl", "clip", "mismatch", "times"):
        assert f'id="chart-{chart}"' in html
    # pass@1 with its interval, the interval's method and n: in the table, the overview and the chart's title
    assert len(re.findall(r"0\.\d{3} \[0\.\d{3}, 0\.\d{3}\] \(Wilson 95%, n=4\)", html)) >= 4
    assert "eval/pass@1 (Wilson 95%, n=4)" in html
    diff = html[html.index('id="config-diff"'):]
    diff = diff[:diff.index("</table>")]
    assert "rollout.env" in diff and "run_dir" not in diff  # the runs differ in their environment
    assert "ValueError: &lt;bad&gt; &amp; worse" in html  # errors.jsonl, escaped


def test_not_a_run_dir_names_the_path_and_what_is_missing(runs, tmp_path, capsys):
    with pytest.raises(RunDirError, match="does not exist"):
        read_run(tmp_path / "nowhere")
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.yaml").write_text("seed: 0\n")
    with pytest.raises(RunDirError, match=r"half.*metrics\.jsonl is missing"):
        read_run(tmp_path / "half")
    assert main(["report", str(runs[0]), str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path) in err and "config.yaml and metrics.jsonl are missing" in err


def test_png_curves_of_several_runs(runs, tmp_path, capsys):
    """``--png``: one image with a panel per training metric and the evaluation panel; a
    metric no run logged is left out; with nothing to draw the command fails, naming the keys."""
    from matplotlib.image import imread

    from plainrl.report.plots import curves_png

    out = tmp_path / "curves.png"
    assert main(["report", str(runs[0]), str(runs[1]), "--png", str(out), "--metrics", "reward/mean",
                 "no/such_metric"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert not (tmp_path / "report.html").exists()  # --png alone writes no HTML
    assert imread(out).shape[:2] == (450, 1380)  # two 4.6 x 3.0 inch panels (reward, eval) at 150 dpi
    assert curves_png(read_runs([runs[0]]), tmp_path / "one.png", ["reward/mean", "loss"]) == [
        "reward/mean", "loss", "eval/pass@1"]
    assert main(["report", str(runs[0]), "--png", str(tmp_path / "x.png"), "--metrics", "nope",
                 "--eval-metric", "eval/nope"]) == 2
    assert "no run logged any of ['nope', 'eval/nope']" in capsys.readouterr().err


def test_a_line_cut_by_a_crash_is_skipped_and_noted(runs, tmp_path):
    run = tmp_path / "cut"
    shutil.copytree(runs[0], run)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "reward/me')
    data = read_run(run)
    assert [r["step"] for r in data.train] == [0, 1, 2] and "1 unreadable line" in data.notes[0]


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary on PATH (Debian: apt-get install chromium)")
def test_report_in_headless_chromium(runs, report):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright not installed (pip install playwright)")
    a, b = runs
    path = report[0]
    records = [json.loads(line) for run in (a, b) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            problems = []
            page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            page.goto(path.as_uri())
            page.wait_for_load_state("load")
            assert problems == []

            # the curves render: every chart has a size, and the reward chart's lines are drawn
            sizes = page.eval_on_selector_all("#curves figure.chart svg", "els => els.map(e => e.getBoundingClientRect())")
            assert len(sizes) >= 6 and all(s["width"] > 200 and s["height"] > 100 for s in sizes)
            lines = page.eval_on_selector_all('#chart-reward g[id$="-smooth"] path',
                                              "els => els.map(e => e.getBBox().width)")
            assert len(lines) == 2 and all(w > 0 for w in lines)  # one per run

            # smoothing toggle: raw lines faded under smoothed ones; unticked, only raw lines
            raw, smooth = '#chart-reward g[id$="-raw"]', '#chart-reward g[id$="-smooth"]'
            style = "(el, prop) => getComputedStyle(el)[prop]"
            assert float(page.eval_on_selector(raw, style, "opacity")) < 0.5
            page.uncheck("#smooth")
            assert page.eval_on_selector(raw, style, "opacity") == "1"
            assert page.eval_on_selector(smooth, style, "display") == "none"

            # the rollout filter
            def shown() -> int:
                return page.eval_on_selector_all("details.episode", "els => els.filter(e => !e.hidden).length")

            assert shown() == len(records) == 3 * 4 + 2 * 4 + 1
            page.select_option("#f-run", "1")
            assert shown() == 2 * 4 + 1
            page.select_option("#f-run", "")
            page.fill("#f-step-min", "2")
            page.fill("#f-step-max", "2")
            assert shown() == sum(r["step"] == 1 for r in records)
            page.fill("#f-step-min", "")
            page.fill("#f-step-max", "")
            page.select_option("#f-tools", "yes")
            assert shown() == 1
            page.select_option("#f-tools", "")
            page.fill("#f-reward-min", "1")
            assert shown() == sum(r["reward"] is not None and r["reward"] >= 1 for r in records) == 1
            page.fill("#f-reward-min", "")
            page.select_option("#f-finish", "length")
            assert shown() == sum(r["finish_reason"] == "length" for r in records)
            assert page.inner_text("#f-count").endswith(f"of {len(records)} episodes")
            page.select_option("#f-finish", "")

            # the tool-using episode: environment tokens stand apart from the policy's
            page.select_option("#f-tools", "yes")
            page.click("#f-expand")
            episode = page.locator("details.episode:not([hidden])")
            assert episode.locator(".seg.env pre").inner_text().strip() == "<output>\n106893\n</output>"
            colors = [episode.locator(f".seg.{k}").first.evaluate("e => getComputedStyle(e).backgroundColor")
                      for k in ("policy", "env")]
            assert colors[0] != colors[1]
            body = episode.inner_text()
            assert "correctness" in body and "tool_success" in body and "0.750" in body  # reward parts, advantage
            assert problems == []
        finally:
            browser.close()
