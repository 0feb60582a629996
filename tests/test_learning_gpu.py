"""benchmarks/learning_gpu.py on CPU: configs/gpu/grpo_learn.yaml and its variants validate as the
GPU run would (vLLM stood in for; a stand-in model with the 0.5b preset's BPE), the sizes its
header states hold on its data, the verdicts come out of hand-made curves, the report renders its
section, and the whole path (warm-up once, an RL seed from it, JSON, PNG, ``--reuse-runs``) runs on
the tiny model (``--cpu-smoke``)."""

from __future__ import annotations

import json

import pytest

from benchmarks import common, learning_gpu, report


@pytest.fixture(scope="module")
def bpe_model(tmp_path_factory) -> str:
    """Two small layers with the 0.5b preset's tokenizer (the same BPE, built from the same corpus)."""
    from xrlhf.models.tiny import PRESETS, build_model

    spec = PRESETS["0.5b"]
    return str(build_model(tmp_path_factory.mktemp("bpe"), layers=2, hidden=64, heads=4,
                           tokenizer=spec["tokenizer"], vocab_size=spec["vocab_size"], max_positions=256))


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    """The recipe's data file as ``xrlhf prepare-data`` writes it."""
    from xrlhf.data.datasets import write_jsonl
    from xrlhf.envs.word_problems import make_rows

    path = tmp_path_factory.mktemp("data") / "arithmetic.jsonl"
    write_jsonl(make_rows(learning_gpu.DATA_ROWS, learning_gpu.DATA_SEED), path)
    return str(path)


def test_the_recipe_and_its_variants_validate(bpe_model, data, tmp_path):
    out = learning_gpu.main(["--dry-run", "--model", bpe_model, "--set", f"env.options.dataset={data}",
                             "--variants", "sync,async,split,async-split", "--runs-dir", str(tmp_path / "r"),
                             "--out", str(tmp_path)])
    c = out["configs"]
    w = c["warmup"]
    assert (w.seed, w.warmup.steps, w.warmup.batch_size, w.policy.generate.engine) == (0, 150, 64, "hf")
    s = c["sync"]
    assert s.warmup.steps == 0 and s.policy.generate.engine == "vllm" and s.rollout.max_staleness == 0
    t = s.trainer
    assert (t.steps, t.eval_every, t.prompts_per_step, t.samples_per_prompt) == (50, 5, 64, 8)
    # the RL the sweep chose: lr 5e-6 warmed up over 10 optimizer steps, sampling at 0.7, two epochs
    tr = s.policy.train
    assert (tr.lr, tr.lr_warmup_steps, s.policy.generate.temperature) == (5e-6, 10, 0.7)
    assert s.algorithm.options()["ppo_epochs"] == 2 and w.warmup.lr == 2e-4
    # every GPU default left to the engine: compiled layers, mixed precision, derived token budgets
    assert s.policy.train.dtype == "bfloat16" and not {"compile", "mixed_precision"} & set(s.policy.train.model_extra)
    assert "micro_batch_size" not in s.policy.train.model_fields_set
    assert c["async"].rollout.max_staleness == 1 and c["async"].policy.generate.engine_fields()["sleep_level"] == 0
    for name in ("split", "async-split"):
        assert c[name].ray.num_gpus == 2 and c[name].policy.generate.resources is not None
    assert c["async-split"].rollout.max_staleness == 1 and c["split"].rollout.max_staleness == 0


def test_rl_set_changes_the_rl_runs_and_not_the_warm_up(bpe_model, data, tmp_path):
    """``--rl-set``: a recipe candidate that reuses the warm-up; TRL's side takes the same updates per batch."""
    from benchmarks.trl_grpo import batch_shape

    out = learning_gpu.main(["--dry-run", "--model", bpe_model, "--set", f"env.options.dataset={data}", "--rl-set",
                             "policy.generate.temperature=0.9", "algorithm.ppo_epochs=3", "algorithm.mini_batch_size=256",
                             "--runs-dir", str(tmp_path / "r"), "--out", str(tmp_path)])
    w, s = out["configs"]["warmup"], out["configs"]["sync"]
    assert s.policy.generate.temperature == 0.9 and w.policy.generate.temperature == 1.0  # its own generate: HF
    assert batch_shape(s) == (512, 256, 3) and batch_shape(w) == (512, 512, 2)


