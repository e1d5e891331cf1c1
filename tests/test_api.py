"""From Python and from a training loop: `extract.extract_model` on a model in memory, the Trainer
callback and `cli.py train --probe` give the warehouse `cli.py extract` gives from the saved model, and
leave the model (and the training) as they were."""

from __future__ import annotations

import shutil

import pytest
import torch

from conftest import run_cli, views

from common.errors import UserError


def _load(path, **config):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path, **config), AutoTokenizer.from_pretrained(path)


def _state(model):
    """Everything the pass must leave as it was: weights, grads, requires_grad, modes, hooks, place."""
    return {
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
        "training": {n: m.training for n, m in model.named_modules()},
        "hooks": {n: (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks))
                  for n, m in model.named_modules()},
        "place": {(p.device, p.dtype) for p in model.parameters()},
    }


def _same_state(a, b):
    assert a["weights"].keys() == b["weights"].keys()
    assert all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])
    assert all((a["grads"][n] is None) == (b["grads"][n] is None) and
               (a["grads"][n] is None or torch.equal(a["grads"][n], b["grads"][n])) for n in a["grads"])
    for key in ("requires_grad", "training", "hooks", "place"):
        assert a[key] == b[key], key


def test_extract_model_equals_cli_extract_and_leaves_the_model(workdir, sources, model_factory, single):
    """The saved tiny model loaded in memory (in train mode, a frozen parameter, a grad, a hook of the
    user's; called under autocast) gives the views of `cli.py extract` of its directory (the `single` fixture); a source
    given as (name, texts) equals the same documents from the file; the model is left as it was."""
    from extract import extract_model, weights_fingerprint
    from extract.sources import ReadStats, documents, parse_source

    path = model_factory("gpt_neox", tied=False)
    model, tok = _load(path)
    model.train()
    model.gpt_neox.layers[0].mlp.dense_h_to_4h.bias.requires_grad_(False)
    model.lm_head.weight.grad = torch.ones_like(model.lm_head.weight)
    calls = []
    model.gpt_neox.layers[1].register_forward_hook(lambda m, a, o: calls.append(1))
    before, rng = _state(model), torch.get_rng_state()
    beta = list(documents(parse_source(f"beta={sources['beta']}"), (1, 1), ReadStats()))
    wh = workdir / "api-extract"
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a caller's mixed precision does not reach the pass
        entries = extract_model(model, tok, [f"alpha={sources['alpha']}", ("beta", iter(beta))], wh,
                                name=path.name, max_length=32, batch_size=2, cross_moments=True, log=None)
    assert views(wh) == single["views"]
    assert [e["kind"] for e in entries] == ["params", "data", "data"]
    assert {e["source"] for e in entries} == {None, "alpha", "beta"}
    assert {e["provenance"]["model_revision"] for e in entries} == {weights_fingerprint(model)}
    assert calls  # the user's hook ran during the pass, and is still there
    _same_state(before, _state(model))
    assert torch.equal(rng, torch.get_rng_state())  # a training loop's random stream goes on as without the pass
    from warehouse.query import connect

    rows = {}
    for w in (wh, single["wh"]):
        con = connect(w)
        rows[str(w)] = [sorted(con.execute(f"SELECT * FROM {v}").fetchall())  # the parameter tables' views
                        for v in ("isotropy", "layernorm", "weight_spectrum")]
        con.close()
    assert rows[str(wh)] == rows[str(single["wh"])] and all(rows[str(wh)])


def test_weights_fingerprint(model_factory):
    from extract import weights_fingerprint

    a, _ = _load(model_factory("gpt_neox", tied=True))
    b, _ = _load(model_factory("gpt_neox", tied=True))
    assert weights_fingerprint(a) == weights_fingerprint(b)
    with torch.no_grad():
        b.gpt_neox.final_layer_norm.bias[0] += 1e-3
    assert weights_fingerprint(a) != weights_fingerprint(b)
    assert weights_fingerprint(a.to(torch.bfloat16)) != weights_fingerprint(b)


def test_setting_defaults_are_what_the_command_line_hands_on(monkeypatch):
    """The API's defaults are the options `cli.py extract --model M --source S` hands to `prepare`, as
    the command line parsed them: one declaration (extract/declared.py) read by both."""
    import extract.options
    from common.default_warehouse import DEFAULT_WAREHOUSE
    from extract.api import SETTING_DEFAULTS
    from extract.declared import OPTIONS

    seen = {}

    def spy(options, launch=None):
        seen.update(options)
        raise UserError("stop here")

    monkeypatch.setattr(extract.options, "prepare", spy)
    code, _, err = run_cli("extract", "--model", "m", "--source", "a=b.txt")
    assert code == 2 and "stop here" in err, err
    assert list(seen) == [o.name for o in OPTIONS]  # every declared option, in order, and no other
    run = {"model": "m", "checkpoint": None, "checkpoints": None, "source": ["a=b.txt"],
           "warehouse": DEFAULT_WAREHOUSE, "name": None}  # given here, or the API's own keywords
    assert {k: v for k, v in seen.items() if k in run} == run
    assert {k: v for k, v in seen.items() if k not in run} == SETTING_DEFAULTS


