"""A packed batch's per-row statistics in the padded layout the sm_90 backward stages by TMA
(seqlen.padded_stat_rows, seqlen.padded_row_start, bwd_prep.padded_stats_kernel): the host's size, and the
kernels' rule and preprocess under the Triton interpreter (padded_stats_interpreter_check.py)."""

from pathlib import Path

from flashmoe_science.attention.seqlen import padded_stat_rows
from interpreter_driver import interpreter_suite, run_marked_suite


def test_padded_rows_per_head_leave_three_slots_per_sequence_and_stay_aligned():
    assert padded_stat_rows(200, 5) == 216 and padded_stat_rows(16, 0) == 16
    for total in range(0, 40):
        for seqs in range(0, 6):
            rows = padded_stat_rows(total, seqs)
            assert rows % 4 == 0 and total + 3 * seqs <= rows < total + 3 * seqs + 4


@interpreter_suite(Path(__file__).with_name("padded_stats_interpreter_check.py"))
def test_padded_layout_under_the_interpreter(request):
    run_marked_suite(request)
