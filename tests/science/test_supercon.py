"""The supercon workload on the CPU: formula parsing, the two builds' agreement, the candidate space, a tiny
training run and a resumed screening run through the CLI (a few hundred rows: the pipeline, not the score)."""

import csv
import re
import json
from pathlib import Path

import pytest
import torch

from flashmoe_science.cli import main
from flashmoe_science.science.formula import FormulaError, parse_formula, read_formula_csv
from flashmoe_science.science.supercon_data import load_supercon, pack_compositions, split_indices
from flashmoe_science.science.supercon_model import (
    ELEMENT_SYMBOLS,
    CompositionTransformer,
    ModelConfig,
    element_property_matrix,
)
from flashmoe_science.science.supercon_screen import CandidateSpace, pack, score, screen

ROOT = Path(__file__).resolve().parents[2]
# the data: ../shared beside a clone (CI), or shared/ inside a checkout
DATA = next((p for p in (ROOT.parent / "shared/data/supercon.csv", ROOT / "shared/data/supercon.csv") if p.is_file()),
            ROOT.parent / "shared/data/supercon.csv")
TINY = ModelConfig(d_model=32, num_heads=2, num_layers=1, num_experts=4, top_k=2, d_ff=32, fraction_frequencies=4)


@pytest.fixture
def small_csv(tmp_path):
    """A real slice of SuperCon when it is there, else a hand-written one; plus two bad lines."""
    path = tmp_path / "supercon.csv"
    if DATA.is_file():
        with DATA.open() as handle:
            lines = [next(handle) for _ in range(301)]
    else:
        metals = ("Nb", "Ti", "V", "Zr", "Mo", "La", "Y", "Pb", "Sn", "Ga", "Al", "In")
        lines = ["name,Tc\n"] + [f"{a}{3 - x / 4:g}{b}{1 + x / 4:g},{(i + j + x) % 23 + 0.5:g}\n"
                                  for i, a in enumerate(metals) for j, b in enumerate(metals[i + 1:]) for x in range(5)]
    lines.insert(5, "Sm1Ba-1Cu3O6.94,10\n")
    lines.insert(9, "La2CuO4,n/a\n")
    path.write_text("".join(lines))
    return path


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
    packed = pack(padded)
    assert packed.cu_seqlens[-1] == padded.mask.sum() and packed.elements.numel() == padded.mask.sum()
    for i, formula in enumerate(formulas):  # the tensors decode to the formula written for the same index
        row = {ELEMENT_SYMBOLS[e]: f for e, f, m in zip(padded.elements[i].tolist(), padded.fractions[i].tolist(),
                                                        padded.mask[i].tolist()) if m}
        amounts = parse_formula(formula)
        total = sum(amounts.values())
        assert row == pytest.approx({s: a / total for s, a in amounts.items()})


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


def test_screen_is_resumable_and_matches_one_pass(small_csv, tmp_path):
    data, _ = load_supercon(small_csv)
    torch.manual_seed(0)
    model = CompositionTransformer(TINY).eval()
    space = CandidateSpace(data.subset(torch.arange(20)), torch.tensor([37, 55, 19]), levels=(0.25, 1.0))
    common = dict(top=10, batch_size=64, implementation="plain", mc_samples=0, progress=False)
    whole = screen(model, space, out_dir=tmp_path / "whole", **common)
    screen(model, space, out_dir=tmp_path / "parts", limit=128, **common)
    screen(model, space, out_dir=tmp_path / "parts", resume=True, checkpoint_every=1, **common)
    assert whole["candidates"] == len(space)
    first, second = ((tmp_path / name / "top.csv").read_text() for name in ("whole", "parts"))
    assert first == second
    rows = list(csv.DictReader(first.splitlines()))
    assert len(rows) == 10 and float(rows[0]["predicted_Tc_K"]) >= float(rows[-1]["predicted_Tc_K"])
    fused = score(model, space.padded_batch(0, 64), "fused", 0)[0]
    plain = score(model, space.padded_batch(0, 64), "plain", 0)[0]
    torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-4)


def test_cli_train_and_screen(small_csv, tmp_path):
    out = tmp_path / "run"
    args = ["--data", str(small_csv), "--no-progress"]
    assert main(["supercon", "train", *args, "--out", str(out), "--epochs", "2", "--d-model", "32", "--heads", "2",
                 "--layers", "1", "--experts", "4", "--d-ff", "32"]) == 0
    for split in ("random", "family"):
        metrics = json.loads((out / split / "metrics.json").read_text())
        assert metrics["test"]["n"] > 0 and metrics["seed"] == 0 and len(metrics["history"]["epoch"]) == 2
        assert (out / split / "parity.png").stat().st_size > 0 and (out / split / "loss.png").stat().st_size > 0
    assert main(["supercon", "screen", *args, "--model", str(out / "random" / "model.pt"), "--out",
                 str(out / "screen"), "--top", "5", "--limit", "3000", "--batch-size", "1000", "--mc-samples", "4",
                 "--dtype", "float32", "--min-dopant-count", "1"]) == 0
    rows = list(csv.DictReader((out / "screen" / "top.csv").open()))
    assert len(rows) == 5 and all(float(row["uncertainty_K"]) >= 0 for row in rows)
    parse_formula(rows[0]["formula"])