def test_a_run_records_every_declared_setting_with_the_declared_defaults():
    """`Settings` (what a run records) holds exactly the declared recorded options, and its own defaults
    are the declared defaults as `make_settings` resolves them on a CPU; --skip-done compares only
    recorded settings."""
    from dataclasses import fields

    from extract.declared import OPTIONS, RESULT_SETTINGS, defaults
    from extract.launch import Launch
    from extract.options import make_settings
    from extract.run.settings import Settings

    recorded = {o.recorded for o in OPTIONS if o.recorded}
    from_source = {o.recorded for o in OPTIONS if o.recorded and o.source}  # recorded from the Source
    assert from_source == {"pile_set", "split_by"}
    assert {f.name for f in fields(Settings)} - {"read_shard"} == recorded - from_source
    assert set(RESULT_SETTINGS) <= recorded and "scatter" not in recorded
    assert make_settings(defaults(), Launch((1, 1), "single"), False) == Settings()


def _blocks(tok, texts, length=32):
    ids = [t for ids in tok(texts, add_special_tokens=False)["input_ids"] for t in ids]
    return [{"input_ids": ids[i:i + length], "labels": ids[i:i + length]}
            for i in range(0, len(ids) - length, length)]


def _trainer(model, tok, data, out, seed=0):
    from transformers import Trainer, TrainingArguments, default_data_collator

    args = TrainingArguments(output_dir=str(out), max_steps=20, save_strategy="steps", save_steps=10,
                             save_only_model=True, per_device_train_batch_size=4, learning_rate=3e-3, seed=seed,
                             logging_steps=5, report_to="none", use_cpu=True, disable_tqdm=True,
                             dataloader_num_workers=0)
    return Trainer(model=model, args=args, train_dataset=data, processing_class=tok,
                   data_collator=default_data_collator)


def test_trainer_callback_equals_saved_checkpoints_and_leaves_training_unchanged(workdir, sources, model_factory):
    """20 Trainer steps (dropout on: the RNG matters) with the callback at the saves (10, 20) give the
    views of `cli.py extract` of the saved step-10 and step-20 checkpoints, log the headline numbers
    through the trainer, and end in the same weights as the same run without the callbacks (this one
    and one probing every 5 steps)."""
    from extract import IsotropyCallback
    from tiny import corpus

    path = model_factory("gpt_neox", tied=False)
    dropout = {"hidden_dropout": 0.2, "attention_dropout": 0.2}
    name = "tinyrun"
    wh, ref_wh = workdir / "cb-wh", workdir / "cb-ref-wh"
    probe = f"alpha={sources['alpha']}"

    model, tok = _load(path, **dropout)
    data = _blocks(tok, corpus(60, seed=5))
    trainer = _trainer(model, tok, data, workdir / "cb-run")
    cb = IsotropyCallback(tok, probe, wh, name=name, max_tokens=400, max_length=32)
    trainer.add_callback(cb)  # not attached: the numbers go to state.log_history directly
    every = IsotropyCallback(tok, probe, workdir / "cb-every-wh", name=name, max_tokens=400, max_length=32,
                             every=5).attach(trainer)  # through Trainer.log, from on_step_end
    trainer.train()
    assert [h["step"] for h in cb.history] == [10, 20]
    assert [h["step"] for h in every.history] == [5, 10, 15, 20] and every.history[1::2] == cb.history
    with_cb = {k: v.clone() for k, v in model.state_dict().items()}

    plain, tok2 = _load(path, **dropout)
    _trainer(plain, tok2, data, workdir / "plain-run").train()
    assert all(torch.equal(with_cb[k], v) for k, v in plain.state_dict().items())

    ckpts = workdir / "cb-ckpts" / name  # the saved checkpoints as cli.py extract reads them: DIR/stepN
    for step in (10, 20):
        shutil.copytree(workdir / "cb-run" / f"checkpoint-{step}", ckpts / f"step{step}")
    code, _, err = run_cli("extract", "--model", ckpts, "--checkpoint", "step10", "--checkpoint", "step20",
                           "--source", probe, "--max-tokens", "400", "--max-length", "32", "--warehouse", ref_wh)
    assert code == 0, err
    got, want = views(wh), views(ref_wh)
    assert got == want and {r[0] for r in got["shards"]} == {"step10", "step20"}

    from extract.api import headlines

    logged = {h["step"]: h for h in trainer.state.log_history if "isotropy/inter_sim_last" in h}
    assert set(logged) == {5, 10, 15, 20}
    for step in (10, 20):
        want_numbers = headlines(ref_wh, name, f"step{step}")
        assert len(want_numbers) == 4
        assert {k: logged[step][f"isotropy/{k}"] for k in want_numbers} == want_numbers
    assert {h["step"] for h in trainer.state.log_history if "loss" in h} == {5, 10, 15, 20}  # the steps' own logs kept


