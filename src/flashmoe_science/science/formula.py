"""Chemical formulas -> element amounts: ``"Ba0.2La1.8Cu1O4"`` -> ``{"Ba": 0.2, "La": 1.8, "Cu": 1.0, "O": 4.0}``.

Accepted: element symbols of elements 1..96, each followed by an optional amount (integer or decimal, ``1`` when
absent), parenthesised groups with an optional multiplier (``(La0.9Sr0.1)2CuO4``), and the hydrogen isotopes ``D``
and ``T`` (counted as H). A symbol repeated in one formula has its amounts summed; an element of amount 0 (the x = 0
end of a doping series, ``La2Sr0CuO4``) is left out and reported. Anything else (stray characters, signs, unknown
symbols, unbalanced parentheses, no element left) raises :class:`FormulaError` saying what and where;
:func:`read_formula_csv` collects those per line instead of dropping them silently.
"""

from __future__ import annotations

import csv
import gzip
import re
from dataclasses import dataclass, field
from pathlib import Path

from flashmoe_science.science.element_table import ELEMENT_PROPERTIES

ISOTOPE_ALIASES = {"D": "H", "T": "H"}  # deuterium and tritium: the element's properties are hydrogen's
_TOKEN = re.compile(r"\s*(?:(?P<symbol>[A-Z][a-z]?)|(?P<open>\()|(?P<close>\))|(?P<amount>\d+(?:\.\d*)?|\.\d+))")


class FormulaError(ValueError):
    """A formula that cannot be read; ``position`` is the 0-based character where reading stopped."""

    def __init__(self, formula: str, position: int, reason: str):
        super().__init__(f"{reason} at character {position} of {formula!r}")
        self.formula, self.position, self.reason = formula, position, reason


def parse_formula(formula: str) -> dict[str, float]:
    """Element symbol -> amount (> 0), in order of first appearance. Raises FormulaError (a ValueError)."""
    return _parse(formula)[0]


def _parse(formula: str) -> tuple[dict[str, float], list[str]]:
    """(the composition, the symbols left out for an amount of 0)."""
    if not isinstance(formula, str):
        raise TypeError(f"formula must be a str, got {type(formula).__name__}")
    text = formula.strip()
    if not text:
        raise FormulaError(formula, 0, "empty formula")
    # each open level: its parts, [amounts, multiplier] (an element or a closed group), summed when it closes
    stack: list[list[list]] = [[]]
    can_multiply = False  # an amount may follow: the last part has no multiplier of its own yet
    position = 0
    while position < len(text):
        match = _TOKEN.match(text, position)
        if match is None:
            raise FormulaError(formula, position, f"unexpected character {text[position]!r}")
        kind, value = match.lastgroup, match.group(match.lastgroup)
        if kind == "symbol":
            symbol = ISOTOPE_ALIASES.get(value, value)
            if symbol not in ELEMENT_PROPERTIES:
                raise FormulaError(formula, position, f"unknown element {value!r}")
            stack[-1].append([{symbol: 1.0}, 1.0])
        elif kind == "open":
            stack.append([])
        elif kind == "close":
            if len(stack) == 1:
                raise FormulaError(formula, position, "')' without a matching '('")
            stack[-2].append([_sum_parts(stack.pop()), 1.0])
        else:
            if not can_multiply:
                raise FormulaError(formula, position, f"amount {value} follows no element or group")
            stack[-1][-1][1] = float(value)
        can_multiply = kind in ("symbol", "close")
        position = match.end()
    if len(stack) > 1:
        raise FormulaError(formula, len(text), "'(' without a matching ')'")
    total = _sum_parts(stack[0])
    composition = {symbol: amount for symbol, amount in total.items() if amount > 0}
    if not composition:
        raise FormulaError(formula, len(text), "no element with an amount > 0")
    return composition, [symbol for symbol, amount in total.items() if amount <= 0]


def _sum_parts(parts: list[list]) -> dict[str, float]:
    total: dict[str, float] = {}
    for amounts, multiplier in parts:
        for symbol, amount in amounts.items():
            total[symbol] = total.get(symbol, 0.0) + amount * multiplier
    return total


@dataclass
class RejectedLine:
    line: int  # 1-based line number in the file (the header is line 1)
    text: str
    reason: str


@dataclass
class FormulaTable:
    """The readable rows of a ``formula,value`` CSV, every rejected line with its reason, and the lines read with
    an element of amount 0 left out."""

    formulas: list[str] = field(default_factory=list)
    compositions: list[dict[str, float]] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    rejected: list[RejectedLine] = field(default_factory=list)
    zero_amounts: list[RejectedLine] = field(default_factory=list)

    def summary(self, max_lines: int = 10) -> str:
        lines = [f"{len(self.formulas)} formulas read ({len(self.zero_amounts)} with an element of amount 0 left "
                 f"out), {len(self.rejected)} rejected"]
        lines += [f"  line {r.line}: {r.text!r}: {r.reason}" for r in self.rejected[:max_lines]]
        if len(self.rejected) > max_lines:
            lines.append(f"  ... and {len(self.rejected) - max_lines} more")
        return "\n".join(lines)


def read_formula_csv(path: str | Path, formula_column: str = "name", value_column: str = "Tc",
                     limit: int | None = None) -> FormulaTable:
    """Reads ``path`` (a CSV with a header; gzip-compressed when its name ends in ``.gz``) into a FormulaTable;
    ``limit``: stop after that many data lines."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such data file: {path}")
    table = FormulaTable()
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", newline="") as handle:
        reader = csv.DictReader(handle)
        missing = {formula_column, value_column} - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{path} has no column(s) {sorted(missing)}; its header is {reader.fieldnames}")
        for index, row in enumerate(reader):
            if limit is not None and index >= limit:
                break
            line, formula, value_text = reader.line_num, row[formula_column], row[value_column]
            try:
                value = float(value_text)
            except (TypeError, ValueError):
                table.rejected.append(RejectedLine(line, formula, f"{value_column} {value_text!r} is not a number"))
                continue
            try:
                composition, zero_symbols = _parse(formula)
            except FormulaError as error:
                table.rejected.append(RejectedLine(line, formula, str(error)))
                continue
            if zero_symbols:
                table.zero_amounts.append(RejectedLine(line, formula, f"amount 0 left out: {', '.join(zero_symbols)}"))
            table.formulas.append(formula)
            table.compositions.append(composition)
            table.values.append(value)
    return table


def format_formula(composition: dict[str, float], digits: int = 4) -> str:
    """``{"La": 1.8, "Sr": 0.2, "Cu": 1, "O": 4}`` -> ``"La1.8Sr0.2Cu1O4"`` (amounts rounded to ``digits``)."""
    return "".join(f"{symbol}{round(amount, digits):g}" for symbol, amount in composition.items())
