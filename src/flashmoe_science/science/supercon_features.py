"""Magpie-style composition descriptors for the tree members of the Tc model (Ward et al. 2016, as used for Tc by
Stanev et al. 2018), computed from the packed compositions with tensor operations on any device.

Per composition (elements ``e_i`` with fractions ``x_i``), for each of the 29 standardised element properties
``p`` of :func:`~flashmoe_science.science.supercon_model.property_table`:

- the fraction-weighted mean ``m = sum_i x_i p_i`` and average absolute deviation ``sum_i x_i |p_i - m|``,
- the min, the max and the range (max - min) over the elements present,
- the mode: the property of the element with the largest fraction (the first such element on a tie).

Then the stoichiometry: the element count and the ``L^p`` norms ``(sum_i x_i^p)^(1/p)`` for p = 2, 3, 5, 7, 10
(1 for an element, approaching the largest fraction as p grows); the share of the valence electrons
``x_i * n_valence_i`` that sits on s-, p-, d- and f-block elements; and the ionic character of the Pauling
electronegativities ``I(a, b) = 1 - exp(-(a - b)^2 / 4)``: its maximum over element pairs and its fraction-weighted
mean ``sum_{i,j} x_i x_j I(chi_i, chi_j)`` (elements without a Pauling value leave the pairs they are in out).
Last, the element-fraction vector. Everything is computed in float64 and rounded once to float32, as the tree
libraries see the features.
"""

from __future__ import annotations

import torch

from flashmoe_science.science.element_table import ELEMENT_PROPERTIES, PROPERTY_NAMES
from flashmoe_science.science.supercon_model import ELEMENT_SYMBOLS, property_table

PROPERTY_STATISTICS = ("mean", "avg_dev", "min", "max", "range", "mode")
NORMS = (2, 3, 5, 7, 10)
BLOCKS = ("s", "p", "d", "f")
FEATURE_SETS = ("classic", "magpie")


def feature_count() -> int:
    """Columns of :func:`magpie_features`."""
    return (len(PROPERTY_STATISTICS) * len(PROPERTY_NAMES) + 1 + len(NORMS) + len(BLOCKS) + 2
            + len(ELEMENT_SYMBOLS))


def _raw_column(name: str) -> torch.Tensor:
    """``(96,)`` float64 of one raw (unstandardised) property, NaN where unknown."""
    column = PROPERTY_NAMES.index(name)
    return torch.tensor([float("nan") if values[column] is None else values[column]
                         for values in ELEMENT_PROPERTIES.values()], dtype=torch.float64)


def magpie_features(elements: torch.Tensor, fractions: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Packed compositions (``elements (T,)`` element indices, ``fractions (T,)`` summing to 1 per composition,
    ``cu_seqlens (N + 1,)``) -> ``(N, feature_count())`` float32 descriptors (the module docstring's order)."""
    if elements.dim() != 1 or fractions.shape != elements.shape:
        raise ValueError(f"elements and fractions must be (T,) of one length, got {tuple(elements.shape)} and "
                         f"{tuple(fractions.shape)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be (N + 1,), got shape {tuple(cu_seqlens.shape)}")
    device = elements.device
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    num = lengths.numel()
    segment = torch.repeat_interleave(torch.arange(num, device=device), lengths, output_size=elements.numel())
    x = fractions.double()
    w = x[:, None]
    p = property_table(device)[elements]
    width = p.shape[1]
    rows = segment[:, None].expand_as(p)

    mean = p.new_zeros(num, width).index_add_(0, segment, p * w)
    avg_dev = p.new_zeros(num, width).index_add_(0, segment, (p - mean[segment]).abs() * w)
    low = p.new_zeros(num, width).scatter_reduce_(0, rows, p, "amin", include_self=False)
    high = p.new_zeros(num, width).scatter_reduce_(0, rows, p, "amax", include_self=False)
    # the mode: the first token of each composition whose fraction equals the composition's largest
    largest = x.new_zeros(num).scatter_reduce_(0, segment, x, "amax", include_self=False)
    token = torch.arange(elements.numel(), device=device)
    first = torch.full((num,), elements.numel(), device=device, dtype=torch.long).scatter_reduce_(
        0, segment, torch.where(x == largest[segment], token, elements.numel()), "amin")
    mode = p[first.clamp_max(max(elements.numel() - 1, 0))] if elements.numel() else p.new_zeros(num, width)

    norms = [lengths.double()[:, None]]
    for order in NORMS:
        norms.append(x.new_zeros(num).index_add_(0, segment, x.pow(order)).pow(1 / order)[:, None])

    valence = torch.nan_to_num(_raw_column("n_valence").to(device)[elements]) * x
    total = x.new_zeros(num).index_add_(0, segment, valence).clamp_min(1e-12)
    blocks = [x.new_zeros(num).index_add_(0, segment, valence * _raw_column(f"block_{b}").to(device)[elements])
              / total for b in BLOCKS]

    chi = _raw_column("en_pauling").to(device)[elements]
    known = ~torch.isnan(chi)
    # all ordered token pairs within a composition: compositions are a handful of elements, so pairs stay few
    pair_segment = torch.repeat_interleave(segment, lengths[segment])
    starts = cu_seqlens[:-1].long()[segment]
    offsets_within = torch.arange(pair_segment.numel(), device=device) - torch.repeat_interleave(
        torch.cumsum(lengths[segment], 0) - lengths[segment], lengths[segment])
    a = torch.repeat_interleave(token, lengths[segment])
    b = torch.repeat_interleave(starts, lengths[segment]) + offsets_within
    both = known[a] & known[b]
    ionic = torch.where(both, 1 - torch.exp(-(torch.nan_to_num(chi[a]) - torch.nan_to_num(chi[b])).square() / 4), 0)
    ionic_max = x.new_zeros(num).scatter_reduce_(0, pair_segment, ionic, "amax", include_self=True)
    ionic_mean = x.new_zeros(num).index_add_(0, pair_segment, ionic * x[a] * x[b])

    vector = x.new_zeros(num, len(ELEMENT_SYMBOLS)).index_put_((segment, elements), x, accumulate=True)
    return torch.cat([mean, avg_dev, low, high, high - low, mode, *norms, *(b[:, None] for b in blocks),
                      ionic_max[:, None], ionic_mean[:, None], vector], dim=1).float()