def test_the_sizes_the_recipe_states(bpe_model, data):
    """Prompts <= 45 tokens (+ BOS) and demonstrations <= 42 (+ EOS) under the 0.5b preset's BPE:
    64 new tokens hold every worked answer, and prompt + 64 fit max_model_len 128; 306 held out."""
    from xrlhf.config.loader import read_yaml
    from xrlhf.data.text import encode_prompt, encode_target, load_tokenizer
    from xrlhf.envs import build_env

    y = read_yaml(learning_gpu.ROOT / learning_gpu.CONFIG)
    env = build_env("dataset", {**y["env"]["options"], "dataset": data}, 0)
    tok = load_tokenizer(bpe_model)
    train, held = env.rows.splits
    longest_prompt = max(len(encode_prompt(tok, r.prompt)) for r in (*train, *held))
    longest_answer = max(len(encode_target(tok, r.target)) for r in train)
    g = y["policy"]["generate"]
    assert (longest_prompt, longest_answer) == (46, 43)
    assert longest_answer <= g["max_new_tokens"] and longest_prompt + g["max_new_tokens"] <= g["max_model_len"]
    assert len(held) == len(env.eval_prompts()) == y["env"]["options"]["eval_size"] == 256
    every = build_env("dataset", {**y["env"]["options"], "dataset": data, "eval_size": None}, 0)
    assert len(every.rows.splits[1]) == 306  # the header's count of held-out prompts


def curve(*points: tuple[float, float]) -> list[dict]:
    return [{"step": 5 * i, "eval_reward": r, "rl_s": t} for i, (t, r) in enumerate(points)]


def test_verdicts_from_curves():
    run = learning_gpu.judge({"variant": "sync", "seed": 0, "steps": 10, "rl_s": 40.0, "error": None,
                              "curve": curve((0, 0.30), (20, 0.34), (40, 0.40))}, margin=0.05)
    assert (run["eval_before_rl"], run["eval_last"], run["rise"], run["met"]) == (0.30, 0.40, 0.1, True)
    flat = learning_gpu.judge({"variant": "sync", "seed": 1, "steps": 10, "rl_s": 40.0, "error": None,
                               "curve": curve((0, 0.30), (40, 0.33))}, margin=0.05)
    assert flat["met"] is False and learning_gpu.judge({"curve": [], "error": "x"}, 0.05)["met"] is None
    fast = learning_gpu.judge({"variant": "async", "seed": 0, "steps": 10, "rl_s": 30.0, "error": None,
                               "curve": curve((0, 0.30), (15, 0.40), (30, 0.42))}, margin=0.05)
    s = learning_gpu.summarize([run, flat, fast])
    assert s["sync"]["all_met"] is False and s["sync"]["rise_min"] == 0.03 and s["sync"]["s_per_step"] == 4.0
    assert s["async"]["time_to_sync_last_ratio"] == [0.375]  # 15 s against sync's 40 s to 0.40
    v = learning_gpu.trl_verdict(curve((0, 0.30), (10, 0.45), (20, 0.50)), curve((0, 0.30), (50, 0.40), (90, 0.45)))
    assert (v["target"], v["trl_s"], v["xrlhf_s"], v["ratio"], v["met"]) == (0.45, 90, 10, 0.111, True)
    v = learning_gpu.trl_verdict(curve((0, 0.30), (100, 0.40)), curve((0, 0.30), (90, 0.40)))
    assert v["ratio"] == 1.111 and v["met"] is False
    assert learning_gpu.trl_verdict(curve((0, 0.3)), curve((0, 0.3), (9, 0.2)))["met"] is None  # TRL learned nothing
    old = [{"variant": "sync", "seed": 0, "x": 1}, {"variant": "sync", "seed": 1, "x": 1}]
    new = {"variant": "sync", "seed": 1, "x": 2}
    assert learning_gpu.merge(old, [new]) == [old[0], new]


