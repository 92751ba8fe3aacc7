"""The supercon workload on the CPU: formula parsing, the packaged data, the two builds' agreement, the candidate
space, training and screening through the command (a few hundred rows and a tiny model: the pipeline, not the
score), resuming after Ctrl-C, and the one-line errors of bad input."""

import argparse
import csv
import fractions
import gzip
import io
import json
import re
import signal
from dataclasses import replace
from importlib import resources

import pytest
import torch

from flashmoe_science.errors import CommandError
from flashmoe_science.science import supercon_screen, supercon_train
from flashmoe_science.science.checkpoint import Interrupted, save_atomic
from flashmoe_science.science.cli import add_supercon_parser
from flashmoe_science.science.formula import FormulaError, parse_formula, read_formula_csv
from flashmoe_science.science.progress import progress_bar
from flashmoe_science.science.supercon_data import (
    PACKAGED_DATA,
    curate_labels,
    load_supercon,
    pack_compositions,
    split_indices,
)
from flashmoe_science.science.supercon_model import (
    ELEMENT_SYMBOLS,
    CompositionTransformer,
    ModelConfig,
    element_property_matrix,
)
from flashmoe_science.science.supercon_baselines import write_results
from flashmoe_science.science.supercon_screen import CandidateSpace, score, screen
from flashmoe_science.science.supercon_train import TrainConfig, train

TINY = ModelConfig(d_model=32, num_heads=2, num_layers=1, num_experts=4, top_k=2, d_ff=32, fraction_frequencies=4)
TINY_OPTIONS = ["--d-model", "32", "--heads", "2", "--layers", "1", "--experts", "4", "--d-ff", "32"]


def supercon(*argv: str) -> int:
    """``flashmoe-science supercon ...`` up to the command's handler (CommandError propagates, as the entry point
    receives it)."""
    parser = argparse.ArgumentParser(prog="flashmoe-science")
    add_supercon_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["supercon", *argv])
    return args.handler(args)


def packaged_lines(count: int) -> list[str]:
    """The header and the first ``count`` rows of the packaged SuperCon CSV."""
    with resources.as_file(resources.files("flashmoe_science.science").joinpath(PACKAGED_DATA)) as path:
        with gzip.open(path, "rt") as handle:
            return [next(handle) for _ in range(count + 1)]


@pytest.fixture
def small_csv(tmp_path):
    """A real slice of SuperCon (300 rows) plus two bad lines."""
    path = tmp_path / "supercon.csv"
    lines = packaged_lines(300)
    lines.insert(5, "Sm1Ba-1Cu3O6.94,10\n")
    lines.insert(9, "La2CuO4,n/a\n")
    path.write_text("".join(lines))
    return path


def interrupt_on_call(monkeypatch, module, name: str, call: int) -> None:
    """Sends SIGINT (Ctrl-C) when ``module.name`` is called for the ``call``-th time."""
    original, calls = getattr(module, name), []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            signal.raise_signal(signal.SIGINT)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapped)


def test_parse_formula():
    assert parse_formula("Ba0.2La1.8Cu1O4") == {"Ba": 0.2, "La": 1.8, "Cu": 1.0, "O": 4.0}
    assert parse_formula("(La0.9Sr0.1)2CuO4") == pytest.approx({"La": 1.8, "Sr": 0.2, "Cu": 1.0, "O": 4.0})
    assert parse_formula("CuOCu2") == {"Cu": 3.0, "O": 1.0}  # repeated symbols summed
    assert parse_formula("D2O") == {"H": 2.0, "O": 1.0}
    assert parse_formula("La2Sr0CuO4") == {"La": 2.0, "Cu": 1.0, "O": 4.0}  # amount 0: absent
    for bad, reason in [("", "empty"), ("Xx2", "unknown element"), ("La2(Cu", "'('"), ("Cu)2", "')'"),
                        ("2Cu", "follows no element"), ("Ba-1", "'-'"), ("O0", "no element")]:
        with pytest.raises(FormulaError, match=re.escape(reason)):
            parse_formula(bad)