def test_train_probe_equals_extract_of_its_checkpoints(workdir, sources):
    """`cli.py train --probe` in the loop = `cli.py extract --checkpoints all` of what it saved."""
    out = workdir / "probed" / "micro"
    wh, ref_wh = workdir / "probe-wh", workdir / "probe-ref-wh"
    probe = f"alpha={sources['alpha']}"
    code, _, err = run_cli("train", "--source", probe, "--out", out, "--width", "32", "--depth", "2", "--heads", "2",
                           "--context", "32", "--vocab", "300", "--steps", "4", "--save-every", "4",
                           "--batch-size", "4", "--probe", probe, "--warehouse", wh, "--probe-tokens", "300")
    assert code == 0, err
    assert "micro step4: inter_sim_last" in err
    code, _, err = run_cli("extract", "--model", out, "--checkpoints", "all", "--source", probe,
                           "--max-tokens", "300", "--warehouse", ref_wh)
    assert code == 0, err
    got = views(wh)
    assert got == views(ref_wh) and {r[0] for r in got["shards"]} == {"step0", "step4"}
    # --no-checkpoints with other settings: the saved checkpoints stay, train.json still describes them
    # (it was rewritten with the new settings, so a later `train` with those reused the old weights)
    record = (out / "train.json").read_text()
    code, _, err = run_cli("train", "--source", probe, "--out", out, "--width", "32", "--depth", "2", "--heads", "2",
                           "--context", "32", "--vocab", "300", "--steps", "4", "--save-every", "4", "--seed", "1",
                           "--batch-size", "4", "--probe", probe, "--warehouse", workdir / "probe-wh-2",
                           "--probe-tokens", "300", "--no-checkpoints")
    assert code == 0, err
    assert (out / "train.json").read_text() == record


def _one_line(fn, *args, match: str, **kw):
    with pytest.raises(UserError, match=match) as e:
        fn(*args, **kw)
    assert "\n" not in str(e.value)


def test_bad_arguments_are_one_line(workdir, sources, model_factory):
    from extract import IsotropyCallback, extract_model, probe_isotropy

    model, tok = _load(model_factory("gpt_neox", tied=False))
    wh = workdir / "api-bad"
    alpha = f"alpha={sources['alpha']}"
    _one_line(extract_model, model, tok, ["alpha=/no/such.txt"], wh, name="m", match="no such file")
    _one_line(extract_model, model, tok, [alpha], wh, name="m", max_tokenz=5, match="unknown setting 'max_tokenz'")
    _one_line(extract_model, model, tok, [alpha], wh, name="m", dtype="bfloat16", match="model's weights are float32")
    _one_line(extract_model, model, tok, [alpha], wh, name="m", device="cuda", match="model's weights are cpu")
    _one_line(extract_model, model, tok, [alpha], wh, name="", match="name ''")
    _one_line(extract_model, model, tok, [], wh, name="m", match="at least one source")
    _one_line(extract_model, model, tok, [("bad name", ["x"])], wh, name="m", match="source name 'bad name'")
    _one_line(extract_model, model, tok, [("b", ["x", 3])], wh, name="m", match="text 1 is a int")
    _one_line(extract_model, model, tok, [42], wh, name="m", match="NAME=PATH string or a")
    _one_line(extract_model, model, tok, [("b", "one text")], wh, name="m", match="not a single str")
    with pytest.raises(UserError, match="no such file"):  # a tuple of NAME=PATH strings is two sources
        extract_model(model, tok, (alpha, "beta=/no/such.txt"), wh, name="m")
    _one_line(extract_model, "a model", tok, [alpha], wh, name="m", match="expected a Hugging Face model")
    _one_line(extract_model, model, tok, [alpha], wh, name="m", unit="word", match="--unit 'word'")
    _one_line(extract_model, model, tok, [alpha], wh, name="m", step=-1, match="step -1")
    _one_line(probe_isotropy, model, tok, alpha, wh, name="m", step="ten", match="step 'ten'")
    _one_line(IsotropyCallback, tok, "probe", wh, name="m", match="expected NAME=PATH")
    _one_line(IsotropyCallback, tok, alpha, wh, name="m", every=0, match="every=0")
    _one_line(IsotropyCallback, tok, alpha, wh, name="m", colour=1, match="unknown setting 'colour'")
    afile = workdir / "api-bad-file"
    afile.write_text("x")
    _one_line(extract_model, model, tok, [alpha], afile, name="m", match="warehouse .*: not a directory")
    _one_line(IsotropyCallback, tok, alpha, afile, name="m", match="warehouse .*: not a directory")
    assert not (wh / "tables").exists()  # nothing written
    for args in (["--probe", "nope"], ["--source", alpha, "--no-checkpoints"]):
        code, _, err = run_cli("train", "--out", workdir / "x", *args)
        assert code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    code, _, err = run_cli("train", "--out", workdir / "y", "--source", alpha, "--probe", alpha, "--warehouse", afile)
    assert code == 2 and err.strip() == f"error: --warehouse: warehouse {afile}: not a directory", err
    assert not (workdir / "y").exists()  # before the tokenizer and step 0