def test_the_first_steps_compile_leaves_the_clock_that_runs_compare_on():
    """A run that compiled (its first interval 54 s against 7 s next) is compared from its steady steps."""
    cold = curve((0, 0.28), (54, 0.27), (61, 0.30), (68, 0.33))
    assert common.compile_excess(cold) == 47.0
    assert [p["rl_s"] for p in common.steady(cold)] == [0, 7.0, 14.0, 21.0]
    assert common.compile_excess(curve((0, 0.3), (8, 0.3), (16, 0.3))) == 0.0
    assert common.compile_excess(curve((0, 0.3), (5, 0.3), (16, 0.3))) == 0.0  # a slower second: no excess
    sync = curve((0, 0.28), (13, 0.30), (21, 0.31), (29, 0.32))  # excess 5: steady 8, 16, 24
    # cold's steady evals at 7, 14, 21 s against sync's latest then (0.28, 0.30, 0.31): 0.27 < 0.28
    assert common.at_or_above(cold, sync) == round(2 / 3, 3)
    assert common.at_or_above(curve((0, 0.3)), sync) is None


def test_a_candidate_replaced_in_the_table_stays_reusable(tmp_path):
    """``learn_sweep`` runs seed 0 once per candidate: the table keeps the last, ``runs.jsonl`` all."""
    a = {"variant": "sync", "seed": 0, "overrides": ["lr=1"], "run_dir": "a", "error": None}
    b = {**a, "overrides": ["lr=2"], "run_dir": "b"}
    for run in (a, b):
        learning_gpu.keep_run(tmp_path, run)
    every = learning_gpu.load_every(tmp_path)
    assert learning_gpu.stored(every, "sync", 0, ["lr=1"])["run_dir"] == "a"
    assert learning_gpu.stored(every, "sync", 0, ["lr=3"]) is None and learning_gpu.load_store(tmp_path) == []


def test_best_takes_the_sweep_winner_and_the_dry_run_validates_it(bpe_model, data, tmp_path):
    """``--rl-set best``: the RL overrides of the kept seed-0 sync run that rose most (a tie goes
    to the later run; an errored run or another seed never wins); none kept: the recipe as written."""
    run = lambda rl, rise, **kw: {"variant": "sync", "seed": 0, "rl_set": rl, "rise": rise, "error": None, **kw}  # noqa: E731
    runs = [run(["policy.train.lr=1e-5"], 0.02), run(["policy.train.lr_warmup_steps=10"], 0.06),
            run(["policy.train.lr=1e-4"], 0.3, error="died"), run(["trainer.steps=3"], 0.5, seed=1),
            run(["policy.generate.temperature=0.9"], 0.06)]
    assert learning_gpu.best_rl_set(runs) == ["policy.generate.temperature=0.9"]
    assert learning_gpu.best_rl_set([]) == []
    (tmp_path / "r").mkdir()
    for r in runs:
        learning_gpu.keep_run(tmp_path / "r", r)
    out = learning_gpu.main(["--dry-run", "--model", bpe_model, "--set", f"env.options.dataset={data}", "--rl-set",
                             "best", "--runs-dir", str(tmp_path / "r"), "--out", str(tmp_path)])
    assert out["configs"]["sync"].policy.generate.temperature == 0.9


def test_the_report_section(tmp_path):
    text = "\n".join(report.learning_gpu(None, None, str))
    assert "Not run yet: `python -m benchmarks.learning_gpu --out benchmarks/results`" in text
    assert "Beside TRL: not run yet" in text
    run = {**learning_gpu.judge({"variant": "async", "seed": 2, "steps": 10, "rl_s": 40.0, "error": None,
                                 "curve": curve((0, 0.30), (40, 0.40))}, 0.05)}
    r = {"config": learning_gpu.CONFIG, "gpu": "H200", "margin": 0.05, "warmup": {"steps": 400}, "runs": [run],
         "png": "learning_gpu.png", "not_run": ["sync seed 2"], "variants": learning_gpu.summarize([run])}
    text = "\n".join(report.learning_gpu(r, None, lambda p: f"../r/{p}"))
    assert "| async | 2 | 0.300 | 0.400 | 0.100 | yes | 40.0 | 0.0 | 4.00 |" in text  # 0.0: no first steps' compile
    assert "* **async** against sync of the same seed, on the steady clock: its evals at or above sync's curve — " in text
    assert "* not run (time): sync seed 2." in text
    assert "![eval reward against the RL clock](../r/learning_gpu.png)" in text