def test_read_csv_reports_rejected_lines(small_csv):
    table = read_formula_csv(small_csv)
    assert [(r.line, r.text) for r in table.rejected] == [(6, "Sm1Ba-1Cu3O6.94"), (10, "La2CuO4")]
    assert "not a number" in table.rejected[1].reason
    data_lines = len(small_csv.read_text().splitlines()) - 1
    assert len(table.formulas) == data_lines - 2 and "2 rejected" in table.summary()


def test_element_properties_standardised():
    properties = element_property_matrix()
    assert properties.shape[0] == len(ELEMENT_SYMBOLS) == 96 and torch.isfinite(properties).all()
    assert properties.mean(0).abs().max() < 1e-4


def test_builds_agree_and_ignore_padding():
    """The packed build (library varlen attention + fused_moe, reference path here) equals the padded plain build,
    and a composition's prediction does not depend on its batch neighbours."""
    torch.manual_seed(0)
    model = CompositionTransformer(TINY).double().eval()
    compositions = [{"La": 1.85, "Sr": 0.15, "Cu": 1, "O": 4}, {"Nb": 3, "Sn": 1}, {"Pb": 1},
                    {"Y": 1, "Ba": 2, "Cu": 3, "O": 6.9, "Ca": 0.1, "Zn": 0.05}]
    data = pack_compositions(compositions, [str(c) for c in compositions])
    packed = data.batch(torch.arange(len(data)))
    packed.fractions = packed.fractions.double()
    fused = model(packed)
    plain = model(packed.padded())
    torch.testing.assert_close(fused, plain, rtol=1e-9, atol=1e-9)
    alone = model(data.batch(torch.tensor([2])))
    torch.testing.assert_close(alone, fused[2:3], rtol=1e-6, atol=1e-6)


def test_candidate_space_decodes_substitutions():
    parents = pack_compositions([{"La": 2, "Cu": 1, "O": 4}, {"Nb": 3, "Sn": 1}], ["La2Cu1O4", "Nb3Sn1"], [30, 18])
    dopants = torch.tensor([ELEMENT_SYMBOLS.index(s) for s in ("Sr", "Ba", "Sn")])
    space = CandidateSpace(parents, dopants, levels=(0.1, 1.0))
    assert len(space) == 3 * 3 * 2 + 2 * 2 * 2  # Sn is already in Nb3Sn
    formulas = [space.formula(i) for i in range(len(space))]
    assert len(set(formulas)) == len(formulas)
    assert "La1.8Sr0.2Cu1O4" in formulas and "Sr2Cu1O4" in formulas and "Nb2.7Sr0.3Sn1" in formulas
    padded = space.padded_batch(0, len(space))
    torch.testing.assert_close(padded.fractions.sum(1), torch.ones(len(space)))  # fractions keep their sum
    packed = padded.packed()
    assert packed.cu_seqlens[-1] == padded.mask.sum() and packed.elements.numel() == padded.mask.sum()
    for i, formula in enumerate(formulas):  # the tensors decode to the formula written for the same index
        row = {ELEMENT_SYMBOLS[e]: f for e, f, m in zip(padded.elements[i].tolist(), padded.fractions[i].tolist(),
                                                        padded.mask[i].tolist()) if m}
        amounts = parse_formula(formula)
        total = sum(amounts.values())
        assert row == pytest.approx({s: a / total for s, a in amounts.items()})



