"""Magpie-style composition descriptors against a per-composition float64 loop over the element table."""

import math

import pytest
import torch

from flashmoe_science.science.element_table import ELEMENT_PROPERTIES, PROPERTY_NAMES
from flashmoe_science.science.supercon_data import pack_compositions
from flashmoe_science.science.supercon_features import BLOCKS, NORMS, feature_count, magpie_features
from flashmoe_science.science.supercon_model import ELEMENT_SYMBOLS, element_property_matrix


def _reference(composition: dict[str, float]) -> list[float]:
    """The descriptors of one composition, element by element in float64."""
    table = element_property_matrix().double()
    symbols = list(composition)
    total = sum(composition.values())
    x = [composition[s] / total for s in symbols]
    rows = [table[ELEMENT_SYMBOLS.index(s)].tolist() for s in symbols]
    out = {name: [] for name in ("mean", "dev", "min", "max", "range", "mode")}
    mode = x.index(max(x))
    for k in range(len(PROPERTY_NAMES)):
        values = [row[k] for row in rows]
        mean = sum(f * v for f, v in zip(x, values))
        out["mean"].append(mean)
        out["dev"].append(sum(f * abs(v - mean) for f, v in zip(x, values)))
        out["min"].append(min(values))
        out["max"].append(max(values))
        out["range"].append(max(values) - min(values))
        out["mode"].append(values[mode])
    raw = {name: [ELEMENT_PROPERTIES[s][PROPERTY_NAMES.index(name)] for s in symbols]
           for name in ("n_valence", "en_pauling", *(f"block_{b}" for b in BLOCKS))}
    valence = [f * (v or 0.0) for f, v in zip(x, raw["n_valence"])]
    blocks = [sum(v * block for v, block in zip(valence, raw[f"block_{b}"])) / max(sum(valence), 1e-12)
              for b in BLOCKS]
    ionic = [[0.0 if a is None or b is None else 1 - math.exp(-(a - b) ** 2 / 4) for b in raw["en_pauling"]]
             for a in raw["en_pauling"]]
    vector = [0.0] * len(ELEMENT_SYMBOLS)
    for s, f in zip(symbols, x):
        vector[ELEMENT_SYMBOLS.index(s)] += f
    return [*(v for name in out for v in out[name]), float(len(x)),
            *(sum(f ** p for f in x) ** (1 / p) for p in NORMS), *blocks,
            max(max(row) for row in ionic), sum(x[i] * x[j] * ionic[i][j] for i in range(len(x)) for j in range(len(x))),
            *vector]


def test_magpie_features_match_a_loop_over_the_table():
    generator = torch.Generator().manual_seed(0)
    compositions = [{"Nb": 1.0}, {"Mg": 1.0, "B": 2.0}, {"Y": 1.0, "Ba": 2.0, "Cu": 3.0, "O": 6.93},
                    {"He": 0.5, "Ne": 0.5}]  # ties in the largest fraction; elements without a Pauling value
    for _ in range(5):  # random odd-sized compositions
        count = int(torch.randint(2, 8, (1,), generator=generator))
        picks = torch.randperm(len(ELEMENT_SYMBOLS), generator=generator)[:count].tolist()
        amounts = (torch.rand(count, generator=generator, dtype=torch.float64) * 5 + 0.01).tolist()
        compositions.append({ELEMENT_SYMBOLS[i]: a for i, a in zip(picks, amounts)})
    data = pack_compositions(compositions, [str(c) for c in compositions])
    features = magpie_features(data.elements, data.fractions, data.offsets)
    assert features.shape == (len(compositions), feature_count()) and features.dtype == torch.float32
    # the packed fractions are float32: the reference reads the same rounded fractions
    rounded = [dict(zip(c, data.fractions[a:b].double().tolist()))
               for c, a, b in zip(compositions, data.offsets[:-1].tolist(), data.offsets[1:].tolist())]
    expected = torch.tensor([_reference(c) for c in rounded], dtype=torch.float64)
    torch.testing.assert_close(features.double(), expected, rtol=1e-6, atol=1e-6)


def test_magpie_features_empty_and_bad_input():
    empty = magpie_features(torch.zeros(0, dtype=torch.int64), torch.zeros(0), torch.zeros(1, dtype=torch.int64))
    assert empty.shape == (0, feature_count())
    with pytest.raises(ValueError, match="fractions"):
        magpie_features(torch.zeros(3, dtype=torch.int64), torch.zeros(2), torch.tensor([0, 3]))