@pytest.mark.long  # a benchmark's smoke of ~40 s beside a busy core: make test-all (CI) runs it
@pytest.mark.slow  # a warm-up process and one RL run with Ray on the tiny model: ~40 s on 2 cores
def test_cpu_smoke_writes_the_table_and_the_plot_and_keeps_its_runs(tmp_path):
    args = ["--cpu-smoke", "--seeds", "0", "--out", str(tmp_path / "out"), "--runs-dir", str(tmp_path / "runs")]
    data = learning_gpu.main(args)
    saved = json.loads((tmp_path / "out" / "learning_gpu.json").read_text())
    (run,) = saved["runs"]
    assert run["error"] is None and run["variant"] == "sync" and [p["step"] for p in run["curve"]] == [0, 1, 2]
    assert run["met"] in (True, False) and run["rise"] == round(run["eval_last"] - run["eval_before_rl"], 4)
    assert saved["warmup"]["steps"] == 4 and saved["variants"]["sync"]["seeds"] == [0] and data["runs"]
    assert (tmp_path / "out" / "learning_gpu.png").stat().st_size > 0
    assert (tmp_path / "out" / "runs" / run["run_dir"].split("/")[-1] / "metrics.jsonl").is_file()
    again = learning_gpu.main([*args, "--reuse-runs"])  # the warm-up and the run are kept, nothing runs
    assert [r["run_dir"] for r in again["runs"]] == [run["run_dir"]]
    assert len([p for p in (tmp_path / "runs").iterdir() if p.name.startswith("sync-")]) == 1


@pytest.mark.slow  # TRL's trainer built and two steps on CPU beside an xrlhf run: one to two minutes
def test_cpu_smoke_beside_trl(tmp_path):
    """``--trl`` on CPU where TRL is importable (benchmarks/trl_grpo.py learn's Transformers path)."""
    pytest.importorskip("trl")
    data = learning_gpu.main(["--cpu-smoke", "--trl", "--seeds", "0", "--out", str(tmp_path / "out"),
                              "--runs-dir", str(tmp_path / "runs")])
    assert data["trl"]["rc"] == 0 and [p["step"] for p in data["trl"]["curve"]] == [0, 1, 2]
    assert data["xrlhf_same_call"] and [p["step"] for p in data["xrlhf"]["curve"]] == [0, 1, 2]
    assert data["trl"]["summary"]["num_generations"] == 4 and data["trl"]["summary"]["beta"] == 0.04
    assert (tmp_path / "out" / "learning_vs_trl.png").is_file()


def test_xrlhf_set_reaches_xrlhf_alone(monkeypatch, tmp_path):
    """``--trl --xrlhf-set trainer.steps=90``: xrlhf's run takes the extra overrides (room to reach
    TRL's last eval), TRL's does not; the kept run records them, so ``--reuse-runs`` finds it again.
    Control flow only: both runs stood in for (the real pair: ``test_cpu_smoke_beside_trl``)."""
    seen = {}
    curve = [{"step": 0, "eval_reward": 0.2, "rl_s": 0.0}, {"step": 5, "eval_reward": 0.4, "rl_s": 10.0}]

    def trl(args, warm, overrides, out, timeout):
        seen["trl"] = overrides
        return {"rc": 0, "curve": curve[:1] + [{**curve[1], "rl_s": 30.0}]}

    def xrlhf(args, runs_dir, overrides, variant, seed):
        seen["xrlhf"] = overrides
        return {"variant": variant, "seed": seed, "overrides": overrides, "curve": curve, "error": None, "run_dir": "x"}

    monkeypatch.setattr(learning_gpu, "run_trl", trl)
    monkeypatch.setattr(learning_gpu, "one_run", xrlhf)
    monkeypatch.setattr(learning_gpu, "plot", lambda *a, **k: None)
    args = learning_gpu.parse_args(["--trl", "--seeds", "0", "--rl-set", "policy.train.lr=5e-6", "--xrlhf-set",
                                    "trainer.steps=90", "--out", str(tmp_path), "--reuse-runs"])
    base, warm = ["env.options.dataset=d"], {"model": "w"}
    data = learning_gpu.beside_trl(args, tmp_path, base, warm, learning_gpu.Budget(0, 1))
    assert seen["xrlhf"] == seen["trl"] + ["trainer.steps=90"] and "trainer.steps=90" not in seen["trl"]
    assert data["ratio"] == round(10 / 30, 3) and data["met"] and data["xrlhf_same_call"]
    assert learning_gpu.load_every(tmp_path)[0]["rl_set"] == ["policy.train.lr=5e-6", "trainer.steps=90"]
    again = learning_gpu.beside_trl(args, tmp_path, base, warm, learning_gpu.Budget(0, 1))
    assert not again["xrlhf_same_call"]