def test_candidate_batches_pack_with_host_token_counts():
    """The library build's candidate batches, packed with the token count the host computes, equal the padded
    batches packed by reading the mask, for ranges that start and stop inside a parent, a parent with no dopant
    left (no candidates), and a level of 1 (the dopant replaces the site: no extra token)."""
    compositions = [{"La": 1.85, "Sr": 0.15, "Cu": 1, "O": 4}, {"Nb": 3, "Sn": 1}, {"Sr": 1, "Sn": 1, "Zn": 2},
                    {"Y": 1, "Ba": 2, "Cu": 3, "O": 6.9, "Zn": 0.05}, {"Pb": 1}]
    parents = pack_compositions(compositions, [str(c) for c in compositions])
    dopants = torch.tensor([ELEMENT_SYMBOLS.index(s) for s in ("Sr", "Sn", "Zn")])
    space = CandidateSpace(parents, dopants, levels=(0.3, 1.0, 0.05))
    masks = space.padded_batch(0, len(space)).mask.sum(1)
    generator = torch.Generator().manual_seed(0)
    stops = [0, len(space), *torch.randint(0, len(space) + 1, (40,), generator=generator).tolist()]
    for stop in stops:
        assert space.token_count(stop) == int(masks[:stop].sum()), stop
    for start, stop in [(0, len(space)), (0, 0), (5, 6), (7, 61), (len(space) - 1, len(space))]:
        packed = space.batch(start, stop, "fused")
        reference = space.padded_batch(start, stop).packed()
        for name in ("elements", "fractions", "cu_seqlens"):
            torch.testing.assert_close(getattr(packed, name), getattr(reference, name), rtol=0, atol=0)
        assert packed.max_seqlen == reference.max_seqlen
        assert isinstance(space.batch(start, stop, "plain"), type(space.padded_batch(0, 1)))
    with pytest.raises(ValueError, match="stop must be"):
        space.token_count(len(space) + 1)
    with pytest.raises(ValueError, match="implementation must be"):
        space.batch(0, 1, "cuda")
    with pytest.raises(ValueError, match="total must be"):
        space.padded_batch(0, 1).packed(-1)
    zero = pack_compositions([{"La": 1, "O": 0}], ["La1O0"])
    with pytest.raises(ValueError, match="parents must have positive fractions"):
        CandidateSpace(zero, dopants)

def test_family_split_holds_out_whole_systems(small_csv):
    data, _ = load_supercon(small_csv)
    parts = split_indices(data, "family", seed=1)
    systems = data.systems()
    train_systems = {systems[i] for i in parts["train"].tolist()}
    assert not train_systems & {systems[i] for i in parts["test"].tolist()}
    assert sorted(torch.cat(list(parts.values())).tolist()) == list(range(len(data)))
    random = split_indices(data, "random", seed=1)
    n = len(data)
    assert [random[p].numel() for p in ("train", "val", "test")] == [round(0.8 * n), round(0.1 * n),
                                                                     n - round(0.8 * n) - round(0.1 * n)]


def test_screen_is_resumable_and_matches_one_pass(small_csv, tmp_path, monkeypatch):
    data, _ = load_supercon(small_csv)
    torch.manual_seed(0)
    model = CompositionTransformer(TINY).eval()
    space = CandidateSpace(data.subset(torch.arange(20)), torch.tensor([37, 55, 19]), levels=(0.25, 1.0))
    common = dict(top=10, batch_size=64, implementation="plain", mc_samples=0, progress=False)
    whole = screen(model, space, out_dir=tmp_path / "whole", **common)
    screen(model, space, out_dir=tmp_path / "parts", limit=128, **common)
    interrupt_on_call(monkeypatch, supercon_screen, "score", 2)
    with pytest.raises(Interrupted) as stopped:
        screen(model, space, out_dir=tmp_path / "parts", checkpoint_interval_s=3600, **common)
    monkeypatch.undo()
    assert torch.load(stopped.value.path, weights_only=True)["next_index"] == 128 + 2 * 64  # saved on Ctrl-C
    resumed = screen(model, space, out_dir=tmp_path / "parts", **common)
    assert whole["candidates"] == len(space) and resumed["candidates"] == len(space) - 256
    first, second = ((tmp_path / name / "top.csv").read_text() for name in ("whole", "parts"))
    assert first == second
    rows = list(csv.DictReader(first.splitlines()))
    assert len(rows) == 10 and float(rows[0]["predicted_Tc_K"]) >= float(rows[-1]["predicted_Tc_K"])
    fused = score(model, space.padded_batch(0, 64), "fused", 0)[0]
    plain = score(model, space.padded_batch(0, 64), "plain", 0)[0]
    torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-4)
    with pytest.raises(CommandError, match="--restart"):  # another --top: another run
        screen(model, space, out_dir=tmp_path / "parts", **{**common, "top": 5})
    assert screen(model, space, out_dir=tmp_path / "parts", restart=True, **{**common, "top": 5})["candidates"] == \
        len(space)


def test_cli_train_screen_and_bench(small_csv, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["--data", str(small_csv), "--no-progress"]
    assert supercon("train", *args, "--out", str(out), "--epochs", "2", *TINY_OPTIONS) == 0
    for split in ("random", "family"):
        metrics = json.loads((out / split / "metrics.json").read_text())
        assert metrics["test"]["n"] > 0 and metrics["seed"] == 0 and len(metrics["history"]["epoch"]) == 2
        assert (out / split / "parity.png").stat().st_size > 0 and (out / split / "loss.png").stat().st_size > 0
        assert not (out / split / "checkpoint.pt").exists()
    model = str(out / "random" / "model.pt")
    assert supercon("screen", *args, "--model", model, "--out", str(out / "screen"), "--top", "5", "--limit", "3000",
                    "--batch-size", "1000", "--mc-samples", "4", "--min-dopant-count", "1") == 0
    rows = list(csv.DictReader((out / "screen" / "top.csv").open()))
    assert len(rows) == 5 and all(float(row["uncertainty_K"]) >= 0 for row in rows)
    parse_formula(rows[0]["formula"])
    formulas = {row["name"]: float(row["Tc"]) for row in csv.DictReader(small_csv.open()) if row["name"] in
                {r["nearest_known"] for r in rows} | {r["parent"] for r in rows}}
    for row in rows:  # the parent, the substitution, the nearest known composition with their measured Tc
        assert float(row["parent_Tc_K"]) == pytest.approx(formulas[row["parent"]], abs=1e-3)
        assert float(row["nearest_known_Tc_K"]) == pytest.approx(formulas[row["nearest_known"]], abs=1e-3)
        assert re.fullmatch(r"[A-Z][a-z]? for [A-Z][a-z]?, x = [0-9.]+", row["substitution"])
        assert 0 <= float(row["nearest_distance"]) <= 2
    assert (out / "screen" / "candidates.png").stat().st_size > 0
    assert supercon("train", *args, "--out", str(out), "--epochs", "2", *TINY_OPTIONS) == 0  # nothing left to do
    assert capsys.readouterr().out.count("already trained") == 2
    assert supercon("bench", *args, "--model", model, "--quick", "--candidates", "64", "--batch-size", "32",
                    "--out", str(out / "bench")) == 0
    record = json.loads(next((out / "bench").glob("supercon-*.json")).read_text())
    assert record["screening"]["fused"]["candidates"] == 64 and record["agreement"]["candidates"] == 64
    # the builds are compared on the transformer; the whole model (with its tree members) screens in its own row
    assert record["screening"]["whole_model"]["members"] == ["extra_trees", "lightgbm"]
    assert record["screening"]["whole_model"]["candidates"] == 64


def test_quick_train_runs_both_splits(tmp_path):
    """--quick's sizes, cut down here to one epoch on 300 rows of the packaged data."""
    out = tmp_path / "quick"
    assert supercon("train", "--quick", "--rows", "300", "--epochs", "1", "--no-progress", "--out", str(out)) == 0
    summary = json.loads((out / "train_summary.json").read_text())
    assert set(summary) == {"random", "family"}
    settings = json.loads((out / "random" / "metrics.json").read_text())["settings"]
    assert settings["model"]["d_model"] == 64 and settings["rows"] == 300


def test_packaged_data_loads():
    data, table = load_supercon()
    assert len(data) == 16406 and not table.rejected  # every packaged row parses: no warning lines
    assert data.formulas[0] == "Ba0.4K0.6Fe2As2" and data.targets[0] == pytest.approx(31.2)


def test_train_resumes_after_ctrl_c(small_csv, tmp_path, monkeypatch, capsys):
    """Ctrl-C mid-epoch saves the state and prints how to resume; the same command again finishes the run with
    exactly the numbers of a run never interrupted."""
    command = ["train", "--data", str(small_csv), "--no-progress", "--splits", "random", "--epochs", "3",
               "--batch-size", "32", *TINY_OPTIONS]
    assert supercon(*command, "--out", str(tmp_path / "whole")) == 0
    interrupt_on_call(monkeypatch, supercon_train, "make_batch", 12)  # epoch 2 of 3 (8 batches an epoch)
    assert supercon(*command, "--out", str(tmp_path / "parts")) == 130
    monkeypatch.undo()
    message = capsys.readouterr().err.strip().splitlines()
    assert len(message) == 1 and "run the same command again to resume" in message[0] and "--restart" in message[0]
    assert (tmp_path / "parts" / "random" / "checkpoint.pt").is_file()
    assert supercon(*command, "--out", str(tmp_path / "parts")) == 0
    assert "resuming from" in capsys.readouterr().out
    whole, parts = (json.loads((tmp_path / name / "random" / "metrics.json").read_text())
                    for name in ("whole", "parts"))
    assert parts["history"] == whole["history"] and parts["test"] == whole["test"]


def test_train_interrupted_without_out_dir_keeps_keyboard_interrupt(small_csv, monkeypatch):
    data, _ = load_supercon(small_csv)
    interrupt_on_call(monkeypatch, supercon_train, "make_batch", 2)
    with pytest.raises(KeyboardInterrupt):
        train(data, TrainConfig(epochs=1, model=TINY), torch.device("cpu"), progress=False)


def test_progress_in_a_log_file_is_one_line_per_update():
    log = io.StringIO()
    with progress_bar(3, "work", stream=log) as bar:
        for _ in range(3):
            bar.update(1)
    text = log.getvalue()
    assert "\r" not in text and text.endswith("\n")
    assert text.splitlines()[0].startswith("work:") and "3/3" in text.splitlines()[-1]


# ---------------------------------------------------------------------------------------------- bad input
def one_line_error(*argv: str) -> str:
    with pytest.raises(CommandError) as error:
        supercon(*argv)
    message = str(error.value)
    assert "\n" not in message
    return message


def test_not_a_model_is_recognised_before_any_work(tmp_path, small_csv):
    garbage = tmp_path / "notamodel.pt"
    garbage.write_bytes(b"this is not a torch file\n" * 10)
    other = tmp_path / "other.pt"
    torch.save({"weights": torch.ones(3)}, other)
    pickled = tmp_path / "pickled.pt"
    # needs weights_only=False: never suggested. (Not argparse.Namespace: importing Megatron-core, as its integration
    # tests do, adds that class to torch's weights-only allow-list for the rest of the process.)
    torch.save({"model": fractions.Fraction(1, 3)}, pickled)
    missing = tmp_path / "missing.pt"
    for path, expected in ((garbage, "is not a model file"), (other, "is a torch file but not a supercon model"),
                           (pickled, "is not a model file"), (missing, "no such model file")):
        for command in ("screen", "bench"):
            out = ["--out", str(tmp_path / "out")]
            message = one_line_error(command, "--model", str(path), "--data", str(tmp_path / "absent.csv"), *out)
            assert expected in message and "weights_only" not in message and "supercon train" in message
    checkpoint = tmp_path / "run" / "random" / "checkpoint.pt"
    save_atomic({"format": supercon_train.CHECKPOINT_FORMAT}, checkpoint)
    assert "unfinished training run" in one_line_error("screen", "--model", str(checkpoint), "--out", str(tmp_path))


def test_bad_training_input_is_one_line(tmp_path, small_csv):
    out = ["--out", str(tmp_path / "out"), "--no-progress"]
    few = tmp_path / "few.csv"
    few.write_text("name,Tc\n" + "".join(f"Nb3Sn,{t}\nXx2,{t}\n" for t in range(30)))
    message = one_line_error("train", "--data", str(few), *out)
    assert "30 readable compositions (30 rejected)" in message and "at least 100" in message
    assert "--epochs must be at least 1, got 0" in one_line_error("train", "--epochs", "0", *out)
    message = one_line_error("train", "--rows", "10", *out)
    assert "first 10 rows" in message and "larger --rows" in message
    assert "no such data file" in one_line_error("train", "--data", str(tmp_path / "absent.csv"), *out)
    assert "multiple of --heads" in one_line_error("train", "--d-model", "30", "--heads", "4", *out)
    assert "must be at least 1" in one_line_error("train", "--threads", "0", *out)


def test_tiny_or_empty_splits_are_refused(tmp_path):
    one_system = tmp_path / "one_system.csv"
    one_system.write_text("name,Tc\n" + "".join(f"Nb{3 + i / 100:g}Sn1,{i % 20 + 1}\n" for i in range(150)))
    message = one_line_error("train", "--data", str(one_system), "--splits", "family", "--out", str(tmp_path))
    assert "empty" in message and "random split" in message
    data, _ = load_supercon(one_system)
    parts = split_indices(data, "random", 0)
    assert min(index.numel() for index in parts.values()) >= supercon_train.MIN_SPLIT_ROWS


def test_rerun_with_other_settings_asks_for_restart(small_csv, tmp_path):
    command = ["train", "--data", str(small_csv), "--no-progress", "--splits", "random", "--out", str(tmp_path),
               *TINY_OPTIONS]
    assert supercon(*command, "--epochs", "1") == 0
    message = one_line_error(*command, "--epochs", "2")
    assert "epochs 1 -> 2" in message and "--restart" in message
    assert supercon(*command, "--epochs", "2", "--restart") == 0


def test_superconductors_split_holds_only_tc_above_zero(small_csv):
    data, _ = load_supercon(small_csv)
    parts = split_indices(data, "superconductors", 0)
    rows = torch.cat(list(parts.values()))
    assert bool((data.targets[rows] > 0).all()) and rows.unique().numel() == int((data.targets > 0).sum())


def test_curated_labels_merge_repeats_and_leave_out_conflicts(tmp_path, capsys):
    """Repeated compositions (another element order or scale) become one row at their median Tc; a 0 K row within
    the conflict distance of one at >= 30 K is left out with it; rows farther apart or of Tc below 30 K stay."""
    rows = [("La1.85Sr0.15Cu1O4", 38.0), ("Cu2O8La3.7Sr0.3", 30.0), ("La1.85Sr0.15Cu1O4", 36.0),  # median 36
            ("Y1Ba2Cu3O6.81", 92.3), ("Y1Ba2Cu3O6.82", 0.0),  # L1 0.0015 apart: a conflict
            ("Y1Ba2Cu3O6.0", 0.0),  # L1 0.09 from O6.81: kept
            ("Nb3Sn1", 18.0), ("Nb2.99Sn1.01", 0.0),  # below 30 K: kept
            ("Mg1B2", 39.0)]
    data = pack_compositions([parse_formula(f) for f, _ in rows], [f for f, _ in rows], [t for _, t in rows])
    curated, changes = curate_labels(data)
    assert changes == {"merged_groups": 1, "merged_rows": 3, "conflicting_rows": 2}
    assert curated.formulas == ["La1.85Sr0.15Cu1O4", "Y1Ba2Cu3O6.0", "Nb3Sn1", "Nb2.99Sn1.01", "Mg1B2"]
    torch.testing.assert_close(curated.targets, torch.tensor([36.0, 0.0, 18.0, 0.0, 39.0]))
    torch.testing.assert_close(curated.fraction_vectors(), data.fraction_vectors()[[0, 5, 6, 7, 8]])
    wider, changes = curate_labels(data, distance=0.1)  # O6.0 within 0.1 of O6.81 too
    assert changes["conflicting_rows"] == 3 and "Y1Ba2Cu3O6.0" not in wider.formulas
    assert curate_labels(data.subset(torch.tensor([6, 8])))[1] == {"merged_groups": 0, "merged_rows": 0,
                                                                   "conflicting_rows": 0}
    with pytest.raises(ValueError, match="distance must be"):
        curate_labels(data, distance=-1)
    # the command line: the same variant for training and the baselines, said on screen and in the results
    csv_path = tmp_path / "rows.csv"
    csv_path.write_text("name,Tc\n" + "".join(f"{f},{t}\n" for f, t in rows))
    with pytest.raises(CommandError, match="5 readable compositions after --labels curated"):
        supercon("baselines", "--data", str(csv_path), "--labels", "curated", "--out", str(tmp_path))
    assert "2 rows of conflicting near-duplicates" in capsys.readouterr().out
    path, _ = write_results([], ["random"], tmp_path / "results", {"labels": "curated"}, commit="abc1234")
    assert json.loads(path.read_text())["note"].startswith("Curated labels")
    assert path.with_suffix(".md").read_text().startswith("Curated labels")

def test_cli_baselines_beside_ours(small_csv, tmp_path, capsys):
    pytest.importorskip("sklearn")
    pytest.importorskip("lightgbm")
    args = ["--data", str(small_csv), "--no-progress"]
    assert supercon("train", *args, "--out", str(tmp_path / "ours"), "--epochs", "1", "--splits", "random",
                    *TINY_OPTIONS) == 0
    assert supercon("baselines", *args, "--out", str(tmp_path / "baselines"), "--seeds", "0,1", "--trees", "5",
                    "--splits", "random,superconductors", "--ours", str(tmp_path / "ours")) == 0
    path = next((tmp_path / "baselines").glob("supercon-baselines-*.json"))
    results = json.loads(path.read_text())
    assert {(r["model"], r["split"]) for r in results["records"]} == {
        (model, split) for model in ("knn", "random_forest", "extra_trees", "lightgbm")
        for split in ("random", "superconductors")} | {("ours", "random"), ("ours_transformer", "random")}
    assert results["summary"]["extra_trees"]["random"]["seeds"] == [0, 1]
    table = path.with_suffix(".md").read_text()
    assert "| ours (d=32, layers=1, experts=4, epochs=1, cpu + extra trees + LightGBM) | " in table
    assert "| ours, the transformer alone (d=32, layers=1, experts=4, epochs=1, cpu) | " in table
    assert "| LightGBM | " in table
    assert "LightGBM" in capsys.readouterr().out
    # the baselines measured once, tabled again beside the model's runs without refitting them
    assert supercon("baselines", "--models", "none", "--include", str(path), "--splits", "random,superconductors",
                    "--out", str(tmp_path / "again")) == 0
    again = json.loads(next((tmp_path / "again").glob("supercon-baselines-*.json")).read_text())
    assert again["records"] == results["records"] and again["summary"] == results["summary"]
    # new runs of the model beside the earlier baselines replace the earlier file's runs of it
    assert supercon("baselines", "--models", "none", "--include", str(path), "--ours", str(tmp_path / "ours"),
                    "--splits", "random,superconductors", "--out", str(tmp_path / "replaced")) == 0
    replaced = json.loads(next((tmp_path / "replaced").glob("supercon-baselines-*.json")).read_text())["records"]
    assert sorted(r["model"] for r in replaced if r["model"].startswith("ours")) == ["ours", "ours_transformer"]
    with pytest.raises(CommandError, match="as a supercon baselines result"):
        supercon("baselines", "--models", "none", "--include", str(small_csv), "--out", str(tmp_path / "bad"))


def test_baselines_features_are_the_model_statistics(small_csv):
    from flashmoe_science.science.supercon_baselines import composition_features

    data, _ = load_supercon(small_csv)
    features = composition_features(data)
    assert features.shape == (len(data), len(ELEMENT_SYMBOLS) + 4 * element_property_matrix().shape[1])
    torch.testing.assert_close(features[:, :len(ELEMENT_SYMBOLS)], data.fraction_vectors())
    assert torch.isfinite(features).all()


def test_weight_average_is_applied_then_restored():
    from flashmoe_science.science.supercon_train import WeightAverage

    model = torch.nn.Linear(3, 1)
    start = model.weight.detach().clone()
    average = WeightAverage(model, decay=0.9)
    with torch.no_grad():
        model.weight.add_(1.0)
    average.update(model)  # the first steps' decay is ramped: 2 / 11 of the old average stays
    expected = start + (1 - 2 / 11) * 1.0
    with average.applied(model):
        torch.testing.assert_close(model.weight.detach(), expected)
    torch.testing.assert_close(model.weight.detach(), start + 1.0)
    with pytest.raises(ValueError, match="decay"):
        WeightAverage(model, decay=1.0)


def test_two_stage_head_trains_and_predicts_in_kelvin(small_csv):
    data, _ = load_supercon(small_csv)
    config = TrainConfig(epochs=2, batch_size=64, model=replace(TINY, two_stage=True), implementation="plain")
    model, metrics = train(data, config, torch.device("cpu"), progress=False)
    train_targets = data.targets[split_indices(data, "random", 0)["train"]]
    assert float(model.target_mean) == pytest.approx(float(train_targets[train_targets > 0].mean()))  # Tc if > 0
    assert model.head_out.out_features == 2 and metrics["test"]["n"] > 0
    pooled = data.batch(torch.arange(8)).padded().pooled(model.eval())
    tc, logit = model.head_outputs(pooled)
    torch.testing.assert_close(tc, torch.sigmoid(logit) * (model.head_out(torch.nn.functional.silu(
        model.head_hidden(pooled)))[:, 0] * model.target_std + model.target_mean))
